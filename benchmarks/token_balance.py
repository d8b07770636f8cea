"""Tokens, not rows: how evenly the ranks' shares and how tightly the token-budget micro-batches are filled.

Synthetic lengths, no model: `--prompts` prompts of 100 to 600 tokens, each
sampled `--n` times, responses long-tailed (exponential, mean `--mean-response`,
capped at `--max-response`). Two tables, averaged over `--trials` batches:

- ranks: max / mean of the ranks' prompt + response tokens for in-order chunks,
  the old greedy split on the prompts' lengths (what the `seq_len` tags held
  before the rollout rewrote them) and `split_for_ranks`' partition
  (Karmarkar-Karp with equal counts), with the partition's time;
- micro-batches of one rank's share under `--budget` tokens: passes of the
  token budget against a fixed size that fits the longest rows, and the tokens
  processed per real token (the padding left inside micro-batches); with
  packed forwards a micro-batch costs its real tokens only.

    python benchmarks/token_balance.py
    python benchmarks/token_balance.py --ranks 16 --budget 32768
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from conveyor.workers.training.balance import balanced_partition, imbalance
from conveyor.workers.training.batching import TokenBudget, token_micro_batches


def _greedy(lengths: list[int], n: int) -> list[list[int]]:
    """The split before: longest first onto the least-loaded rank with room, on the given lengths."""
    base, rest = divmod(len(lengths), n)
    caps = [base + (1 if i < rest else 0) for i in range(n)]
    loads, parts = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min((r for r in range(n) if len(parts[r]) < caps[r]), key=lambda r: loads[r])
        parts[r].append(i)
        loads[r] += lengths[i]
    return parts


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Print both tables; return their figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--mean-response", type=int, default=800)
    ap.add_argument("--max-response", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    split = {"in-order chunks": [], "greedy on prompt lengths (before)": [], "split_for_ranks (KK)": []}
    kk_ms, fixed, passes, per_real, lower, packed_passes = [], [], [], [], [], []
    for _ in range(args.trials):
        prompts = [rng.randint(100, 600) for _ in range(args.prompts)]
        p = [x for x in prompts for _ in range(args.n)]
        r = [min(args.max_response, int(rng.expovariate(1 / args.mean_response)) + 1) for _ in p]
        total = [a + b for a, b in zip(p, r)]
        k = args.ranks
        sums = lambda parts: [sum(total[i] for i in part) for part in parts]  # noqa: E731
        size = math.ceil(len(p) / k)
        split["in-order chunks"].append(
            imbalance(sums([list(range(i, min(i + size, len(p)))) for i in range(0, len(p), size)]))
        )
        split["greedy on prompt lengths (before)"].append(imbalance(sums(_greedy(p, k))))
        t0 = time.perf_counter()
        parts = balanced_partition(total, k, equal_size=True)
        kk_ms.append((time.perf_counter() - t0) * 1e3)
        split["split_for_ranks (KK)"].append(imbalance(sums(parts)))
        # One rank's share through the token budget.
        share = parts[0]
        sp, sr = [p[i] for i in share], [r[i] for i in share]
        batches = token_micro_batches(sp, sr, TokenBudget(args.budget, "--budget"))
        processed = sum(len(b) * (max(sp[i] for i in b) + max(sr[i] for i in b)) for b in batches)
        passes.append(len(batches))
        per_real.append(processed / (sum(sp) + sum(sr)))
        lower.append(math.ceil((sum(sp) + sum(sr)) / args.budget))
        # Packed forwards: a micro-batch costs its real tokens, so nothing but the real tokens is processed.
        packed_passes.append(len(token_micro_batches(sp, sr, TokenBudget(args.budget, "--budget"), packed=True)))
        fixed.append(math.ceil(len(share) / max(1, args.budget // (600 + args.max_response))))
    out: dict[str, float] = {}
    print(
        f"ranks: {args.ranks} x {args.prompts * args.n // args.ranks} samples, max / mean of prompt + response "
        f"tokens over {args.trials} batches"
    )
    for name, vals in split.items():
        print(f"  {name:36s} mean {statistics.mean(vals):.4f}  worst {max(vals):.4f}")
        out[name] = statistics.mean(vals)
    print(f"  partition time: {statistics.mean(kk_ms):.2f} ms")
    print(f"micro-batches of one rank's share under {args.budget} tokens:")
    print(f"  fixed size fitting the longest rows: {statistics.mean(fixed):.1f} passes of the full padded width")
    print(
        f"  token budget: {statistics.mean(passes):.1f} passes (real tokens alone need >= "
        f"{statistics.mean(lower):.1f}), {statistics.mean(per_real):.2f} tokens processed per real one"
    )
    print(
        f"  token budget, packed forwards: {statistics.mean(packed_passes):.1f} passes, 1.00 tokens processed per "
        "real one"
    )
    out.update(
        kk_ms=statistics.mean(kk_ms),
        fixed_passes=statistics.mean(fixed),
        budget_passes=statistics.mean(passes),
        processed_per_real=statistics.mean(per_real),
        lower_bound_passes=statistics.mean(lower),
        packed_passes=statistics.mean(packed_passes),
    )
    return out


if __name__ == "__main__":
    main()
