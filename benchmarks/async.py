"""The default task, synchronous vs asynchronous (k = 1): steps/s and held-out accuracy at equal wall-clock time.

Runs `conveyor train --config examples/tiny_cpu.yaml` alternately with
`trainer.v1.trainer_mode=sync` and with `separate_async` and
`max_off_policy_threshold=1`, the rollout in processes of its own
(`rollout_process=own`) and, as a third mode, on a thread of the trainer's
process (`rollout_process=trainer`, what `auto` picks); `--rounds`
rounds, sync first in each, one run at a time so that each has the whole
machine. Every run is a separate process; they share one model cache, so the
warm start is built once, before the first timed run.

Threads: every process gets `--threads` torch threads (default 1: on the tiny
model the ops are dominated by Python overhead, and on a 2-core machine a
second intra-op thread only adds spinning, which makes one thread the
fastest synchronous baseline).

Per run it prints steps/s (training steps over the summed `timing_s/step`:
validation, start-up and the warm start are left out, the same for every
mode), for the thread mode also the steps/s its two threads' CPU time per
step implies (the longer of the trainer's and the rollout's each step: what
two free cores and no interpreter lock between them would give), and the
held-out accuracy of every validation with the training time at which it was
reached. Then, per mode, the median steps/s, the speed-up over sync (median,
and per round), the final accuracy (equal steps) and the accuracy each mode
had reached when the slower one's training time ran out (equal wall-clock
time), and where a step's time goes: each stage's wall and CPU milliseconds, the CPU of each side (the
synchronous step's rollout side and the rest; the trainer's process and the rollout's workers), what the
composition adds to the trainer's side item by item, and what a core per process, free transfers, or a device per
side with a 1 s synchronous step would give (`projections`).

    python benchmarks/async.py                                  # 2 rounds of the full default run
    python benchmarks/async.py --rounds 1 --set trainer.total_training_steps=100 trainer.test_freq=50

On one GPU (benchmarks/gpu_check.sh runs this with a larger model) only the thread placement applies: a rollout
process of its own needs a device of its own. `--skip` leaves each run's warm-up steps out of its steps/s.
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
_K1 = ["trainer.v1.trainer_mode=separate_async", "trainer.v1.sampler.max_off_policy_threshold=1"]
MODES = {
    "sync": ["trainer.v1.trainer_mode=sync"],
    "async_k1": _K1 + ["trainer.v1.separate_async.rollout_process=own"],
    "async_k1_thread": _K1 + ["trainer.v1.separate_async.rollout_process=trainer"],
}


def read_run(run_dir: Path, skip: int = 0) -> dict:
    """steps, training seconds, steps/s, [(step, training seconds so far, val accuracy)] and the CPU-time estimates
    of a finished run; steps/s and the estimates leave out the first `skip` steps (a GPU's warm-up: kernels chosen,
    memory reserved), the curve's training time counts every step.

    The estimates, per step, from each side's CPU seconds (waits for a lock or a core count in none):
    - `cpu_steps_per_s` (rollout on a thread): the longer of the trainer's thread and the rollout's, what a core
      each and no interpreter lock between them would give;
    - `cores_steps_per_s` (rollout in processes of its own): the longer of the trainer's process and the rollout
      replica's plus the reward worker's (they run one after the other on a batch), what a core per process
      would give (on this machine: 4);
    - `two_cores_steps_per_s`: the three summed over two cores, the most two cores could give.
    """
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step: dict[int, dict] = {}
    for r in rows:  # a step may have several records (metrics, then validation): merge them
        by_step.setdefault(int(r["step"]), {}).update(r)
    elapsed, measured, cpu_bound, cores_bound, two_bound, curve, steps = 0.0, 0.0, 0.0, 0.0, 0.0, [], 0
    for step in sorted(by_step):
        r = by_step[step]
        wall = float(r.get("timing_s/step", 0.0))
        elapsed += wall
        if "val/accuracy" in r:
            curve.append((step, elapsed, float(r["val/accuracy"])))
        if "timing_s/step" not in r or step <= skip:
            continue
        measured += wall
        steps += 1
        if "off_policy/trainer_cpu_s" in r:
            cpu_bound += max(float(r["off_policy/trainer_cpu_s"]), float(r["off_policy/rollout_cpu_s"]))
        else:
            cpu_bound += wall
        trainer = float(r.get("off_policy/trainer_process_cpu_s", wall))
        rollout = float(r.get("rollout/perf/cpu_s", 0.0)) + float(r.get("reward/perf/cpu_s", 0.0))
        cores_bound += max(trainer, rollout)
        two_bound += (trainer + rollout) / 2
    rate = lambda total: steps / total if total else 0.0  # noqa: E731
    return {
        "steps": steps,
        "train_s": elapsed,
        "steps_per_s": rate(measured),
        "curve": curve,
        "cpu_steps_per_s": rate(cpu_bound),
        "cores_steps_per_s": rate(cores_bound),
        "two_cores_steps_per_s": rate(two_bound),
    }


# The breakdowns' first steps left out by default (start-up: the first batches, caches filling).
BREAKDOWN_SKIP = 5


def breakdown_skip(skip: int | None) -> int:
    """The steps the breakdowns leave out: `--skip` when given, else BREAKDOWN_SKIP."""
    return BREAKDOWN_SKIP if skip is None else skip


# The stages a step's time goes to (timing_s/*), and each side's CPU seconds (off_policy/*), in the breakdown.
STAGES = (
    "step",
    "gen",
    "reward",
    "prompts",
    "old_log_prob",
    "adv",
    "update_actor",
    "metrics",
    "async/wait",
    "async/dispatch",
    "async/stage_weights",
    "async/rollout_gen",
    "async/rollout_reward",
)
CPU = (
    "off_policy/trainer_cpu_s",
    "off_policy/rollout_cpu_s",
    "off_policy/trainer_process_cpu_s",
    "off_policy/helper_cpu_s/rollout",
    "off_policy/helper_cpu_s/data_plane",
    "off_policy/helper_cpu_s/weights",
    "rollout/perf/cpu_s",
    "reward/perf/cpu_s",
)


def stage_medians(run_dir: Path, skip: int = BREAKDOWN_SKIP) -> dict[str, float]:
    """Median milliseconds per step of each stage in STAGES and each CPU figure in CPU (steps after `skip`)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing_s/step" in r and int(r["step"]) > skip]
    out = {}
    for key in [f"timing_s/{s}" for s in STAGES] + [f"timing_cpu_s/{s}" for s in STAGES] + list(CPU):
        values = [float(r[key]) for r in rows if key in r]
        if values:
            out[key] = 1e3 * statistics.median(values)
    return out


# The stages of a synchronous step that an asynchronous run moves to the rollout's side.
ROLLOUT_SIDE = ("prompts", "gen", "reward")


def cpu_sides(run_dir: Path, skip: int = BREAKDOWN_SKIP) -> dict[str, float]:
    """Median CPU milliseconds per step of a run's two sides (steps after `skip`).

    A synchronous run (one thread does everything): `rollout` is its ROLLOUT_SIDE stages' CPU, `trainer` the rest of
    its step's. An asynchronous one with the rollout in processes of its own: `trainer` is the trainer's whole
    process (its thread and the helpers serving the rollout), `rollout` the replica's and the reward worker's.
    Not for the rollout on a thread of the trainer's process: its process's CPU holds the rollout's too.
    """
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing_s/step" in r and int(r["step"]) > skip]
    trainer, rollout = [], []
    for r in rows:
        if "off_policy/trainer_process_cpu_s" in r:
            trainer.append(float(r["off_policy/trainer_process_cpu_s"]))
            rollout.append(float(r.get("rollout/perf/cpu_s", 0.0)) + float(r.get("reward/perf/cpu_s", 0.0)))
        elif "timing_cpu_s/step" in r and "timing_cpu_s/gen" in r:
            side = sum(float(r.get(f"timing_cpu_s/{k}", 0.0)) for k in ROLLOUT_SIDE)
            trainer.append(float(r["timing_cpu_s/step"]) - side)
            rollout.append(side)
    if not trainer:
        return {}
    return {"trainer": 1e3 * statistics.median(trainer), "rollout": 1e3 * statistics.median(rollout)}


def projections(
    sync: dict[str, float], own: dict[str, float], sync_step_ms: float, gpu_step_ms: float = 1000.0
) -> dict[str, float]:
    """What other machines would give the own-process placement, from the CPU sides (`cpu_sides`) of a synchronous
    run and an asynchronous one and the synchronous step's wall milliseconds.

    - `overhead_ms`: what the composition adds to the trainer's side (the trainer's process against the synchronous
      step's trainer side: serving the data plane, sending weights, drawing prompts, the rollout's calls);
    - `cores`: a core per process (4 cores here). The trainer's process is one interpreter: its CPU stays serial;
    - `ceiling`: both sides as the synchronous step has them, free transfers (what the overlap alone can give);
    - `gpu`: a device per side and a synchronous step of `gpu_step_ms` split between the sides as this one is, the
      overhead (per batch, not per parameter) added to the trainer's side.
    """
    overhead = own["trainer"] - sync["trainer"]
    total = sync["trainer"] + sync["rollout"]
    share_trainer, share_rollout = sync["trainer"] / total, sync["rollout"] / total
    return {
        "overhead_ms": overhead,
        "cores": sync_step_ms / max(own["trainer"], own["rollout"]),
        "ceiling": total / max(sync["trainer"], sync["rollout"]),
        "gpu": gpu_step_ms / max(share_trainer * gpu_step_ms + overhead, share_rollout * gpu_step_ms),
    }


def overhead_items(sync: dict[str, float], own: dict[str, float]) -> dict[str, float]:
    """Where the composition's extra CPU goes: per item, the own-process run's CPU milliseconds per step (medians, from
    `stage_medians`) beyond the synchronous run's trainer side.

    The trainer's thread: the stages both runs have, each against its synchronous self (the same work, slower beside
    the helpers), the source's hand-out (prompts), weight copy (`async/stage_weights`) and wait, the rest of its
    step; then the process's helper threads by group, and its other threads (Ray's, gloo's, torch's: the process's
    CPU less the thread's and the helpers').
    """
    items: dict[str, float] = {}
    for stage in STAGES:
        key = f"timing_cpu_s/{stage}"
        if key in own and stage != "step" and not stage.startswith("async/rollout_"):
            items[stage] = own[key] - sync.get(key, 0.0)
    if "timing_cpu_s/step" in own and "timing_cpu_s/step" in sync:
        # The step's own code outside its stages (the source's bookkeeping: versions, logs), against sync's.
        def untimed(st: dict[str, float]) -> float:
            timed = (k for k in STAGES if k != "step" and not k.startswith("async/rollout_"))
            return st["timing_cpu_s/step"] - sum(st.get(f"timing_cpu_s/{k}", 0.0) for k in timed)

        items["rest of the step"] = untimed(own) - untimed(sync)
    helpers = {
        k.removeprefix("off_policy/helper_cpu_s/"): v
        for k, v in own.items()
        if k.startswith("off_policy/helper_cpu_s/")
    }
    items.update({f"{k} threads": v for k, v in helpers.items()})
    if "off_policy/trainer_process_cpu_s" in own and "off_policy/trainer_cpu_s" in own:
        items["other threads"] = (
            own["off_policy/trainer_process_cpu_s"] - own["off_policy/trainer_cpu_s"] - sum(helpers.values())
        )
    return items


def over_rounds(figures: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over rounds (the figures every round has): per-op speed drifts between runs minutes apart
    on a shared machine, so one round's two runs can differ in a stage that does the same work in both."""
    keys = set.intersection(*(set(f) for f in figures)) if figures else set()
    return {k: statistics.median(f[k] for f in figures) for k in figures[0] if k in keys} if figures else {}


def print_ledger(sync_runs: list[dict], own_runs: list[dict]) -> None:
    """Both sides' CPU per step, what the composition adds item by item, and `projections`, over all rounds."""
    sync_sides, own_sides = over_rounds([r["sides"] for r in sync_runs]), over_rounds([r["sides"] for r in own_runs])
    if not sync_sides or not own_sides:
        return
    st, ot = over_rounds([r["stages"] for r in sync_runs]), over_rounds([r["stages"] for r in own_runs])
    pr = projections(sync_sides, own_sides, st["timing_s/step"])
    print(
        f"\nCPU ms per step by side (medians over {len(own_runs)} rounds): sync trainer side "
        f"{sync_sides['trainer']:.1f}, rollout side {sync_sides['rollout']:.1f}; rollout in processes of its own: "
        f"the trainer's process {own_sides['trainer']:.1f} (the composition adds {pr['overhead_ms']:.1f}), rollout "
        f"and reward workers {own_sides['rollout']:.1f}"
    )
    items = overhead_items(st, ot)
    print("  of what it adds: " + ", ".join(f"{k} {v:+.1f}" for k, v in items.items()))
    print(
        f"  a core per process (its interpreter keeps the trainer's process serial): {pr['cores']:.2f}x; "
        f"both sides as the synchronous step has them: {pr['ceiling']:.2f}x; a device per side and a 1 s "
        f"synchronous step split the same way, {pr['overhead_ms']:.1f} ms added to the trainer's side: "
        f"{pr['gpu']:.2f}x"
    )


def _label(key: str) -> str:
    """A breakdown entry's name: the stage, or the CPU figure's side."""
    if key.startswith("timing_s/"):
        return key.removeprefix("timing_s/")
    if key.startswith("timing_cpu_s/"):
        return key.removeprefix("timing_cpu_s/") + " CPU"
    return {
        "off_policy/trainer_cpu_s": "trainer thread CPU",
        "off_policy/rollout_cpu_s": "rollout thread CPU",
        "off_policy/trainer_process_cpu_s": "trainer process CPU",
        "off_policy/helper_cpu_s/rollout": "of it: rollout thread",
        "off_policy/helper_cpu_s/data_plane": "data-plane server threads",
        "off_policy/helper_cpu_s/weights": "weight-sending threads",
        "rollout/perf/cpu_s": "rollout worker CPU",
        "reward/perf/cpu_s": "reward worker CPU",
    }.get(key, key)


def accuracy_at(curve: list[tuple[int, float, float]], seconds: float) -> float:
    """The accuracy of the last validation reached within `seconds` of training (the step-0 one at least)."""
    reached = [acc for _, t, acc in curve if t <= seconds + 1e-9]
    return reached[-1] if reached else curve[0][2]


def run_one(
    mode: str,
    out: Path,
    config: Path,
    overrides: list[str],
    threads: int | None,
    env_base: dict,
    skip: int | None = None,
) -> dict:
    run_dir = out / f"{mode}-{int(time.time() * 1000)}"
    cmd = [
        sys.executable,
        "-m",
        "conveyor.cli",
        "train",
        "--config",
        str(config),
        *MODES[mode],
        *overrides,
        f"trainer.default_local_dir={run_dir}",
        "trainer.progress_bar=false",
        "trainer.logger=[jsonl]",
    ]
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
    # Steps/s over every step unless told to leave the first out; the breakdowns after the 5th by default.
    result = read_run(run_dir, skip=skip or 0)
    after = breakdown_skip(skip)
    sides = cpu_sides(run_dir, skip=after) if mode != "async_k1_thread" else {}
    result.update(mode=mode, wall_s=wall, stages=stage_medians(run_dir, skip=after), sides=sides)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="rounds of every mode, alternating")
    p.add_argument("--config", type=Path, default=DEFAULT_RUN)
    p.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    p.add_argument(
        "--modes",
        nargs="*",
        default=list(MODES),
        choices=list(MODES),
        help="the modes to run (sync is always run: the others are compared with it)",
    )
    p.add_argument(
        "--skip",
        type=int,
        default=None,
        help="leave a run's first SKIP steps out of its steps/s and its breakdowns (a GPU's warm-up; "
        "default: every step counts in steps/s, the breakdowns start after the 5th)",
    )
    p.add_argument("--set", nargs="*", default=[], help="config overrides for every mode")
    p.add_argument("--out", type=Path, default=None, help="where runs are written (default: a temporary folder)")
    args = p.parse_args(argv)
    modes = ["sync"] + [m for m in args.modes if m != "sync"]
    out = args.out or Path(tempfile.mkdtemp(prefix="conveyor-async-bench-"))
    env = dict(os.environ)
    env.setdefault("CONVEYOR_CACHE", str(out / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    print(f"load average before: {os.getloadavg()[0]:.2f}  cores: {os.cpu_count()}", flush=True)
    # The warm start is built (and cached) once, outside the timed runs.
    run_one("sync", out, args.config, args.set + ["trainer.total_training_steps=1"], args.threads, env)
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(args.rounds):
        for mode in modes:
            r = run_one(mode, out, args.config, args.set, args.threads, env, args.skip)
            results[mode].append(r)
            curve = "  ".join(f"{s}:{acc:.3f}@{t:.0f}s" for s, t, acc in r["curve"])
            cpu = (
                f"  (two free cores, no lock: {r['cpu_steps_per_s']:6.2f} steps/s)"
                if mode == "async_k1_thread"
                else f"  (a core per process: {r['cores_steps_per_s']:6.2f}, two cores at best: "
                f"{r['two_cores_steps_per_s']:6.2f} steps/s)"
                if mode == "async_k1"
                else ""
            )
            print(
                f"round {rnd + 1} {mode:15s} {r['steps_per_s']:6.2f} steps/s{cpu}  train {r['train_s']:6.1f} s  "
                f"process {r['wall_s']:6.1f} s  val acc (step:acc@train time) {curve}",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    sync = results["sync"]
    med = {m: statistics.median(r["steps_per_s"] for r in rs) for m, rs in results.items()}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"\nmedian steps/s: sync {med['sync']:.2f}")
    for mode in modes[1:]:
        rs = results[mode]
        pairs = ", ".join(f"{a['steps_per_s'] / s['steps_per_s']:.2f}" for s, a in zip(sync, rs))
        print(f"  {mode:15s} {med[mode]:.2f} -> {med[mode] / med['sync']:.2f}x (per round: {pairs})")
        if mode == "async_k1_thread":
            est = statistics.median(r["cpu_steps_per_s"] for r in rs)
            print(
                f"  {mode:15s} from its threads' CPU time per step (a core each, no interpreter lock between "
                f"them): {est:.2f} steps/s -> {est / med['sync']:.2f}x"
            )
        if mode == "async_k1":
            cores = statistics.median(r["cores_steps_per_s"] for r in rs)
            two = statistics.median(r["two_cores_steps_per_s"] for r in rs)
            print(
                f"  {mode:15s} from its processes' CPU time per step: a core each (trainer, rollout, reward) "
                f"{cores:.2f} steps/s -> {cores / med['sync']:.2f}x; the most two cores could give "
                f"{two:.2f} -> {two / med['sync']:.2f}x"
            )
        for i, (s, a) in enumerate(zip(sync, rs)):
            budget = min(s["train_s"], a["train_s"])
            print(
                f"  round {i + 1}: final accuracy (equal steps) sync {s['curve'][-1][2]:.3f}, {mode} "
                f"{a['curve'][-1][2]:.3f}; at equal training time {budget:.0f} s: sync "
                f"{accuracy_at(s['curve'], budget):.3f}, {mode} {accuracy_at(a['curve'], budget):.3f}"
            )
    print(
        f"\nwhere a step's time goes (median ms per step over the run's steps after step "
        f"{breakdown_skip(args.skip)}, last round):"
    )
    for mode, rs in results.items():
        stages = rs[-1]["stages"]
        # A stage's wall time, with its thread's CPU time beside it.
        shown = [
            f"{_label(k)} {v:.1f}"
            + (
                f" (CPU {stages[c]:.1f})"
                if (c := "timing_cpu_s/" + k.removeprefix("timing_s/")) in stages and k.startswith("timing_s/")
                else ""
            )
            for k, v in stages.items()
            if not k.startswith("timing_cpu_s/")
        ]
        print(f"  {mode:15s} " + ", ".join(shown))
    st = results["sync"][-1]["stages"]
    rollout_side = sum(st.get(f"timing_s/{k}", 0.0) for k in ("gen", "reward", "prompts"))
    if rollout_side:
        print(
            f"\nthe overlap's ceiling from the synchronous step (last round): {st['timing_s/step']:.1f} ms against "
            f"the longer of its rollout side (prompts, gen, reward: {rollout_side:.1f} ms) and the rest "
            f"({st['timing_s/step'] - rollout_side:.1f} ms): "
            f"{st['timing_s/step'] / max(rollout_side, st['timing_s/step'] - rollout_side):.2f}x, what a machine "
            "with a device (or cores) per side and free transfers would give"
        )
    if results.get("async_k1"):
        print_ledger(results["sync"], results["async_k1"])
    print(
        "mean final accuracy: "
        + ", ".join(f"{m} {mean([r['curve'][-1][2] for r in rs]):.3f}" for m, rs in results.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
