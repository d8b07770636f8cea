"""Build roles' workers on N gloo ranks (one process each) and write what each rank holds, for the loading tests.

    python loading_ranks.py SPEC.json

SPEC holds `world`, `input_ids` (a list of token-id rows) and `cases`, each with
`role` (actor, reference or critic), `model_path`, `overrides` and `out`. For every
case each rank builds the role's worker under fsdp2, then writes
`out/tensors_<rank>.pt`: every parameter and buffer (persistent or not) gathered
whole with `full_tensor`, and the local shards' bytes; and `out/forward_<rank>.pt`:
the logits (values for the critic) of a no-grad forward through the sharded model.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().clone()


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _case(rank: int, world: int, input_ids: torch.Tensor, case: dict) -> None:
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.ranks.actor import PolicyWorker
    from conveyor.workers.ranks.critic import CriticWorker
    from conveyor.workers.ranks.reference import ReferenceWorker
    from conveyor.workers.ranks.settings import actor_settings, critic_settings, reference_settings

    out = Path(case["out"])
    cfg = load_config(None, case["overrides"])
    plan = build_run_plan(cfg, "cpu")
    kwargs = dict(model_path=case["model_path"], data_plane=make_data_plane("memory"), rank=rank, world_size=world)
    role = case["role"]
    if role == "critic":
        worker = CriticWorker(critic_settings(cfg, plan), **kwargs)
    elif role == "reference":
        worker = ReferenceWorker(reference_settings(cfg, plan), **kwargs)
    else:
        worker = PolicyWorker(actor_settings(cfg, plan), **kwargs)
    model = worker.model
    tensors = {name: _whole(p) for name, p in model.named_parameters()}
    tensors.update({name: _whole(b) for name, b in model.named_buffers()})
    local = sum(_local_bytes(p) for p in model.parameters())
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        module = worker.trained.forward_module
        if role == "critic":
            result = module(input_ids, mask)
        else:
            result = module(input_ids=input_ids, attention_mask=mask).logits
    torch.save(
        {"tensors": tensors, "local_param_bytes": local, "strategy": worker.trained.strategy.name},
        out / f"tensors_{rank}.pt",
    )
    torch.save(result, out / f"forward_{rank}.pt")
    tdist.barrier()


def _rank_main(rank: int, spec: dict, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=spec["world"], timeout=timedelta(minutes=5))
    input_ids = torch.tensor(spec["input_ids"], dtype=torch.long)
    for case in spec["cases"]:
        _case(rank, spec["world"], input_ids, case)
    tdist.barrier()  # every rank past its last collective before any tears the group down
    tdist.destroy_process_group()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(spec, port), nprocs=spec["world"], join=True)


if __name__ == "__main__":
    main()
