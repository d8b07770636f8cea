"""Expert parallelism of size 1 on one device, through the EP code path, against the plain model.

    python benchmarks/ep_check.py                 # CPU (gloo), a small Qwen3-MoE
    python benchmarks/ep_check.py --device cuda   # one GPU (nccl): what benchmarks/gpu_check.sh runs

One rank builds a Qwen3-MoE from config twice (same seed): one copy plain, one
under `fsdp2` with the expert mesh forced at size 1 (`expert_mesh=True`), so the
experts go through transformers' expert plan, conveyor's counting all-to-all
(an all-to-all over a group of one) and their own FSDP2 unit, and clipping
through the two-mesh norm. It prints, and checks against the plain copy, the
forward logits, the gradients, the gradient norm and one AdamW step's
parameters (float32 on any device, TF32 off: fsdp2 on a GPU otherwise computes
in bfloat16, far off the 1e-5 bars; differences relative to the largest
reference value), then the expert memory and token figures the update logs. The 2-rank
case (experts really split) is the CPU test tests/workers/test_expert_parallel.py. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from conveyor.models.tiny import tiny_config

    cfg = tiny_config(
        "qwen3_moe",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        intermediate_size=2 * args.hidden,
        num_experts=args.experts,
        top_k=args.top_k,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
    return model.float().to(device)


def ep_strategy(device: torch.device):
    """The fsdp2 strategy with the expert mesh at size 1, computing and reducing in float32 on any device."""
    from conveyor.workers.training.strategy import TrainingStrategy

    # Pinned: unset, fsdp2 on CUDA computes in bfloat16 (the run default), and the check compares exact paths.
    return TrainingStrategy(
        "fsdp2", world_size=1, device=device, expert_mesh=True, param_dtype="float32", reduce_dtype="float32"
    )


def run(args: argparse.Namespace) -> dict[str, float]:
    """Both copies' logits, gradients and one step compared; returns the largest differences and the EP figures."""
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    plain, sharded = _model(args, device), _model(args, device)
    strategy = ep_strategy(device)
    strategy.wrap(sharded)
    assert strategy.expert_parallel and strategy.meshes.expert.mesh_dim_names == ("efsdp", "ep")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    out: dict[str, float] = {}
    logits = {}
    for name, model in (("plain", plain), ("ep", sharded)):
        lg = model(input_ids=ids).logits
        lg.float().logsumexp(-1).mean().backward()
        logits[name] = lg.detach()
    # Differences relative to the largest reference value: the EP path sums each expert's rows in another order.
    out["logits_max_rel_diff"] = float((logits["ep"] - logits["plain"]).abs().max() / logits["plain"].abs().max())
    grads = {
        n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in sharded.named_parameters()
    }
    out["grads_max_rel_diff"] = max(
        float((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12))
        for n, p in plain.named_parameters()
    )
    norm_plain = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), args.clip))
    norm_ep = float(strategy.clip_grad_norm(list(sharded.parameters()), args.clip))
    out["grad_norm_rel_diff"] = abs(norm_ep - norm_plain) / norm_plain
    for model in (plain, sharded):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.step()
        if model is sharded:
            memory = strategy.local_bytes(sharded, opt)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in sharded.named_parameters()}
    out["step_max_rel_diff"] = max(
        float((full[n] - p.detach()).abs().max() / p.detach().abs().max().clamp_min(1e-12))
        for n, p in plain.named_parameters()
    )
    out.update({k: v for k, v in memory.items() if "expert" in k})
    out.update(strategy.step_metrics())
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the check and print its figures; 1 if a difference exceeds 1e-5 or no token reached the experts."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--clip", type=float, default=0.1)
    args = parser.parse_args(argv)
    out = run(args)
    for k, v in out.items():
        print(f"{k:<55} {v:.6g}")
    ok = all(
        out[k] <= 1e-5 for k in ("logits_max_rel_diff", "grads_max_rel_diff", "grad_norm_rel_diff", "step_max_rel_diff")
    )
    ok = ok and out["perf/ep_tokens_received_local"] == args.batch * args.seq * args.top_k * args.layers
    print("ep check:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
