"""Run one or more roles' endpoints on N ranks (one process each, gloo) for the strategy tests.

    python strategy_ranks.py SPEC.json

SPEC holds `world`, `model_path` and `runs`, a list run one after another by
the same ranks (starting ranks costs far more than any run here: every rank
imports torch, transformers and conveyor). Each run holds: `role` (actor or
critic), `overrides` (config overrides), `batch` (a torch file of the batch's
fields, loaded with weights_only), `jobs` (what to run, in order) and `out` (a
folder). For every run each rank builds its own memory data plane holding the
same batch and a fresh worker, takes its share of the keys with the worker
groups' own `split_for_ranks`, and runs the jobs:

- `update`: one update over the whole batch; rank 0 writes the gathered
  parameters to `out/params.pt` and every rank its metrics to `out/metrics_<rank>.json`.
- `log_prob`: compute_log_prob; each rank's `old_log_probs` go to `out/log_probs_<rank>.pt`.
- `save:DIR` / `load:DIR`: a sharded checkpoint written or read by all ranks
  (`load` reads the schedule state from `out/extra.pt`; after it, rank 0 writes
  the parameters to `out/loaded.pt`).
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


def _run(rank: int, world: int, model_path: str, run: dict) -> None:
    """One run's jobs on this rank, with a worker of its own."""
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.protocol import KVBatchMeta
    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.actor import PolicyWorker
    from conveyor.workers.calls import LogProbCall, UpdateCall
    from conveyor.workers.critic import CriticWorker
    from conveyor.workers.settings import actor_settings, critic_settings
    from conveyor.workers.group import split_for_ranks

    out = Path(run["out"])
    cfg = load_config(None, run["overrides"])
    fields = torch.load(run["batch"], weights_only=True)
    n = len(next(iter(fields.values())))
    keys = [f"s{i}" for i in range(n)]
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put(keys, "p", fields)
    share = split_for_ranks(KVBatchMeta(keys, "p", meta.fields, [{} for _ in keys], {}), world)[rank]
    # A copy for the log-prob job, so that its old_log_probs leave the update's inputs untouched.
    plane.kv_batch_put(keys, "lp", fields)
    lp_share = KVBatchMeta(share.keys, "lp", share.fields, share.tags, {})
    plan = build_run_plan(cfg, "cpu")
    if run["role"] == "critic":
        worker = CriticWorker(critic_settings(cfg, plan), model_path=model_path, data_plane=plane, rank=rank,
                              world_size=world)
    else:
        worker = PolicyWorker(actor_settings(cfg, plan), model_path=model_path, data_plane=plane, rank=rank,
                              world_size=world)
    for job in run["jobs"]:
        if job == "update":
            call = share.with_extra_info(**UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info())
            result = worker.update_critic(call) if run["role"] == "critic" else worker.update_actor(call)
            (out / f"metrics_{rank}.json").write_text(json.dumps(result.extra_info))
            params = worker.model_state_dict()
            if rank == 0:
                torch.save(params, out / "params.pt")
        elif job == "log_prob":
            worker.compute_log_prob(lp_share.with_extra_info(**LogProbCall(temperature=1.0,
                                                                           calculate_entropy=False).to_extra_info()))
            got = plane.kv_batch_get(share.keys, "lp", ["old_log_probs"])["old_log_probs"]
            torch.save(got, out / f"log_probs_{rank}.pt")
        elif job.startswith("save:"):
            extra = worker.save_checkpoint(job[5:])
            if rank == 0:
                torch.save(extra, out / "extra.pt")
        elif job.startswith("load:"):
            worker.load_checkpoint(job[5:], torch.load(out / "extra.pt", weights_only=True))
            params = worker.model_state_dict()
            if rank == 0:
                torch.save(params, out / "loaded.pt")
        else:
            raise ValueError(f"unknown job {job!r}")
    tdist.barrier()  # every rank done with this run (its files written) before the next one starts


def _rank_main(rank: int, spec: dict, port: int) -> None:
    torch.set_num_threads(1)
    world = spec["world"]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=5))
    for run in spec["runs"]:
        _run(rank, world, spec["model_path"], run)
    tdist.destroy_process_group()


def main() -> None:
    """Spawn the ranks of SPEC.json and wait for them."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(spec, port), nprocs=spec["world"], join=True)


if __name__ == "__main__":
    main()
