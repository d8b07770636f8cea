"""Per-rank memory of FSDP2 against DDP replicas: two gloo ranks, one actor update each, bytes as the worker logs them.

For each strategy, two processes build the actor worker (`PolicyWorker`) of a
tiny Qwen3-MoE made larger (by default about 10.6M parameters), take one update
over their half of a random batch, and report what the worker logs:
`perf/param_bytes_local`, `perf/grad_bytes_local` and `perf/optim_bytes_local`
(this rank's parameters, gradients and AdamW state; its shards under fsdp2).
The printed ratio is fsdp2 over dp, per rank; the bar is <= 0.6x, and two
ranks that split everything evenly give 0.5x. A third row trains LoRA adapters
(`--lora-rank`, on attention and every expert) under fsdp2: its trainable
(gradient) and optimizer bytes are printed against full fine-tuning's. A fourth
row splits the experts whole over the ranks (`fsdp_config.expert_parallel_size`
= the world size): its experts' bytes at rest equal fsdp2's (both hold 1/N),
while one layer's forward gathers 1/N of its experts instead of all of them;
the row prints the rows sent through the all-to-all per step.

    python benchmarks/sharding.py                      # ~10.6M parameters
    python benchmarks/sharding.py --hidden 64 --layers 2   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

KEYS = ("perf/param_bytes_local", "perf/grad_bytes_local", "perf/optim_bytes_local")
EXPERT_KEYS = (
    "perf/expert_param_bytes_local",
    "perf/expert_optim_bytes_local",
    "perf/expert_param_bytes_gathered",
    "perf/ep_tokens_received_local",
    "moe/ep_tokens_received_max_over_mean",
)
B, P, R = 8, 6, 4


def _overrides(args: argparse.Namespace, strategy: str) -> list[str]:
    return (
        [
            "actor_rollout_ref.model.tiny.warmstart_steps=0",
            "data.synthetic.num_train=64",
            "data.synthetic.num_val=8",
            f"actor_rollout_ref.model.tiny.hidden_size={args.hidden}",
            f"actor_rollout_ref.model.tiny.num_layers={args.layers}",
            f"actor_rollout_ref.model.tiny.intermediate_size={args.hidden * 2}",
            f"actor_rollout_ref.model.tiny.num_experts={args.experts}",
            f"actor_rollout_ref.actor.strategy={strategy.split('+')[0]}",
        ]
        + (LORA(args) if strategy.endswith("+lora") else [])
        + (EP(args) if strategy.endswith("+ep") else [])
    )


def EP(args: argparse.Namespace) -> list[str]:  # noqa: N802 - reads as the constant it nearly is
    """The EP row's overrides: the experts split whole over every rank."""
    return [
        f"actor_rollout_ref.actor.fsdp_config.expert_parallel_size={args.world}",
        f"trainer.num_cpu_workers={args.world}",
    ]


def LORA(args: argparse.Namespace) -> list[str]:  # noqa: N802 - reads as the constant it nearly is
    """The LoRA row's overrides: adapters of rank --lora-rank on attention and every expert."""
    return [
        f"actor_rollout_ref.model.lora_rank={args.lora_rank}",
        f"actor_rollout_ref.model.lora_alpha={2 * args.lora_rank}",
        "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj,experts]",
    ]


def _rank(rank: int, world: int, port: int, overrides: list[str], model_path: str, out: str) -> None:
    import transformers

    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.placement.group import split_for_ranks
    from conveyor.workers.ranks.actor import PolicyWorker
    from conveyor.workers.ranks.calls import UpdateCall
    from conveyor.workers.ranks.settings import actor_settings

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    cfg = load_config(None, overrides)
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(B, R, dtype=torch.bool)
    fields = {
        "prompts": torch.randint(4, 40, (B, P), generator=gen),
        "prompt_mask": torch.ones(B, P, dtype=torch.bool),
        "responses": torch.randint(4, 40, (B, R), generator=gen),
        "response_mask": mask,
        "advantages": torch.randn(B, R, generator=gen),
        "old_log_probs": torch.full((B, R), -3.0),
    }
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put([f"s{i}" for i in range(B)], "p", fields)
    worker = PolicyWorker(
        actor_settings(cfg, build_run_plan(cfg, "cpu")),
        model_path=model_path,
        data_plane=plane,
        rank=rank,
        world_size=world,
    )
    result = worker.update_actor(
        split_for_ranks(meta, world)[rank].with_extra_info(
            **UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info()
        )
    )
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({k: result.extra_info[k] for k in KEYS + EXPERT_KEYS if k in result.extra_info})
    )
    # Every rank past its last collective before any tears the group down (without it a rank once aborted at the
    # end of a full test run: "terminate called without an active exception").
    tdist.barrier()
    tdist.destroy_process_group()


def measure(args: argparse.Namespace, strategy: str, model_path: str) -> list[dict[str, float]]:
    """The per-rank bytes of one update under `strategy` on `args.world` ranks."""
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(_rank, args=(args.world, port, _overrides(args, strategy), model_path, out), nprocs=args.world)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world)]


def _print_ep(args: argparse.Namespace, fsdp2: list[dict], ep: list[dict]) -> None:
    """The EP row against fsdp2: expert bytes at rest and gathered per layer, and the all-to-all traffic."""

    def _expert_mib(m: dict) -> float:
        return (m["perf/expert_param_bytes_local"] + m["perf/expert_optim_bytes_local"]) / 2**20

    for r, (f, e) in enumerate(zip(fsdp2, ep)):
        print(
            f"rank {r}: experts at rest (params + AdamW) ep {_expert_mib(e):.2f} MiB "
            f"vs fsdp2 {_expert_mib(f):.2f} MiB; "
            f"one layer's experts gathered for its forward: ep {e['perf/expert_param_bytes_gathered'] / 2**20:.2f} MiB "
            f"vs fsdp2 {f['perf/expert_param_bytes_gathered'] / 2**20:.2f} MiB "
            f"({e['perf/expert_param_bytes_gathered'] / f['perf/expert_param_bytes_gathered']:.3f}x)"
        )
        # Each received row is a hidden-size float32 vector; the combine sends as many back, and the backward
        # repeats both exchanges with the gradients: 4 transfers of each row.
        rows = e["perf/ep_tokens_received_local"]
        print(
            f"rank {r}: all-to-all rows received (forward dispatch, own rows included) {rows:.0f}, about "
            f"{4 * rows * args.hidden * 4 / 2**20:.2f} MiB through the all-to-all per step (dispatch + combine, "
            f"forward + backward); tokens received max/mean over EP ranks, worst layer "
            f"{e['moe/ep_tokens_received_max_over_mean']:.3f}"
        )
    layer_experts = fsdp2[0]["perf/expert_param_bytes_gathered"] * (args.world - 1) / args.world
    print(
        f"fsdp2 instead all-gathers each layer's experts in every forward and backward: "
        f"{2 * args.layers * layer_experts / 2**20:.2f} MiB received per rank per micro-batch (and reduce-scatters "
        f"their gradients)"
    )


def main(argv: list[str] | None = None) -> int:
    """Print the per-rank bytes of dp and fsdp2 and their ratio; exit 1 if the ratio misses the 0.6x bar."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the LoRA row (fsdp2, adapters only)")
    args = parser.parse_args(argv)

    import transformers

    from conveyor.config import load_config
    from conveyor.models.loading import load_causal_lm
    from conveyor.trainer.setup import prepare_default_model

    transformers.utils.logging.disable_progress_bar()
    model_path = prepare_default_model(load_config(None, _overrides(args, "dp")))
    n_params = sum(p.numel() for p in load_causal_lm(model_path).parameters())
    print(
        f"model: tiny qwen3_moe, hidden {args.hidden}, {args.layers} layers, {args.experts} experts: "
        f"{n_params / 1e6:.1f}M parameters; {args.world} gloo ranks, one actor update each"
    )
    results = {s: measure(args, s, model_path) for s in ("dp", "fsdp2", "fsdp2+lora", "fsdp2+ep")}
    print(
        f"{'per rank (MiB)':<16}"
        + "".join(f"{k.split('/')[1].replace('_bytes_local', ''):>10}" for k in KEYS)
        + f"{'total':>10}"
    )
    totals = {}
    for strategy, ranks in results.items():
        for r, m in enumerate(ranks):
            total = sum(m[k] for k in KEYS)
            totals.setdefault(strategy, []).append(total)
            print(
                f"{strategy + ' rank ' + str(r):<16}"
                + "".join(f"{m[k] / 2**20:>10.2f}" for k in KEYS)
                + f"{total / 2**20:>10.2f}"
            )
    full, lora = results["fsdp2"], results["fsdp2+lora"]
    grads = max(lo["perf/grad_bytes_local"] / f["perf/grad_bytes_local"] for lo, f in zip(lora, full))
    optim = max(lo["perf/optim_bytes_local"] / f["perf/optim_bytes_local"] for lo, f in zip(lora, full))
    # The gradients are the trainable parameters' (one per trainable parameter), so their ratio is the trainable one.
    params = max(lo["perf/param_bytes_local"] / f["perf/param_bytes_local"] for lo, f in zip(lora, full))
    print(
        f"LoRA rank {args.lora_rank} / full fine-tuning (both fsdp2), per rank: trainable (gradient) bytes "
        f"{grads:.4f}x, optimizer state {optim:.4f}x; parameters {params:.3f}x (the frozen base plus the adapters)"
    )
    _print_ep(args, results["fsdp2"], results["fsdp2+ep"])
    ratio = max(f / d for f, d in zip(totals["fsdp2"], totals["dp"]))
    print(f"fsdp2 / dp, parameters + gradients + optimizer state per rank: {ratio:.3f}x (bar <= 0.6x, goal ~0.5x)")
    return 0 if ratio <= 0.6 else 1


if __name__ == "__main__":
    sys.exit(main())
