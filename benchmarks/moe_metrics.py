"""Time MoE rollout load-balance metrics against a plain copy of routed_experts (and verl's, when installed).

The yardstick is `routed_experts.clone()` measured in the same run, so the
ratio says how many "copies of the tensor" the metric costs on this machine,
which is steadier across machines than milliseconds. Timings alternate
between the contenders every repetition and report medians, so a noisy
neighbour hurts all of them alike.

When `verl` is importable, its `compute_rollout_moe_load_balance_metrics` runs
on the same inputs. verl drops each sequence's last valid response position
while conveyor skips `-1` slots; the inputs here put `-1` in exactly those
slots, so both must produce the same numbers, and that is checked.

With `--overhead` it measures instead what the router-health metrics (`conveyor.metrics.moe_router`) add to
the default run (`examples/tiny_cpu.yaml`, warm start off, interval 10): it runs that config for `--steps`
steps (in a temporary folder) for its median step time, then times each added piece on the run's own model
and batch shape (256 rows, 6 new tokens), alternating with and without it, medians over `--reps`. It runs on
one torch thread and measures CPU time (the trainer's `timing_cpu_s/step`, `time.thread_time` for the pieces),
which other processes on a shared machine disturb far less than the wall clock:

- every step: the rollout recording router margins (the lean forward's generate with and without them), and
  the trainer reading them from the data plane and counting them;
- every interval: the routing pass reading the routers' logits (the Hugging Face forward with
  `RouterStatsRecorder` and the per-layer sums) minus the routing-only lean forward it replaces, and the
  per-expert gradient norms.

It prints each piece in ms, the total per step (interval pieces divided by 10) and its share of the step time.

This script does not write files (beyond the temporary run) or install anything.

    python -m benchmarks.moe_metrics                 # issue size: (32, 2048, 48, 8) int16, 128 experts
    python -m benchmarks.moe_metrics --batch 2 --seq-len 64 --response-len 32 --layers 2 --experts 8
    python -m benchmarks.moe_metrics --overhead      # router-health metrics against the default run's step
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from conveyor.metrics.moe_load_balance import compute_rollout_moe_load_balance_metrics


def make_inputs(
    batch: int,
    seq_len: int,
    response_len: int,
    layers: int,
    top_k: int,
    experts: int,
    masked_fraction: float,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routed_experts (B, S, L, K) int16 and a right-padded response_mask (B, R), -1 at each last valid slot."""
    gen = torch.Generator().manual_seed(seed)
    routed_experts = torch.randint(0, experts, (batch, seq_len, layers, top_k), generator=gen, dtype=torch.int16)
    # Response lengths spread evenly around (1 - masked_fraction) * R so that
    # about `masked_fraction` of the response positions are padding.
    spread = min(masked_fraction, 1.0 - masked_fraction)
    low = max(1, round(response_len * (1.0 - masked_fraction - spread)))
    high = max(low, round(response_len * (1.0 - masked_fraction + spread)))
    lengths = torch.randint(low, high + 1, (batch,), generator=gen).clamp(max=response_len)
    response_mask = torch.arange(response_len).unsqueeze(0) < lengths.unsqueeze(1)
    # The last sampled token is never fed through the model: no routing for it.
    prompt_len = seq_len - response_len
    routed_experts[torch.arange(batch), prompt_len + lengths - 1] = -1
    return routed_experts, response_mask


def _load_verl() -> Callable[..., dict] | None:
    """verl's metric function, or None (with a printed note) when verl is not usable here."""
    try:
        from verl.trainer.ppo.metric_utils import compute_rollout_moe_load_balance_metrics as verl_fn
    except Exception as err:  # absent, or present without this function or its dependencies
        print(f"note: verl comparison skipped ({type(err).__name__}: {err})")
        return None
    return verl_fn


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _max_abs_diff(ours: dict[str, float], theirs: dict[str, Any]) -> float:
    """Largest difference over the union of keys; inf when the key sets differ."""
    if set(ours) != set(theirs):
        return math.inf
    return max((abs(float(ours[k]) - float(theirs[k])) for k in ours), default=0.0)


def _alternate(contenders: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median CPU ms of each contender (this thread's), run in turn every repetition (after one warm-up each).

    CPU time, not wall time: on a shared machine other processes stretch the wall clock of both sides alike but
    not evenly, and the differences measured here are a few percent of a step.
    """
    for run in contenders.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(reps):
        for name, run in contenders.items():
            start = time.thread_time()
            run()
            samples[name].append(time.thread_time() - start)
    return {name: _median_ms(v) for name, v in samples.items()}


def overhead(steps: int, reps: int, interval: int = 10) -> dict[str, Any]:
    """The router-health metrics' cost per step of the default run, in ms and as a share of its median step."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from conveyor.config import load_config
    from conveyor.data_plane.memory import MemoryDataPlane
    from conveyor.metrics.moe_router import (
        RouterMarginAccumulator,
        expert_grad_norms,
        expert_load,
        flip_counts,
        gate_load_tv,
        rollout_router_metrics,
    )
    from conveyor.metrics.trackers import read_metrics_jsonl
    from conveyor.models.lean import LeanForward
    from conveyor.models.loading import load_tokenizer
    from conveyor.models.moe_routing import RouterStatsRecorder
    from conveyor.rollout.base import SamplingParams
    from conveyor.rollout.hf import HFEngine
    from conveyor.tasks.synthetic import make_arithmetic_records
    from conveyor.trainer.run import run_training
    from conveyor.trainer.setup import prepare_default_model

    config = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            str(config),
            [
                "actor_rollout_ref.model.tiny.warmstart_steps=0",
                f"actor_rollout_ref.rollout.moe_load_balance_metrics_interval={interval}",
                f"trainer.total_training_steps={steps}",
                "trainer.test_freq=0",
                "trainer.val_before_train=false",
                "trainer.logger=[jsonl]",
                "trainer.progress_bar=false",
                "trainer.save_freq=0",
                f"trainer.default_local_dir={run_dir}",
            ],
        )
        run_training(cfg)
        rows = read_metrics_jsonl(Path(run_dir) / "metrics.jsonl")
    step_ms = statistics.median(
        r["timing_cpu_s/step"] * 1e3 for r in rows if "timing_cpu_s/step" in r and r["step"] > 1
    )

    path = prepare_default_model(cfg)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = load_tokenizer(path, padding_side="left")
    rows_n = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    records = make_arithmetic_records(cfg.data.train_batch_size, seed=0)
    texts = [r["prompt"][-1]["content"] if isinstance(r["prompt"], list) else r["prompt"] for r in records]
    enc = tokenizer(
        [t for t in texts for _ in range(cfg.actor_rollout_ref.rollout.n)], padding=True, return_tensors="pt"
    )
    ids, mask = enc["input_ids"], enc["attention_mask"]
    engine = HFEngine(
        model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, lean=LeanForward(model)
    )
    new_tokens = cfg.data.max_response_length
    plain = SamplingParams(max_new_tokens=new_tokens, capture_routing=True)
    with_margins = plain.replace(capture_router_margins=True)
    # Every row to the full length (no EOS), so both sides feed the same number of tokens.
    engine.eos_token_id = -1
    gen = _alternate(
        {
            "plain": lambda: engine.generate(ids, mask, plain, generator=torch.Generator().manual_seed(0)),
            "margins": lambda: engine.generate(ids, mask, with_margins, generator=torch.Generator().manual_seed(0)),
        },
        reps,
    )
    out = engine.generate(ids, mask, with_margins, generator=torch.Generator().manual_seed(0))

    plane = MemoryDataPlane()
    keys = [str(i) for i in range(rows_n)]
    plane.kv_batch_put(keys=keys, partition_id="p", fields={"router_margins": out["router_margins"].half()})
    acc = RouterMarginAccumulator(cfg.actor_rollout_ref.rollout.moe_near_tie_eps)
    count = _alternate(
        {
            "count": lambda: rollout_router_metrics(
                acc, plane.kv_batch_get, keys, "p", out["response_mask"], False, None
            )
        },
        reps,
    )

    seq = torch.cat([ids, out["responses"]], dim=1)
    att = torch.cat([mask, out["response_mask"].long()], dim=1)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    lean = LeanForward(model)
    experts = int(model.config.num_experts)
    eps = cfg.actor_rollout_ref.rollout.moe_near_tie_eps

    def stats_pass() -> None:
        valid = att.bool()
        with torch.no_grad(), RouterStatsRecorder(model, valid.flatten()) as recorder:
            model(input_ids=seq, attention_mask=att, position_ids=pos, use_cache=False, logits_to_keep=1)
        stats = recorder.result()
        own = stats.ids.view(*seq.shape, *stats.ids.shape[1:])
        flip_counts(own, out["routed_experts"], valid)
        margin = stats.margin.view(*seq.shape, -1)
        has = ~torch.isnan(margin) & valid[..., None]
        (has & (margin < eps)).sum(dim=(0, 1))
        stats.entropy.view(*seq.shape, -1).masked_fill(~has, 0.0).sum(dim=(0, 1))
        gate_load_tv(stats.gate_mass, expert_load(stats.ids, valid.flatten(), experts))

    def routing_pass() -> None:
        with torch.no_grad():
            lean.response_logits(ids, mask, out["responses"], out["response_mask"], record_routing=True)

    passes = _alternate({"stats": stats_pass, "routing": routing_pass}, reps)
    model.train()
    logits = model(input_ids=seq, attention_mask=att, position_ids=pos).logits
    logits.float().logsumexp(-1).mean().backward()
    grads = _alternate({"grad_norms": lambda: expert_grad_norms(model)}, reps)

    per_step = (gen["margins"] - gen["plain"]) + count["count"]
    per_interval = (passes["stats"] - passes["routing"]) + grads["grad_norms"]
    total = per_step + per_interval / interval
    result = {
        "step_ms": step_ms,
        "rollout_plain_ms": gen["plain"],
        "rollout_margins_ms": gen["margins"],
        "count_ms": count["count"],
        "stats_pass_ms": passes["stats"],
        "routing_pass_ms": passes["routing"],
        "grad_norms_ms": grads["grad_norms"],
        "per_step_ms": per_step,
        "per_interval_ms": per_interval,
        "overhead_ms": total,
        "overhead_share": total / step_ms,
        "threads": torch.get_num_threads(),
    }
    print(
        f"default run (examples/tiny_cpu.yaml, warm start off, interval {interval}): median step {step_ms:.2f} CPU ms "
        f"over steps 2-{steps}; {rows_n} rows x {new_tokens} tokens; {reps} reps; {result['threads']} thread; "
        "all figures CPU time of the one thread"
    )
    print(
        f"  every step:     rollout {gen['plain']:.2f} -> {gen['margins']:.2f} ms with margins; "
        f"count {count['count']:.3f} ms"
    )
    print(
        f"  every interval: routing pass {passes['routing']:.2f} -> {passes['stats']:.2f} ms with router stats; "
        f"expert grad norms {grads['grad_norms']:.3f} ms"
    )
    print(f"  overhead {total:.3f} ms per step = {total / step_ms:.2%} of the step (target <= 5%)")
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and return the medians (ms), the ratios to clone and the verl agreement."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--response-len", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--masked-fraction", type=float, default=1 / 3, help="share of response positions masked out")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--no-verl", action="store_true", help="skip the verl comparison even when it is installed")
    parser.add_argument("--overhead", action="store_true", help="router-health metrics against the default run")
    parser.add_argument("--steps", type=int, default=30, help="--overhead: steps of the default run to time")
    args = parser.parse_args(argv)
    if args.overhead:
        if args.steps < 2:
            parser.error("--steps must be at least 2")
        # One thread: its CPU time is then all the work done, whatever else runs on the machine.
        torch.set_num_threads(1)
        return overhead(args.steps, args.reps)
    if args.response_len > args.seq_len:
        parser.error("--response-len must not exceed --seq-len")
    if not 0.0 <= args.masked_fraction < 1.0:
        parser.error("--masked-fraction must be in [0, 1)")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)

    routed_experts, response_mask = make_inputs(
        args.batch,
        args.seq_len,
        args.response_len,
        args.layers,
        args.top_k,
        args.experts,
        args.masked_fraction,
        args.seed,
    )
    verl_fn = None if args.no_verl else _load_verl()

    contenders: dict[str, Callable[[], Any]] = {
        "clone": routed_experts.clone,
        "conveyor": lambda: compute_rollout_moe_load_balance_metrics(routed_experts, response_mask, args.experts),
    }
    if verl_fn is not None:
        contenders["verl"] = lambda: verl_fn(routed_experts, response_mask, args.experts)
    for run in contenders.values():  # warm-up: first-touch allocation and lazy init stay out of the figures
        run()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.reps):
        for name, run in contenders.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)

    result: dict[str, Any] = {
        "shape": tuple(routed_experts.shape),
        "dtype": str(routed_experts.dtype),
        "experts": args.experts,
        "masked_fraction": 1.0 - response_mask.float().mean().item(),
        "reps": args.reps,
        "threads": torch.get_num_threads(),
    }
    clone_ms = _median_ms(samples["clone"])
    result["clone_ms"] = clone_ms
    for name in contenders:
        if name != "clone":
            result[f"{name}_ms"] = _median_ms(samples[name])
            result[f"{name}_ratio"] = result[f"{name}_ms"] / clone_ms if clone_ms > 0 else math.inf
    ours = contenders["conveyor"]()
    result["metric_keys"] = len(ours)
    if verl_fn is not None:
        diff = _max_abs_diff(ours, contenders["verl"]())
        result["verl_max_abs_diff"] = diff
        result["verl_agrees"] = diff <= 1e-5

    print(
        f"routed_experts {result['shape']} {result['dtype']}, {args.experts} experts, "
        f"{result['masked_fraction']:.0%} of response masked, {args.reps} reps, {result['threads']} threads"
    )
    print(f"  clone     {clone_ms:9.2f} ms   1.00x")
    for name in contenders:
        if name != "clone":
            print(f"  {name:9s} {result[f'{name}_ms']:9.2f} ms  {result[f'{name}_ratio']:5.2f}x clone")
    if verl_fn is not None:
        verdict = "agree" if result["verl_agrees"] else "DISAGREE"
        print(f"  conveyor vs verl metrics: {verdict} (max abs diff {result['verl_max_abs_diff']:.3g})")
    return result


if __name__ == "__main__":
    main()
