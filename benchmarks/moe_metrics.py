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

This script does not write files or install anything.

    python -m benchmarks.moe_metrics                 # issue size: (32, 2048, 48, 8) int16, 128 experts
    python -m benchmarks.moe_metrics --batch 2 --seq-len 64 --response-len 32 --layers 2 --experts 8
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
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
    args = parser.parse_args(argv)
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
