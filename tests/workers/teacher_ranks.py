"""The teacher role on N ranks (one process each, gloo): `python teacher_ranks.py SPEC.json`.

SPEC holds `world`, `overrides` (config overrides naming the teachers), `batch` (a torch file of the batch's
fields, `data_source` included), `shares` (each rank's row indices: a test can leave a rank without a sample of
some teacher) and `out` (a folder). Each rank builds its own memory data plane holding the whole batch and a
`TeacherWorker` under the configured strategy, runs `compute_teacher_log_prob` on its share, and writes its
keys' fields to `out/teacher_<rank>.pt`.
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


def _rank_main(rank: int, spec: dict, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=spec["world"], timeout=timedelta(minutes=5))
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.ranks.calls import LogProbCall
    from conveyor.workers.ranks.distill import teacher_settings
    from conveyor.workers.ranks.teacher import TeacherWorker

    cfg = load_config(None, spec["overrides"])
    plane = make_data_plane("memory")
    fields = torch.load(spec["batch"], weights_only=False)
    n = len(fields["data_source"])
    meta = plane.kv_batch_put(keys=[f"k{i}" for i in range(n)], partition_id="p", fields=fields)
    worker = TeacherWorker(
        teacher_settings(cfg, build_run_plan(cfg, "cpu")), data_plane=plane, rank=rank, world_size=spec["world"]
    )
    mine = meta.select(spec["shares"][rank])
    call = LogProbCall(temperature=1.0, calculate_entropy=False, compute_loss=False).to_extra_info()
    out = worker.compute_teacher_log_prob(mine.with_extra_info(**call))
    got = plane.kv_batch_get(keys=mine.keys, partition_id="p", select_fields=out.fields)
    torch.save({"keys": mine.keys, **{k: got[k] for k in out.fields}}, Path(spec["out"]) / f"teacher_{rank}.pt")
    tdist.barrier()
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
