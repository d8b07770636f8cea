"""Does the rollout's router margin predict where the trainer's routing flips? (CPU, tiny MoE, seeds stated.)

The rollout samples in bfloat16 from a cast of the float32 master weights; the trainer recomputes the same
tokens in float32. Where a token's k-th and (k+1)-th router logits are close, the rounding of the bf16 forward
can swap an expert, and the trainer then routes that token differently (a flip). This script measures, per MoE
layer and seed, the rollout-side near-tie share (`rollout/moe/near_tie/layer_i`: margins below `--eps`, from
the margins the hf engine records) and the flip rate against a float32 teacher-forced forward
(`actor/moe/flip_rate/layer_i`, the trainer's side, on the same weights), and prints their Spearman rank
correlation over all (layer, seed) points.

The tiny model (the tiny Qwen3-MoE of the default run: hidden 64, 8 experts, top-2, its own init of std
0.02, here with `--layers` MoE layers) has routers whose rows are rebuilt per layer as a shared direction plus
their own part scaled by a spread, log-even over `--spread` (a fixed permutation per seed): a layer with a
small spread has close logits (small margins), and the bf16 rounding of each row, which follows its whole size,
moves them by about as much. It samples 64 responses of 24 tokens to random two-number prompts per seed. The
prediction holds when the Spearman correlation is at least 0.8.

What it does not show: with a 10x wider init (`--init 0.2`) the bf16 drift of the residual stream grows with
depth and the flip rate follows depth rather than the margins (Spearman -0.53 on seeds 0-2). Scaling a router
as a whole moves its margins and its rounding alike, so it does not change its flip rate either.

    python benchmarks/router.py                     # seeds 0 1 2, 6 layers
    python benchmarks/router.py --seeds 3 4 5 --eps 0.005

It writes no files.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from conveyor.metrics.moe_router import flip_counts, margin_counts, response_margins
from conveyor.models.moe_routing import RouterStatsRecorder, moe_layers
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFEngine


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""

    def ranks(values: Sequence[float]) -> torch.Tensor:
        v = torch.tensor(values, dtype=torch.float64)
        order = v.argsort()
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        for value in v.unique():  # ties: the mean of their ranks
            same = v == value
            r[same] = r[same].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum()) / denom if denom > 0 else math.nan


def _prompts(tokenizer: Any, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    nums = torch.randint(0, 1000, (count, 2), generator=gen).tolist()
    enc = tokenizer([f"{a}+{b}=" for a, b in nums], padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def one_seed(seed: int, args: argparse.Namespace) -> list[dict[str, float]]:
    """Per layer: the rollout's near-tie share, its margin median, and the flip rate against float32."""
    tokenizer = build_char_tokenizer()
    master = build_tiny_model(
        "qwen3_moe",
        tokenizer,
        seed=seed,
        num_layers=args.layers,
        num_experts=args.experts,
        top_k=args.top_k,
        initializer_range=args.init,
    ).eval()
    gen = _gen(seed)
    # Per layer, how far its router's rows stand apart around their common part: log-evenly over --spread.
    low, high = (math.log(v) for v in args.spread)
    spreads = torch.linspace(low, high, args.layers).exp()[torch.randperm(args.layers, generator=gen)]
    with torch.no_grad():
        for layer, spread in zip(moe_layers(master), spreads.tolist()):
            weight = layer.router.weight  # (E, H)
            common = torch.randn(weight.shape[1], generator=gen) * weight.std()
            # Rows = a shared direction + a scaled own part: the logits' differences shrink with the spread, while
            # the bf16 rounding of each row follows its whole size.
            weight.copy_(common + spread * (weight - weight.mean(dim=0)))
    rollout = build_tiny_model(
        "qwen3_moe", tokenizer, seed=seed, num_layers=args.layers, num_experts=args.experts, top_k=args.top_k
    )
    rollout.load_state_dict(master.state_dict())
    rollout = rollout.to(torch.bfloat16).eval()  # the rollout's copy: the master weights cast to bf16

    ids, mask = _prompts(tokenizer, args.batch, seed)
    engine = HFEngine(rollout, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    out = engine.generate(
        ids,
        mask,
        SamplingParams(max_new_tokens=args.response_len, capture_routing=True, capture_router_margins=True),
        generator=torch.Generator().manual_seed(seed),
    )
    seq = torch.cat([ids, out["responses"]], dim=1)
    att = torch.cat([mask, out["response_mask"].long()], dim=1)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), RouterStatsRecorder(master, att.bool().flatten()) as recorder:
        master(input_ids=seq, attention_mask=att, position_ids=pos, logits_to_keep=1)
    trainer_ids = recorder.result().ids.view(*seq.shape, args.layers, args.top_k)

    response = torch.zeros_like(att, dtype=torch.bool)
    response[:, ids.shape[1] :] = out["response_mask"]
    flipped, counted = flip_counts(trainer_ids, out["routed_experts"], response)
    margins = response_margins(out["router_margins"], out["response_mask"])
    known, near, _ = margin_counts(margins, args.eps)
    rows = []
    for layer in range(args.layers):
        column = margins[:, layer]
        rows.append(
            {
                "seed": seed,
                "layer": layer,
                "spread": float(spreads[layer]),
                "near_tie": float(near[layer]) / max(float(known[layer]), 1.0),
                "median_margin": float(column[~torch.isnan(column)].median()),
                "flip_rate": float(flipped[layer]) / max(float(counted[layer]), 1.0),
                "pairs": int(counted[layer]),
            }
        )
    return rows


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(10_000 + seed)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every seed, print the per-layer table and the Spearman correlation; return them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=24)
    parser.add_argument("--eps", type=float, default=0.01, help="near-tie margin (rollout.moe_near_tie_eps)")
    parser.add_argument("--init", type=float, default=0.02, help="the tiny model's initializer_range")
    parser.add_argument("--spread", type=float, nargs=2, default=[0.05, 1.0], metavar=("LOW", "HIGH"))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.layers < 2 or args.top_k >= args.experts or args.eps <= 0 or min(args.spread) <= 0:
        parser.error("need --layers >= 2, --top-k < --experts, --eps > 0 and a positive --spread")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows = [row for seed in args.seeds for row in one_seed(seed, args)]
    rho = spearman([r["near_tie"] for r in rows], [r["flip_rate"] for r in rows])
    print(
        f"tiny qwen3_moe, {args.layers} MoE layers x {args.experts} experts, top-{args.top_k}; rollout bf16, "
        f"trainer float32; {args.batch} x {args.response_len} tokens per seed; eps {args.eps:g}; "
        f"{torch.get_num_threads()} threads"
    )
    print(" seed layer spread  near_tie  median_margin  flip_rate  pairs")
    for r in rows:
        print(
            f"{r['seed']:5d} {r['layer']:5d} {r['spread']:6.3f} {r['near_tie']:9.4f} {r['median_margin']:14.4f} "
            f"{r['flip_rate']:10.4f} {r['pairs']:6d}"
        )
    per_seed = {
        seed: spearman(
            [r["near_tie"] for r in rows if r["seed"] == seed], [r["flip_rate"] for r in rows if r["seed"] == seed]
        )
        for seed in args.seeds
    }
    print("Spearman(near_tie, flip_rate) per seed: " + ", ".join(f"{s}: {v:.3f}" for s, v in per_seed.items()))
    verdict = "met" if rho >= 0.8 else "NOT met"
    print(f"Spearman over {len(rows)} (layer, seed) points: {rho:.3f} (target >= 0.8: {verdict})")
    print(f"wall time {time.perf_counter() - start:.1f} s")
    return {"rows": rows, "spearman": rho, "spearman_per_seed": per_seed}


if __name__ == "__main__":
    main()
