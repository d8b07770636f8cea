"""Resident memory per rank of a 2-rank CPU Ray run with a reference (use_kl_loss=true).

Trains a few steps of a ~30M-parameter dense model built from config and
samples, every half second, the resident set (RSS) and proportional set (PSS:
shared library pages split between the processes that map them) of every
model-worker process. Each worker writes its role, rank and process id when
it is built, so the figures are per rank whichever layout the code runs:
the reference in a process of its own per rank, or in the actor's.

    PYTHONPATH=. python benchmarks/colocation_memory.py [out.json]
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from conveyor.config import load_config
from conveyor.trainer.run import run_training
from conveyor.workers.placement.role_table import ROLES

MODEL = [
    "actor_rollout_ref.model.tiny.arch=qwen3",
    "actor_rollout_ref.model.tiny.hidden_size=512",
    "actor_rollout_ref.model.tiny.num_layers=8",
    "actor_rollout_ref.model.tiny.num_heads=8",
    "actor_rollout_ref.model.tiny.num_kv_heads=4",
    "actor_rollout_ref.model.tiny.intermediate_size=2048",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
]
RUN = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "data.synthetic.num_train=64",
    "data.synthetic.num_val=8",
    "trainer.total_training_steps=3",
    "trainer.test_freq=0",
    "trainer.logger=[jsonl]",
    "trainer.progress_bar=false",
    "trainer.dump_freq=0",
    "trainer.num_cpu_workers=2",
    "ray.num_cpus=4",
    "actor_rollout_ref.actor.use_kl_loss=true",
]

PID_DIR = Path(tempfile.mkdtemp(prefix="colocation-pids-"))


class PolicyWorkerWithPid(ROLES["actor"].worker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        (PID_DIR / f"actor-{self.rank}").write_text(str(os.getpid()))
        print("actor parameters:", sum(p.numel() for p in self.model.parameters()), flush=True)


class ReferenceWorkerWithPid(ROLES["ref"].worker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        (PID_DIR / f"ref-{self.rank}").write_text(str(os.getpid()))


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else None
    ROLES["actor"] = dataclasses.replace(ROLES["actor"], worker=PolicyWorkerWithPid)
    ROLES["ref"] = dataclasses.replace(ROLES["ref"], worker=ReferenceWorkerWithPid)
    peak: dict[int, dict[str, int]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for f in PID_DIR.iterdir():
                pid = int(f.read_text() or 0)
                try:
                    info = psutil.Process(pid).memory_full_info()
                except (psutil.NoSuchProcess, ValueError):
                    continue
                p = peak.setdefault(pid, {"rss": 0, "pss": 0})
                p["rss"], p["pss"] = max(p["rss"], info.rss), max(p["pss"], info.pss)
            done.wait(0.5)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    run_dir = tempfile.mkdtemp(prefix="colocation-run-")
    t0 = time.monotonic()
    run_training(load_config(None, MODEL + RUN + [f"trainer.default_local_dir={run_dir}"]))
    done.set()
    thread.join()
    pids = {f.name: int(f.read_text()) for f in PID_DIR.iterdir()}
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    gb = 1024**3
    ranks = {}
    for rank in (0, 1):
        procs = sorted({pids[f"actor-{rank}"], pids[f"ref-{rank}"]})
        ranks[rank] = {
            "processes": len(procs),
            "peak_rss_gb": sum(peak.get(p, {}).get("rss", 0) for p in procs) / gb,
            "peak_pss_gb": sum(peak.get(p, {}).get("pss", 0) for p in procs) / gb,
        }
    result = {
        "model_worker_processes": len(set(pids.values())),
        "per_rank": ranks,
        "metrics_cpu_memory_used_gb": {
            k: max(r[k] for r in rows if k in r)
            for k in ("actor/perf/cpu_memory_used_gb", "ref/perf/cpu_memory_used_gb")
            if any(k in r for r in rows)
        },
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result, indent=2))
    if out:
        Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
