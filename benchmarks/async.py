"""The default task, synchronous vs asynchronous (k = 1): steps/s and held-out accuracy at equal wall-clock time.

Runs `conveyor train --config examples/tiny_cpu.yaml` alternately with
`trainer.v1.trainer_mode=sync` and with `separate_async` and
`max_off_policy_threshold=1` (`--rounds` pairs, sync first in each), one run
at a time so that each has the whole machine. Every run is a separate process;
they share one model cache, so the warm start is built once, before the first
timed run.

Threads: the synchronous run gets `--sync-threads` torch threads (default 1:
on the tiny model the ops are dominated by Python overhead, and on a 2-core
machine a second intra-op thread only adds spinning, which makes one thread
the faster baseline; pass 2 to compare against that too). The asynchronous
run starts with all the cores' threads and gives each of its two threads,
the trainer's and the rollout's, half of them (`conveyor.trainer.sources`).

Per run it prints steps/s (training steps over the summed `timing_s/step`:
validation, start-up and the warm start are left out, the same for both
modes), for the asynchronous run also the steps/s its two threads' CPU time
per step implies (the longer of the trainer's and the rollout's each step:
what two free cores and no interpreter lock between them would give; waits
for the lock count in neither), and the held-out accuracy of every validation with the training time
at which it was reached. Then, per mode, the median steps/s, the speed-up,
the final accuracy (equal steps) and the accuracy each mode had reached when
the slower one's training time ran out (equal wall-clock time).

    python benchmarks/async.py                                  # 2 rounds of the full default run
    python benchmarks/async.py --rounds 1 --set trainer.total_training_steps=100 trainer.test_freq=50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RUN = ROOT / "examples" / "tiny_cpu.yaml"
MODES = {
    "sync": ["trainer.v1.trainer_mode=sync"],
    "async_k1": ["trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_threshold=1"],
}


def read_run(run_dir: Path) -> dict:
    """steps, training seconds, steps/s and [(step, training seconds so far, val accuracy)] of a finished run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step: dict[int, dict] = {}
    for r in rows:  # a step may have several records (metrics, then validation): merge them
        by_step.setdefault(int(r["step"]), {}).update(r)
    elapsed, cpu_bound, curve, steps = 0.0, 0.0, [], 0
    for step in sorted(by_step):
        r = by_step[step]
        if "timing_s/step" in r:
            elapsed += float(r["timing_s/step"])
            steps += 1
            # The async run's per-step CPU seconds of its two threads: with a core each and no lock
            # between them a step takes the longer of the two (plus the trainer's waits, left out).
            if "off_policy/trainer_cpu_s" in r:
                cpu_bound += max(float(r["off_policy/trainer_cpu_s"]), float(r["off_policy/rollout_cpu_s"]))
            else:
                cpu_bound += float(r["timing_s/step"])
        if "val/accuracy" in r:
            curve.append((step, elapsed, float(r["val/accuracy"])))
    return {"steps": steps, "train_s": elapsed, "steps_per_s": steps / elapsed if elapsed else 0.0, "curve": curve,
            "cpu_steps_per_s": steps / cpu_bound if cpu_bound else 0.0}


# The stages a step's time goes to (timing_s/*), and each side's CPU seconds (off_policy/*), in the breakdown.
STAGES = ("step", "gen", "reward", "prompts", "old_log_prob", "adv", "update_actor", "metrics", "async/wait",
          "async/dispatch", "async/rollout_gen", "async/rollout_reward")
CPU = ("off_policy/trainer_cpu_s", "off_policy/rollout_cpu_s")


def stage_medians(run_dir: Path, skip: int = 5) -> dict[str, float]:
    """Median milliseconds per step of each stage in STAGES and each CPU figure in CPU (steps after `skip`)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing_s/step" in r and int(r["step"]) > skip]
    out = {}
    for key in [f"timing_s/{s}" for s in STAGES] + list(CPU):
        values = [float(r[key]) for r in rows if key in r]
        if values:
            out[key] = 1e3 * statistics.median(values)
    return out


def accuracy_at(curve: list[tuple[int, float, float]], seconds: float) -> float:
    """The accuracy of the last validation reached within `seconds` of training (the step-0 one at least)."""
    reached = [acc for _, t, acc in curve if t <= seconds + 1e-9]
    return reached[-1] if reached else curve[0][2]


def run_one(mode: str, out: Path, config: Path, overrides: list[str], threads: int | None, env_base: dict) -> dict:
    run_dir = out / f"{mode}-{int(time.time() * 1000)}"
    cmd = [sys.executable, "-m", "conveyor.cli", "train", "--config", str(config), *MODES[mode], *overrides,
           f"trainer.default_local_dir={run_dir}", "trainer.progress_bar=false", "trainer.logger=[jsonl]"]
    env = dict(env_base)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    else:
        env.pop("OMP_NUM_THREADS", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = read_run(run_dir)
    result.update(mode=mode, wall_s=wall, stages=stage_medians(run_dir))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="sync/async pairs, alternating")
    p.add_argument("--config", type=Path, default=DEFAULT_RUN)
    p.add_argument("--sync-threads", type=int, default=1, help="torch threads of the synchronous runs")
    p.add_argument("--set", nargs="*", default=[], help="config overrides for both modes")
    p.add_argument("--out", type=Path, default=None, help="where runs are written (default: a temporary folder)")
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="conveyor-async-bench-"))
    env = dict(os.environ)
    env.setdefault("CONVEYOR_CACHE", str(out / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    print(f"load average before: {os.getloadavg()[0]:.2f}  cores: {os.cpu_count()}", flush=True)
    # The warm start is built (and cached) once, outside the timed runs.
    run_one("sync", out, args.config, args.set + ["trainer.total_training_steps=1"], args.sync_threads, env)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for rnd in range(args.rounds):
        for mode in MODES:
            r = run_one(mode, out, args.config, args.set, args.sync_threads if mode == "sync" else None, env)
            results[mode].append(r)
            curve = "  ".join(f"{s}:{acc:.3f}@{t:.0f}s" for s, t, acc in r["curve"])
            cpu = f"  (idle-machine estimate {r['cpu_steps_per_s']:6.2f} steps/s)" if mode != "sync" else ""
            print(f"round {rnd + 1} {mode:8s} {r['steps_per_s']:6.2f} steps/s{cpu}  train {r['train_s']:6.1f} s  "
                  f"process {r['wall_s']:6.1f} s  val acc (step:acc@train time) {curve}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    sync, asy = results["sync"], results["async_k1"]
    med = {m: statistics.median(r["steps_per_s"] for r in rs) for m, rs in results.items()}
    print(f"\nmedian steps/s: sync {med['sync']:.2f}, async k=1 {med['async_k1']:.2f} -> "
          f"{med['async_k1'] / med['sync']:.2f}x")
    est = statistics.median(r["cpu_steps_per_s"] for r in asy)
    print(f"async k=1 from its threads' CPU time per step (a core each, no interpreter lock between them): "
          f"{est:.2f} steps/s -> {est / med['sync']:.2f}x the synchronous wall-clock figure")
    for i, (s, a) in enumerate(zip(sync, asy)):
        budget = min(s["train_s"], a["train_s"])
        print(f"round {i + 1}: final accuracy (equal steps) sync {s['curve'][-1][2]:.3f}, async {a['curve'][-1][2]:.3f}; "
              f"at equal training time {budget:.0f} s: sync {accuracy_at(s['curve'], budget):.3f}, "
              f"async {accuracy_at(a['curve'], budget):.3f}")
    print("\nwhere a step's time goes (median ms per step over the run's steps after the 5th, last round):")
    for mode, rs in results.items():
        stages = rs[-1]["stages"]
        print(f"  {mode:8s} " + ", ".join(f"{k.split('/', 1)[1]} {v:.1f}" for k, v in stages.items()))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"mean final accuracy: sync {mean([r['curve'][-1][2] for r in sync]):.3f}, "
          f"async k=1 {mean([r['curve'][-1][2] for r in asy]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
