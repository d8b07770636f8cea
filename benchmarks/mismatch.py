"""The train-inference gap that top-p / top-k / min-p open, with and without the sampling-mask replay, and its cost.

A sampler with truncation draws each token from the truncated, renormalised
distribution and reports its log-prob there (vLLM's `processed_logprobs`, the
hf rollout's). Here random logits (tokens x vocabulary, scaled to a peaked
distribution like a trained model's) stand in for a batch: tokens are
sampled from the truncated distribution, and the trainer's log-probs are
computed by `logprobs_from_logits` without the mask (the full softmax) and
with it (`truncation=`, the replay). Reported per setting: the gap
(`kl` = mean of rollout minus trainer log-prob, verl's k1) and the mean
importance ratio exp(trainer - rollout) each way, and the time of the
trainer's blockwise log-prob with the replay over without (one thread,
median of `--reps`). `--noise` adds Gaussian noise of that size to the
trainer's logits (another kernel's or precision's rounding), so the replayed
gap is that noise's and not zero.

The grid (`measure_grid`) goes one step further back, to the LM head: hidden
states (tokens x `--hidden`, bf16) through a head weight (vocabulary x
hidden, bf16) on the engine's side, and the same hidden states with a bf16
body's rounding (`--body-noise`, relative) on the trainer's, each side's head
in bf16 (its logits rounded to bf16) or in float32 (`model.lm_head_fp32`:
both operands upcast at the matmul). For {no replay, replay} x {bf16, fp32
head} x {top_p 1, 0.8} it reports the gap (mean and max |rollout - trainer|
log-prob, k3 KL), the IS ratio's mean, min, max and std, and the trainer's
head + log-prob time as a ratio to the bf16 head without replay at top_p 1,
all in one run.

The exact mode (`rollout.exact`, `exact_runs`) is a property of a training
run, not of a head: tiny training runs (hf rollout, float32) with and
without it, in this process, give the time per step of each and of its
old-log-prob forward (medians over the steps after the first) and the
largest |rollout - trainer| log-prob they log.

    python benchmarks/mismatch.py                 # 2048 tokens x 32,000 vocabulary; grid at hidden 1024
    python benchmarks/mismatch.py --smoke         # seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from conveyor.algos.logprob import logprobs_from_logits
from conveyor.algos.sampling_mask import Truncation, truncated_log_softmax

SETTINGS = {"top_p=1": Truncation(), "top_p=0.8": Truncation(top_p=0.8), "top_k=50,top_p=0.9": Truncation(50, 0.9)}
GRID_TOP_P = (1.0, 0.8)
HEADS = ("bf16", "fp32")


def measure(
    tokens: int, vocab: int, truncation: Truncation, temperature: float, noise: float, reps: int, seed: int = 0
) -> dict:
    """One setting: gap and mean importance ratio without and with the replay, and the replay's time ratio."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, vocab, generator=gen) * 4.0
    engine_logp = truncated_log_softmax(logits, truncation, temperature)
    sampled = torch.multinomial(engine_logp.exp(), 1, generator=gen)[:, 0]
    rollout = engine_logp.gather(-1, sampled[:, None])[:, 0]
    trainer_logits = logits + noise * torch.randn(logits.shape, generator=gen) if noise > 0 else logits
    out: dict = {"tokens": tokens, "vocab": vocab, "truncation": vars(truncation), "noise": noise}
    seconds = {}
    for way, trunc in (("full", None), ("replay", truncation)):

        def run(trunc=trunc) -> torch.Tensor:
            return logprobs_from_logits(trainer_logits, sampled, temperature=temperature, truncation=trunc)

        lp = run()
        log_ratio = (lp - rollout).double()
        out[f"kl_{way}"] = float(-log_ratio.mean())
        out[f"is_mean_{way}"] = float(log_ratio.exp().mean())
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        seconds[way] = statistics.median(times)
    out["time_ratio_replay_over_full"] = seconds["replay"] / seconds["full"]
    out["seconds_full"] = seconds["full"]
    return out


def _head(hidden: torch.Tensor, weight: torch.Tensor, head: str) -> torch.Tensor:
    """Logits of a bf16 body's hidden states: the bf16 head's (rounded to bf16) or the float32 head's."""
    if head == "fp32":
        return torch.nn.functional.linear(hidden.float(), weight.float())
    return torch.nn.functional.linear(hidden, weight)


def _gap(trainer: torch.Tensor, rollout: torch.Tensor) -> dict:
    """The rollout-vs-trainer gap of per-token log-probs: |diff| mean and max, k3 KL, and the IS ratio's stats."""
    log_ratio = (trainer - rollout).double()
    ratio = log_ratio.exp()
    return {
        "abs_diff_mean": float(log_ratio.abs().mean()),
        "abs_diff_max": float(log_ratio.abs().max()),
        "k3_kl": float((ratio - 1 - log_ratio).mean()),
        "is_mean": float(ratio.mean()),
        "is_min": float(ratio.min()),
        "is_max": float(ratio.max()),
        "is_std": float(ratio.std()),
    }


def measure_grid(
    tokens: int, vocab: int, hidden: int, temperature: float, body_noise: float, reps: int, seed: int = 0
) -> list[dict]:
    """{no replay, replay} x {bf16, fp32 head} x {top_p 1, 0.8}: gap, IS statistics and time ratio, one row each.

    The rollout samples from its own head's truncated distribution; the trainer's head sees the same hidden states
    with relative noise `body_noise` (another kernel's bf16 rounding of the body), computes its logits in the same
    head dtype and scores the sampled tokens with or without the replay. Time: the trainer's head and log-prob,
    median of `reps`, over the bf16 head without replay at top_p 1.
    """
    gen = torch.Generator().manual_seed(seed)
    # Logits of standard deviation about 4 (a peaked, trained model's), from unit hidden states.
    weight = (torch.randn(vocab, hidden, generator=gen) * (4.0 / hidden**0.5)).to(torch.bfloat16)
    engine_hidden = torch.randn(tokens, hidden, generator=gen)
    trainer_hidden = engine_hidden * (1 + body_noise * torch.randn(tokens, hidden, generator=gen))
    engine_hidden, trainer_hidden = engine_hidden.to(torch.bfloat16), trainer_hidden.to(torch.bfloat16)
    for head in HEADS:  # the first bf16 / float32 matmul of a process sets its kernels up: not in any timing
        _head(trainer_hidden, weight, head)
    rows, seconds = [], {}
    for top_p in GRID_TOP_P:
        truncation = Truncation(top_p=top_p)
        for head in HEADS:
            engine_logp = truncated_log_softmax(_head(engine_hidden, weight, head), truncation, temperature)
            sampled = torch.multinomial(engine_logp.exp(), 1, generator=gen)[:, 0]
            rollout = engine_logp.gather(-1, sampled[:, None])[:, 0]
            for replay in (False, True):

                def run(head=head, trunc=truncation if replay else None) -> torch.Tensor:
                    logits = _head(trainer_hidden, weight, head)
                    return logprobs_from_logits(logits, sampled, temperature=temperature, truncation=trunc)

                row = {"top_p": top_p, "head": head, "replay": replay, **_gap(run(), rollout)}
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - t0)
                seconds[(top_p, head, replay)] = statistics.median(times)
                rows.append(row)
    base = seconds[(1.0, "bf16", False)]
    for row in rows:
        row["seconds"] = seconds[(row["top_p"], row["head"], row["replay"])]
        row["time_ratio"] = row["seconds"] / base
    return rows


# A tiny training run (tests/conftest.py's TINY_RUN, larger batches): 16 prompts x 4 samples a step.
TINY = [
    "data.train_batch_size=16",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "critic.ppo_mini_batch_size=16",
    "data.synthetic.num_train=256",
    "data.synthetic.num_val=8",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
    "trainer.test_freq=0",
    "trainer.logger=[jsonl]",
    "trainer.progress_bar=false",
    "trainer.dump_freq=0",
]
# What rollout_corr/* needs logged (the IS weights, untruncated); exact then adds nothing but itself.
MEASURED = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=10.0"]
EXACT_ARMS = {
    "hf (bypass: no old-log-prob forward)": [],
    "hf, rollout_is=token (old-log-prob forward)": MEASURED,
    "hf, rollout.exact=true": ["actor_rollout_ref.rollout.exact=true"],
    "hf, rollout.exact=true, rollout_is=token": ["actor_rollout_ref.rollout.exact=true", *MEASURED],
}


def exact_runs(steps: int, root: str, seed: int = 0) -> list[dict]:
    """Tiny training runs with and without `rollout.exact`, one after another in this process: time per step (median
    after the first) as a ratio to the first arm's, and the largest rollout-vs-trainer gap they log."""
    from conveyor.config import load_config
    from conveyor.trainer.run import run_training

    rows = []
    for name, overrides in EXACT_ARMS.items():
        run_dir = f"{root}/{len(rows)}"
        cfg = load_config(
            None,
            TINY
            + overrides
            + [f"trainer.total_training_steps={steps}", f"trainer.seed={seed}", f"trainer.default_local_dir={run_dir}"],
        )
        run_training(cfg)
        lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
        metrics = [r for r in (json.loads(line) for line in lines) if "actor/pg_loss" in r]
        timed = metrics[1:] or metrics
        step_s = statistics.median(r["timing_s/step"] for r in timed)
        old_s = statistics.median(r.get("timing_s/old_log_prob", 0.0) for r in timed)
        diff = [r[k] for r in metrics for k in ("rollout_corr/log_prob_abs_diff/max",) if k in r]
        rows.append(
            {
                "arm": name,
                "step_s": step_s,
                "old_log_prob_s": old_s,
                "log_prob_abs_diff_max": max(diff) if diff else None,
            }
        )
    for row in rows:
        row["time_ratio"] = row["step_s"] / rows[0]["step_s"]
    return rows


def main() -> None:
    """Print one JSON line per setting and a side-by-side table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--noise", type=float, default=0.0, help="std of the trainer's logit noise (0 = exact)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024, help="the grid's hidden size")
    parser.add_argument(
        "--body-noise", type=float, default=2**-8, help="the grid: relative noise of the trainer's hidden states"
    )
    parser.add_argument("--steps", type=int, default=10, help="steps of each exact-mode training run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny size, in seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens, vocab, reps = (64, 500, 1) if args.smoke else (args.tokens, args.vocab, args.reps)
    hidden, steps = (32, 2) if args.smoke else (args.hidden, args.steps)
    rows = []
    for name, trunc in SETTINGS.items():
        res = measure(tokens, vocab, trunc, args.temperature, args.noise, reps)
        res["setting"] = name
        print(json.dumps(res), flush=True)
        rows.append(res)
    print(f"\n{'setting':<20} {'kl full':>10} {'kl replay':>10} {'IS full':>9} {'IS replay':>10} {'time x':>7}")
    for r in rows:
        print(
            f"{r['setting']:<20} {r['kl_full']:>10.3g} {r['kl_replay']:>10.3g} {r['is_mean_full']:>9.4f} "
            f"{r['is_mean_replay']:>10.6f} {r['time_ratio_replay_over_full']:>7.2f}"
        )
    grid = measure_grid(tokens, vocab, hidden, args.temperature, args.body_noise, reps, args.seed)
    for r in grid:
        print(json.dumps(r), flush=True)
    print(
        f"\ngrid: {tokens} tokens x {vocab} vocabulary, hidden {hidden}, body noise {args.body_noise:.3g} (bf16 body)"
    )
    print(
        f"{'top_p':>5} {'head':>5} {'replay':>6} {'|d| mean':>9} {'|d| max':>9} {'k3 KL':>9} "
        f"{'IS mean':>9} {'IS min':>7} {'IS max':>7} {'IS std':>8} {'time x':>7}"
    )
    for r in grid:
        print(
            f"{r['top_p']:>5} {r['head']:>5} {str(r['replay']).lower():>6} {r['abs_diff_mean']:>9.3g} "
            f"{r['abs_diff_max']:>9.3g} {r['k3_kl']:>9.3g} {r['is_mean']:>9.5f} {r['is_min']:>7.3f} "
            f"{r['is_max']:>7.3f} {r['is_std']:>8.3g} {r['time_ratio']:>7.2f}"
        )
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        runs = exact_runs(steps, root, args.seed)
    for r in runs:
        print(json.dumps(r), flush=True)
    print(f"\nexact mode: tiny training runs, {steps} steps each, 16 prompts x 4 samples, float32")
    print(f"{'arm':<45} {'s/step':>8} {'time x':>7} {'old-lp s':>9} {'|d| max':>9}")
    for r in runs:
        d = "-" if r["log_prob_abs_diff_max"] is None else f"{r['log_prob_abs_diff_max']:.3g}"
        print(f"{r['arm']:<45} {r['step_s']:>8.3f} {r['time_ratio']:>7.2f} {r['old_log_prob_s']:>9.4f} {d:>9}")


if __name__ == "__main__":
    main()
