"""Loading memory under fsdp2: rank 1's peak against the whole model's bytes, on two gloo ranks.

A tiny Qwen3-MoE made larger (by default about 160M float32 parameters) is
built from config and saved as a checkpoint; then two processes load it as
the reference worker does (`load_role_model`, then `TrainedModel` under
fsdp2): rank 0 reads the checkpoint into host memory, rank 1 builds the model
on the meta device, both shard it and rank 1 receives its shards from rank 0
(`conveyor.workers.training.loading`). Each rank measures its resident-memory peak
over the load, above what it held before (`conveyor.workers.ranks.perf`). With
every rank loading the whole checkpoint, rank 1's ratio would be >= 1x; here
it is its shards (~0.5x on two ranks) plus one tensor in flight. The bar is
<= 0.75x (checked only at --hidden >= 512, where one process's own noise is
small next to the model).

    python benchmarks/loading.py                           # ~160M parameters
    python benchmarks/loading.py --hidden 64 --layers 2    # a quick check
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


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    import transformers

    from conveyor.workers.ranks.perf import peak_memory_bytes, reset_peak_memory
    from conveyor.workers.training.loading import load_role_model
    from conveyor.workers.training.strategy import TrainingStrategy
    from conveyor.workers.training.trained_model import TrainedModel

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    device = torch.device("cpu")
    strategy = TrainingStrategy("fsdp2", world_size=world, device=device)
    tdist.barrier()
    before = _rss()
    reset_peak_memory(device)
    model = load_role_model(
        model_path, strategy_name=strategy.name, world_size=world, rank=rank, device=device, dtype="float32"
    )
    trained = TrainedModel(model, strategy, trainable=False)
    peak = peak_memory_bytes(device) - before
    local = sum(p.to_local().numel() * p.element_size() for p in trained.model.parameters())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak": peak, "shards": local}))
    tdist.barrier()
    tdist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Print each rank's loading peak over the model's bytes; exit 1 if rank 1's misses the bar."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)

    import transformers

    from conveyor.models.loading import save_pretrained_checkpoint
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer

    transformers.utils.logging.disable_progress_bar()
    tok = build_char_tokenizer()
    heads = max(4, args.hidden // 64)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(
            "qwen3_moe",
            tok,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=heads,
            num_kv_heads=heads // 2,
            intermediate_size=args.hidden,
            num_experts=args.experts,
        )
        n_params = sum(p.numel() for p in model.parameters())
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        path = save_pretrained_checkpoint(model, tok, Path(tmp) / "model")
        del model
        print(
            f"model: tiny qwen3_moe, hidden {args.hidden}, {args.layers} layers, {args.experts} experts: "
            f"{n_params / 1e6:.1f}M parameters, {full / 2**20:.0f} MiB; {args.world} gloo ranks, fsdp2 load"
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(args.world, port, str(path), tmp), nprocs=args.world)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world)]
    for r, m in enumerate(ranks):
        print(
            f"rank {r}: loading peak {m['peak'] / 2**20:.0f} MiB ({m['peak'] / full:.3f}x the model), "
            f"shards {m['shards'] / 2**20:.0f} MiB"
        )
    ratio = ranks[1]["peak"] / full
    print(f"rank 1 loading peak / model bytes: {ratio:.3f}x (bar <= 0.75x; every rank loading the whole model: >= 1x)")
    return 0 if ratio <= 0.75 or args.hidden < 512 else 1


if __name__ == "__main__":
    sys.exit(main())
