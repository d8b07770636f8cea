"""On-policy distillation against GRPO on the default task: steps to reach the teacher's held-out accuracy.

The teacher is the default tiny MoE after the default 600-step GRPO run
(`conveyor train --config examples/tiny_cpu.yaml`, trainer seed 0), exported
with `conveyor export`. The student starts from the same warm start (the same
cached tiny model) and is trained by pure distillation with the recipe of
`--distill-config` (examples/distill_tiny.yaml: `full_reverse_kl`, `use_task_rewards=false`, one sample
of each of 256 prompts per step, lr 1e-3 on a cosine schedule to zero) for half the GRPO run's steps; the
`--distill-*` options and `--distill-set` change one part of it. GRPO's own runs (trainer seeds `--seeds`, the
first of which is the teacher's) are the baseline: for each curve the first
validated step whose held-out exact-match accuracy is within `--margin` of the
teacher's is its step count (the mean of it and the next two validations, so that one lucky validation of a
noisy curve does not count). Prints both curves' step counts per seed and the
ratio of the means (distillation / GRPO; the issue asks for at most 0.5), and
each run's median CPU seconds per step (`timing_cpu_s/step`: what a step costs, beside how many it takes).

    python benchmarks/distillation.py                        # 3 seeds, 2 runs at a time (about 4 min idle)
    python benchmarks/distillation.py --reuse --tag n8 --distill-set actor_rollout_ref.rollout.n=8 \
        data.train_batch_size=32 actor_rollout_ref.actor.ppo_mini_batch_size=32   # one variant, GRPO's runs kept
    python benchmarks/distillation.py --seeds 0 --grpo-steps 40 --set data.train_batch_size=8

Every run is its own `conveyor train` process with `--threads` torch threads;
the runs share one model cache, so the warm start is built once. GRPO's runs
are seeded and deterministic: `--reuse` keeps the finished ones found under
`--out` (and any finished distillation run of the same `--tag`), so a variant
of the recipe costs only its own runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conveyor.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUN = ROOT / "examples" / "tiny_cpu.yaml"
DISTILL_RUN = ROOT / "examples" / "distill_tiny.yaml"


def val_accuracy(run_dir: Path) -> list[tuple[int, float]]:
    """(step, val/accuracy) of every validation in `run_dir/metrics.jsonl`, by step."""
    found: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "val/accuracy" in record:
                found[int(record["step"])] = float(record["val/accuracy"])
    return sorted(found.items())


def distill_kl(run_dir: Path) -> list[tuple[int, float]]:
    """(step, distill/kl_k1) of every training step in `run_dir/metrics.jsonl`."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "distill/kl_k1" in record:
            out.append((int(record["step"]), float(record["distill/kl_k1"])))
    return out


def median_step_cpu_s(run_dir: Path) -> float | None:
    """The median `timing_cpu_s/step` over the run's steps (None when it logged none)."""
    values = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "timing_cpu_s/step" in record:
            values.append(float(record["timing_cpu_s/step"]))
    return statistics.median(values) if values else None


def first_reaching(curve: Sequence[tuple[int, float]], target: float, window: int = 3) -> int | None:
    """The first validated step from which the mean of `window` validations reaches `target` (None: never).

    A held-out accuracy over 128 problems moves by about 0.04 between two validations; one lucky validation
    is not the curve reaching a level, so the mean of it and the next `window` - 1 must be at the target.
    """
    accs = [acc for _, acc in curve]
    for i, (step, _) in enumerate(curve):
        chunk = accs[i : i + window]
        if len(chunk) == window and sum(chunk) / window >= target - 1e-9:
            return step
    return None


def train(
    run_dir: Path, seed: int, overrides: Sequence[str], args: argparse.Namespace, config: Path = DEFAULT_RUN
) -> dict:
    """One `conveyor train --config CONFIG` in its own process; its curve and wall time (None when reused)."""
    done = val_accuracy(run_dir)
    steps = next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("trainer.total_training_steps=")), None)
    if args.reuse and done and steps is not None and done[-1][0] == steps:
        return {"run_dir": run_dir, "curve": done, "wall_s": None}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "CONVEYOR_CACHE": str(args.out / "cache")}
    cmd = [
        sys.executable,
        "-m",
        "conveyor.cli",
        "train",
        "--config",
        str(config),
        f"trainer.default_local_dir={run_dir}",
        f"trainer.seed={seed}",
        f"trainer.test_freq={args.test_freq}",
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=false",
        "trainer.resume_mode=disable",
        *overrides,
        *args.set,
    ]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        status = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with status {status}; see {run_dir.parent / run_dir.name}.log")
    return {"run_dir": run_dir, "curve": val_accuracy(run_dir), "wall_s": time.perf_counter() - start}


def load_recipe(config: Path, overrides: Sequence[str]) -> str:
    """The distillation runs' recipe in one line: the keys that decide how many steps the student needs."""
    cfg = load_config(config, list(overrides))
    arr, loss = cfg.actor_rollout_ref, cfg.distillation.distillation_loss
    optim = arr.actor.optim
    return (
        f"loss_mode={loss.loss_mode}, use_task_rewards={str(loss.use_task_rewards).lower()}, "
        f"{cfg.data.train_batch_size} prompts x n={arr.rollout.n} per step (mini-batch {arr.actor.ppo_mini_batch_size}"
        f" prompts), lr {optim.lr:g} ({optim.lr_scheduler}, floor {optim.min_lr_ratio:g}, "
        f"{optim.lr_warmup_steps} warm-up steps), temperature {arr.rollout.temperature:g}, "
        f"{cfg.trainer.total_training_steps} steps"
    )


def export_teacher(run_dir: Path, out: Path) -> Path:
    """`conveyor export` of the run's last checkpoint into `out` (kept when it is there already)."""
    if not (out / "config.json").is_file():
        cmd = [sys.executable, "-m", "conveyor.cli", "export", str(run_dir), "--out", str(out)]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return out


def _mean(values: list[int]) -> float:
    return statistics.mean(values) if values else float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the GRPO baseline, export the teacher, distil, and print the step counts and their ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="trainer seeds (the first makes the teacher)"
    )
    p.add_argument("--grpo-steps", type=int, default=600, help="steps of each GRPO run (the teacher's included)")
    p.add_argument("--distill-steps", type=int, default=None, help="steps of each distillation run; default half")
    p.add_argument(
        "--distill-config", type=Path, default=DISTILL_RUN, help="the distillation runs' recipe (its teacher replaced)"
    )
    p.add_argument("--loss-mode", default=None, help="distillation.distillation_loss.loss_mode (default: the recipe's)")
    p.add_argument(
        "--distill-lr", type=float, default=None, help="the distillation runs' actor lr (default: the recipe's)"
    )
    p.add_argument("--distill-warmup", type=int, default=None, help="the distillation runs' linear lr warm-up steps")
    p.add_argument(
        "--distill-scheduler",
        default=None,
        choices=["constant", "cosine"],
        help="the distillation runs' lr schedule after warm-up (cosine: down to min_lr_ratio over the run)",
    )
    p.add_argument(
        "--distill-min-lr-ratio",
        type=float,
        default=None,
        help="the distillation runs' cosine floor (a fraction of lr)",
    )
    p.add_argument("--margin", type=float, default=0.05, help="within this much of the teacher's accuracy")
    p.add_argument(
        "--levels", type=float, nargs="*", default=[0.55, 0.6, 0.65], help="also print the steps to these accuracies"
    )
    p.add_argument("--test-freq", type=int, default=10, help="validate every N steps (both curves)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parallel", type=int, default=2, help="runs at a time")
    p.add_argument("--out", type=Path, default=Path("runs/bench_distillation"))
    p.add_argument("--reuse", action="store_true", help="keep finished runs found under --out")
    p.add_argument("--set", nargs="*", default=[], help="overrides for every run")
    p.add_argument("--distill-set", nargs="*", default=[], help="overrides for the distillation runs only")
    p.add_argument("--tag", default="", help="name the distillation runs distill_TAG_seedN (one directory per variant)")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    distill_steps = args.distill_steps or max(1, args.grpo_steps // 2)

    grpo_steps = [f"trainer.total_training_steps={args.grpo_steps}", "trainer.save_freq=0"]
    # The teacher's run first and alone: it builds the warm start into the shared cache for every other run.
    teacher_seed, *others = args.seeds
    grpo = {teacher_seed: train(args.out / f"grpo_seed{teacher_seed}", teacher_seed, grpo_steps, args)}
    teacher = export_teacher(grpo[teacher_seed]["run_dir"], args.out / "teacher")
    teacher_acc = grpo[teacher_seed]["curve"][-1][1]
    target = teacher_acc - args.margin

    chosen = {
        "distillation.distillation_loss.loss_mode": args.loss_mode,
        "actor_rollout_ref.actor.optim.lr": args.distill_lr,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": args.distill_warmup,
        "actor_rollout_ref.actor.optim.lr_scheduler": args.distill_scheduler,
        "actor_rollout_ref.actor.optim.min_lr_ratio": args.distill_min_lr_ratio,
    }
    distill = [
        f"trainer.total_training_steps={distill_steps}",
        "trainer.save_freq=0",
        "distillation.enabled=true",
        f"distillation.teacher_models.teacher.model_path={teacher}",
        "distillation.distillation_loss.use_task_rewards=false",
        *(f"{key}={value}" for key, value in chosen.items() if value is not None),
        *args.distill_set,
    ]
    recipe = load_recipe(args.distill_config, distill + list(args.set))
    d_dir = f"distill_{args.tag}" if args.tag else "distill"
    jobs = [("grpo", s, grpo_steps, DEFAULT_RUN) for s in others]
    jobs += [("distill", s, distill, args.distill_config) for s in args.seeds]
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = {
            (kind, s): pool.submit(train, args.out / f"{d_dir if kind == 'distill' else kind}_seed{s}", s, o, args, cfg)
            for kind, s, o, cfg in jobs
        }
        results = {key: f.result() for key, f in futures.items()}
    for s in others:
        grpo[s] = results[("grpo", s)]

    print(f"teacher: GRPO seed {teacher_seed} after {args.grpo_steps} steps, held-out accuracy {teacher_acc:.3f}")
    print(f"target: {target:.3f} (within {args.margin} of the teacher); validated every {args.test_freq} steps")
    changed = [f"{key}={value}" for key, value in chosen.items() if value is not None] + list(args.distill_set)
    print(f"distillation: {args.distill_config.name} + {' '.join(changed) or 'nothing'}: {recipe}")
    print(
        "| seed | GRPO steps to target | distillation steps to target | distill final acc | distill KL first -> last "
        "| CPU s/step GRPO, distillation |"
    )
    print("|---|---|---|---|---|---|")
    g_steps, d_steps = [], []
    for s in args.seeds:
        g = first_reaching(grpo[s]["curve"], target)
        d_run = results[("distill", s)]
        d = first_reaching(d_run["curve"], target)
        kl = distill_kl(d_run["run_dir"])
        g_text = str(g) if g is not None else f">{args.grpo_steps}"
        d_text = str(d) if d is not None else f">{distill_steps}"
        kl_text = f"{kl[0][1]:.4f} -> {kl[-1][1]:.4f}" if kl else "n/a"
        cpu = [median_step_cpu_s(run["run_dir"]) for run in (grpo[s], d_run)]
        cpu_text = ", ".join("n/a" if c is None else f"{c:.3f}" for c in cpu)
        print(f"| {s} | {g_text} | {d_text} | {d_run['curve'][-1][1]:.3f} | {kl_text} | {cpu_text} |")
        # A curve that never reached the target counts at its length: the mean is then a lower bound.
        g_steps.append(g if g is not None else args.grpo_steps)
        d_steps.append(d if d is not None else distill_steps)
    g_missed = sum(first_reaching(grpo[s]["curve"], target) is None for s in args.seeds)
    d_missed = sum(first_reaching(results[("distill", s)]["curve"], target) is None for s in args.seeds)
    g_mean, d_mean = _mean(g_steps), _mean(d_steps)
    print(
        f"mean steps to target: GRPO {g_mean:.1f} ({len(args.seeds) - g_missed}/{len(args.seeds)} seeds reached it), "
        f"distillation {d_mean:.1f} ({len(args.seeds) - d_missed}/{len(args.seeds)})"
    )
    ratio = d_mean / g_mean if g_mean > 0 else float("nan")
    if d_missed:
        print(
            f"ratio distillation / GRPO: at least {ratio:.3f} ({d_missed} distillation seed(s) did not reach the "
            f"target within {distill_steps} steps and count as {distill_steps})"
        )
    else:
        print(f"ratio distillation / GRPO: {ratio:.3f}" + (" (a GRPO seed counted at its length)" if g_missed else ""))
    for level in args.levels:
        g = [first_reaching(grpo[s]["curve"], level) for s in args.seeds]
        d = [first_reaching(results[("distill", s)]["curve"], level) for s in args.seeds]
        if None in g or None in d:
            print(f"to accuracy {level}: GRPO {g}, distillation {d} (None: not reached)")
            continue
        print(f"to accuracy {level}: GRPO {g}, distillation {d}, ratio of the means {_mean(d) / _mean(g):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
