"""Does a vision-language policy learn a visual task? GRPO from random weights over several seeds.

Each seed runs two processes, as a user would:

1. `conveyor build-vlm --arch ARCH --seed S`: the tiny VLM with random weights (with `--warmstart-until ACC`,
   warm-started on the sum task's training split until greedy exact match on its training batches reaches ACC);
2. `conveyor train --config examples/vlm_tiny.yaml` on that checkpoint with `trainer.seed=S`: the counting task
   (`data.synthetic.task=visual_count`), held-out images that no training image equals.

Prints one line per seed: warm-start steps, held-out exact-match accuracy (greedy, `val/accuracy`) at step 0 and at
the last step, the gain, and the CPU time of each process (its own, from wait4: other work on the machine does not
inflate it) and their sum. A seed passes when its gain is at least `--bar` (0.3) and the two processes together took
at most `--cpu-budget` seconds (600). The exit status is 1 when a seed failed or missed either.

    python benchmarks/vlm_task.py                         # seeds 0, 1, 2 (about 5 minutes each on 2 cores)
    python benchmarks/vlm_task.py --seeds 3 --set trainer.total_training_steps=400
    python benchmarks/vlm_task.py --warmstart-until 0.45 --set data.synthetic.task=visual_sum \
        data.synthetic.num_train=67 data.synthetic.num_val=33   # the sum task, held-out pairs
    python benchmarks/vlm_task.py --smoke                 # a few steps of each, no bar
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "vlm_tiny.yaml"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_run import val_accuracy  # noqa: E402  (the one reader of val/accuracy)

_WARM_STEPS = re.compile(r"warm-started (\d+) steps")


def _run(cmd: list[str], log: Path, threads: int) -> tuple[int, float]:
    """Run `cmd` from the repository root into `log`; (exit status, its own CPU seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime


def run_seed(seed: int, out: Path, args: argparse.Namespace) -> dict:
    """Warm-start and train one seed; what it measured."""
    model, run_dir = out / f"model{seed}", out / f"run{seed}"
    build = [sys.executable, "-m", "conveyor.cli", "build-vlm", "--arch", args.arch, "--seed", str(seed)]
    build += ["--warmstart-until", str(args.warmstart_until), "--out", str(model)]
    if args.smoke:
        build += ["--warmstart-steps", "3"]
    status, warm_cpu = _run(build, out / f"build{seed}.log", args.threads)
    row = {"seed": seed, "status": status, "warm_cpu_s": warm_cpu, "rl_cpu_s": 0.0, "first": None, "last": None}
    found = _WARM_STEPS.search((out / f"build{seed}.log").read_text())
    row["warm_steps"] = int(found.group(1)) if found else (0 if args.warmstart_until == 0 else None)
    if status != 0:
        return row
    train = [sys.executable, "-m", "conveyor.cli", "train", "--config", str(args.config)]
    train += [f"actor_rollout_ref.model.path={model}", f"trainer.seed={seed}", f"trainer.default_local_dir={run_dir}"]
    train += ["trainer.progress_bar=false", "trainer.save_freq=0"]
    if args.smoke:
        train += ["trainer.total_training_steps=2", "trainer.test_freq=2", "data.train_batch_size=4"]
        train += ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2"]
        train += ["data.synthetic.num_train=32", "data.synthetic.num_val=8"]  # each image is processed at load
    row["status"], row["rl_cpu_s"] = _run([*train, *args.set], out / f"train{seed}.log", args.threads)
    history = val_accuracy(run_dir)
    if history:
        row["first"], row["last"] = history[0][1], history[-1][1]
    return row


def passed(row: dict, bar: float, budget: float) -> bool:
    """Whether a seed ran, gained at least `bar` in held-out accuracy, within `budget` CPU seconds."""
    if row["status"] != 0 or row["first"] is None:
        return False
    return row["last"] - row["first"] >= bar and row["warm_cpu_s"] + row["rl_cpu_s"] <= budget


def main(argv: Sequence[str] | None = None) -> int:
    """Run the seeds, print each and the spread; 1 when a seed failed or missed the bar."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arch", default="qwen2_5_vl", help="the tiny VLM family (%(default)s)")
    parser.add_argument("--warmstart-until", type=float, default=0.0, help="the warm start's stop (%(default)s)")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the training config (%(default)s)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more training overrides")
    parser.add_argument("--bar", type=float, default=0.3, help="held-out accuracy gain each seed needs (%(default)s)")
    parser.add_argument("--cpu-budget", type=float, default=600.0, help="CPU seconds per seed (%(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each process (%(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="where the models and runs go (a temporary dir)")
    parser.add_argument("--smoke", action="store_true", help="a few steps of each, no bar")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vlm_task_") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        print(f"{args.arch}, warm start until {args.warmstart_until}, {args.config.name} {' '.join(args.set)}")
        print("seed | warm-start steps | held-out accuracy, step 0 -> last | gain | CPU s: warm start + RL = total")
        rows = []
        for seed in args.seeds:
            row = run_seed(seed, out, args)
            rows.append(row)
            cpu = row["warm_cpu_s"] + row["rl_cpu_s"]
            if row["first"] is None:
                print(f"{seed} | failed (exit {row['status']}; logs in {out})")
                continue
            print(
                f"{seed} | {row['warm_steps']} | {row['first']:.3f} -> {row['last']:.3f} | "
                f"{row['last'] - row['first']:+.3f} | {row['warm_cpu_s']:.0f} + {row['rl_cpu_s']:.0f} = {cpu:.0f}"
                + ("" if args.smoke or passed(row, args.bar, args.cpu_budget) else "  (below the bar)")
            )
        done = [r for r in rows if r["first"] is not None]
        if done:
            gains = [r["last"] - r["first"] for r in done]
            cpus = [r["warm_cpu_s"] + r["rl_cpu_s"] for r in done]
            print(
                f"gain min {min(gains):+.3f} median {statistics.median(gains):+.3f} max {max(gains):+.3f}; CPU s "
                f"min {min(cpus):.0f} median {statistics.median(cpus):.0f} max {max(cpus):.0f}; "
                f"{sum(passed(r, args.bar, args.cpu_budget) for r in rows)} of {len(rows)} seeds gained "
                f">= {args.bar} within {args.cpu_budget:.0f} CPU s"
            )
        if args.smoke:
            return 0 if len(done) == len(rows) else 1
        return 0 if all(passed(r, args.bar, args.cpu_budget) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
