"""Four gloo ranks under fsdp2 with expert_parallel_size=2 (so efsdp=2): the strategy alone, no worker.

    python ep_ranks.py OUT_DIR

Each rank builds the tiny Qwen3-MoE (8 experts), wraps it, runs its quarter of a fixed batch forward and
backward (loss scaled as the workers scale it), clips through the strategy and takes one AdamW step. Rank 0
writes the gathered logits, gradients, norm and stepped parameters to `OUT_DIR/four_ranks.pt`, with each
expert tensor's local shape and placements; the test compares them with one rank.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

WORLD, EP, ROWS, SEQ, VOCAB = 4, 2, 8, 10, 64


def build_model() -> torch.nn.Module:
    """The seeded tiny Qwen3-MoE both sides start from."""
    from transformers import AutoModelForCausalLM

    from conveyor.models.tiny import tiny_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", vocab_size=VOCAB, num_experts=8)).float()


def batch() -> torch.Tensor:
    """The fixed token ids (ROWS, SEQ)."""
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    """A loss normalised by the global element count (as the workers normalise by global tokens)."""
    return logits.float().pow(2).sum() / (ROWS * SEQ * VOCAB)


def _rank(rank: int, port: int, out: str) -> None:
    from conveyor.workers.training.strategy import TrainingStrategy

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(minutes=5))
    model = build_model()
    strategy = TrainingStrategy("fsdp2", world_size=WORLD, device=torch.device("cpu"), expert_parallel_size=EP)
    strategy.wrap(model)
    n = ROWS // WORLD
    logits = model(input_ids=batch()[rank * n : (rank + 1) * n]).logits
    (loss_of(logits) * strategy.loss_scale).backward()
    gathered = [torch.empty_like(logits) for _ in range(WORLD)]
    tdist.all_gather(gathered, logits.detach().contiguous())
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    norm = strategy.clip_grad_norm(list(model.parameters()), 0.05)
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    params = {k: p.detach().full_tensor() for k, p in model.named_parameters()}
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    if rank == 0:
        torch.save(
            {
                "logits": torch.cat(gathered),
                "grads": grads,
                "norm": float(norm),
                "params": params,
                "expert_local_shape": tuple(experts.to_local().shape),
                "expert_mesh": tuple(experts.device_mesh.mesh_dim_names),
            },
            Path(out) / "four_ranks.pt",
        )
    tdist.barrier()  # every rank past its last collective before any tears the group down
    tdist.destroy_process_group()


def main() -> None:
    """Spawn the four ranks and wait for them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, sys.argv[1]), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
