"""What a rollout replica's death costs an asynchronous run: the time to its first new sample, and the step rate.

Runs `conveyor train --config examples/tiny_cpu.yaml` asynchronously (k = 1)
with the rollout in a Ray actor of its own (`rollout_process=own`) twice per
round: once untouched, once with the replica's process killed (SIGKILL, found
by its pid) every `--every` steps. Per killed run it reads, for each kill,
`fault/rollout_recovery_s` (from the death seen to the batch generated again
by the new replica: its first new samples) and `fault/rollout_restart_s`
(killing, starting the new process, loading the weights), and for both runs
the step rate (training steps over the summed `timing_s/step`, start-up
excluded), printed side by side with their ratio. The killed run's metrics
are also compared with the untouched run's (all but the measured seconds):
they must be equal.

    python benchmarks/fault.py                       # 1 round, 30 steps, a kill every 10 steps
    python benchmarks/fault.py --rounds 3 --steps 20 --every 10
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent

RUN = (
    "--config",
    "examples/tiny_cpu.yaml",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.progress_bar=false",
    "trainer.logger=[jsonl]",
    "trainer.save_freq=0",
    "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.sampler.max_off_policy_threshold=1",
    "trainer.v1.separate_async.rollout_process=own",
    "ray.num_cpus=4",
)

_MEASURED = re.compile(r"^(timing_s/|timing_cpu_s/|fault/)|(^|/)perf/|_s$|_cpu_s/|_idle_frac$")


def read_run(run_dir: Path) -> dict:
    """Steps/s (steps over the summed timing_s/step), the fault metrics of each step that had one, and the records
    without the measured seconds."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_s = sum(r.get("timing_s/step", 0.0) for r in records)
    faults = [{k: v for k, v in r.items() if k.startswith("fault/")} for r in records]
    return {
        "steps": len(records),
        "steps_per_s": len(records) / step_s if step_s > 0 else 0.0,
        "faults": [f for f in faults if f],
        "comparable": [
            json.dumps({k: v for k, v in r.items() if not _MEASURED.search(k)}, sort_keys=True) for r in records
        ],
    }


def _logged(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _replica(pid: int) -> psutil.Process | None:
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "RankActor" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


def run_once(run_dir: Path, steps: int, every: int, seed: int) -> None:
    """One run; with `every` > 0 the replica is killed in the middle of steps every, 2 every, ... (not the last)."""
    args = [sys.executable, "-m", "conveyor.cli", "train", *RUN, f"trainer.total_training_steps={steps}"]
    args += [f"trainer.seed={seed}", f"trainer.default_local_dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(run_dir.with_suffix(".err"), "w") as err:
        proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        for at in range(every, steps, every) if every > 0 else ():
            while proc.poll() is None and _logged(run_dir) < at - 1:
                time.sleep(0.01)
            replica = _replica(proc.pid) if proc.poll() is None else None
            if replica is not None:
                os.kill(replica.pid, signal.SIGKILL)
        status = proc.wait(timeout=3600)
    finally:
        if proc.poll() is None:
            proc.kill()
    if status != 0:
        raise RuntimeError(f"the run exited with {status}: see {run_dir.with_suffix('.err')}")


def main(argv: list[str] | None = None) -> int:
    """Untouched and killed runs, `--rounds` times; the figures and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    ratios, recoveries, restarts, same = [], [], [], True
    with tempfile.TemporaryDirectory(prefix="fault-bench-") as tmp:
        for r in range(args.rounds):
            runs = {}
            for name, every in (("untouched", 0), ("killed", args.every)):
                run_dir = Path(tmp) / f"{name}-{r}"
                run_once(run_dir, args.steps, every, args.seed + r)
                runs[name] = read_run(run_dir)
            base, hit = runs["untouched"], runs["killed"]
            ratio = hit["steps_per_s"] / base["steps_per_s"]
            ratios.append(ratio)
            recoveries += [f["fault/rollout_recovery_s"] for f in hit["faults"]]
            restarts += [f["fault/rollout_restart_s"] for f in hit["faults"]]
            same &= hit["comparable"] == base["comparable"]
            seen = ", ".join(f"{f['fault/rollout_recovery_s']:.1f}" for f in hit["faults"])
            print(
                f"round {r}: untouched {base['steps_per_s']:.3f} steps/s, killed every {args.every} steps "
                f"{hit['steps_per_s']:.3f} steps/s (x{ratio:.3f}); kills {len(hit['faults'])}, death to first new "
                f"samples {seen} s; metrics "
                f"{'equal' if hit['comparable'] == base['comparable'] else 'DIFFER'}"
            )
    print(
        f"death to first new samples: median {statistics.median(recoveries):.1f} s (min {min(recoveries):.1f}, max "
        f"{max(recoveries):.1f}; restart alone median {statistics.median(restarts):.1f} s) over {len(recoveries)} kills"
    )
    print(f"step rate with a kill every {args.every} steps / untouched: median x{statistics.median(ratios):.3f}")
    print(f"metrics of killed and untouched runs equal (all but measured seconds): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
