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

    python benchmarks/mismatch.py                 # 2048 tokens x 32,000 vocabulary
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


def main() -> None:
    """Print one JSON line per setting and a side-by-side table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--noise", type=float, default=0.0, help="std of the trainer's logit noise (0 = exact)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny size, in seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens, vocab, reps = (64, 500, 1) if args.smoke else (args.tokens, args.vocab, args.reps)
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


if __name__ == "__main__":
    main()
