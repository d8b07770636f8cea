"""The default run (`make train`: `conveyor train --config examples/tiny_cpu.yaml`) over several seed pairs: does it
learn?

Each pair sets `actor_rollout_ref.model.tiny.seed` (the model's initialisation
and its warm start) and `trainer.seed` (sampling and mini-batch order); they
stand in for "another machine", whose float rounding sends a run down a
different path. Every run is a separate `conveyor train` process with its own
empty model cache, so its wall time includes building and warm-starting the
tiny model, as a first run on a fresh machine does. Nothing else is changed
from that config, except `--set` overrides given here.

Prints one line per pair (held-out exact-match accuracy at step 0 and at the
last step, warm-start steps, wall time, CPU time), then the min / median / max
of the final accuracy, the wall time and the CPU time, and how many runs
reached the bar
(`--bar`, 0.5 by default). The exit status is 1 when a run failed or missed
the bar.

`--parallel N` runs N pairs at a time, each with `--threads` torch threads
(OMP_NUM_THREADS): on a 2-core machine `--parallel 2 --threads 1` keeps both
cores busy and halves the sweep's time, at the price of each run's wall time
when anything else runs on the machine too. The load average before and after
is printed, so a shared machine shows in the output, and so is each run's CPU
time: with one thread per run it is about the wall time the run takes on an
otherwise idle machine, whatever else was running.

    python benchmarks/default_run.py                        # the 6 pairs, one at a time
    python benchmarks/default_run.py --parallel 2           # two at a time (2 cores)
    python benchmarks/default_run.py --pairs 0:0 1:1 --set trainer.total_training_steps=200
    python benchmarks/default_run.py --config examples/vllm_cpu.yaml   # the same task, vLLM generating
    python benchmarks/default_run.py --parallel 2 --results benchmarks/results/default_run.json
    python benchmarks/default_run.py --table benchmarks/results/default_run.json   # the README's table

`--results` writes the sweep (machine, commit, each run) as JSON; the README's
table of the default run is `--table` of the committed results file, and a test
fails when the two disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What `make train` runs: the defaults plus the MoE load-balance metrics.
DEFAULT_RUN = ROOT / "examples" / "tiny_cpu.yaml"

#: (tiny model seed, trainer seed) pairs run by default: 3 model seeds x 2 trainer seeds.
DEFAULT_PAIRS: tuple[tuple[int, int], ...] = ((0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1))

_WARM_START = re.compile(r"warm start: (\d+) steps")


def parse_pair(text: str) -> tuple[int, int]:
    """'MODEL_SEED:TRAINER_SEED' -> (model seed, trainer seed)."""
    try:
        model, trainer = text.split(":")
        return int(model), int(trainer)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a pair is MODEL_SEED:TRAINER_SEED, e.g. 0:1; got {text!r}") from None


def val_accuracy(run_dir: Path) -> list[tuple[int, float]]:
    """(step, val/accuracy) of every validation in `run_dir/metrics.jsonl`, by step."""
    found: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "val/accuracy" in record:
            found[int(record["step"])] = float(record["val/accuracy"])
    return sorted(found.items())


def run_pair(
    model_seed: int, trainer_seed: int, out: Path, threads: int, overrides: Sequence[str], config: Path = DEFAULT_RUN
) -> dict:
    """One `conveyor train --config config` with the pair's seeds, a fresh model cache and its own run directory."""
    name = f"model{model_seed}_trainer{trainer_seed}"
    run_dir = out / name
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CONVEYOR_CACHE": str(out / f"cache_{name}")}
    cmd = [
        sys.executable,
        "-m",
        "conveyor.cli",
        "train",
        "--config",
        str(config),
        f"trainer.default_local_dir={run_dir}",
        f"actor_rollout_ref.model.tiny.seed={model_seed}",
        f"trainer.seed={trainer_seed}",
        *overrides,
    ]
    log = out / f"{name}.log"
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        # wait4 gives this child's own CPU time, which other work on the machine does not inflate.
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    text = log.read_text()
    history = val_accuracy(run_dir)
    warm = _WARM_START.search(text)
    return {
        "model_seed": model_seed,
        "trainer_seed": trainer_seed,
        "status": proc.returncode,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "first": history[0] if history else None,
        "last": history[-1] if history else None,
        "warm_start_steps": int(warm.group(1)) if warm else None,
        "log": str(log),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def results_table(results: dict) -> str:
    """The README's Markdown table and spread line for a results file written by `--results`.

    CPU time, not wall time: with one torch thread per run it is about the wall time on an idle machine, and other
    work running beside the sweep does not inflate it.
    """
    runs = sorted(results["runs"], key=lambda r: (r["model_seed"], r["trainer_seed"]))
    last_step = max((r["last"][0] for r in runs if r["last"]), default=0)
    lines = [
        f"| model seed | trainer seed | warm start | held-out accuracy, step 0 → {last_step} | CPU |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        first = f"{r['first'][1]:.3f}" if r["first"] else "-"
        last = f"{r['last'][1]:.3f}" if r["last"] else "failed"
        lines.append(
            f"| {r['model_seed']} | {r['trainer_seed']} | {r['warm_start_steps']} steps | {first} → {last} | "
            f"{r['cpu_s']:.0f} s |"
        )
    finals = [r["last"][1] for r in runs if r["status"] == 0 and r["last"]]
    cpus = [r["cpu_s"] for r in runs if r["status"] == 0]
    lines += [
        "",
        f"{results['machine']}, commit {results['commit']}: final held-out accuracy {_spread(finals, '{:.3f}')}; "
        f"CPU time per run {_spread(cpus, '{:.0f} s')}; {sum(v >= results['bar'] for v in finals)} of {len(runs)} "
        f"runs reached {results['bar']}.",
    ]
    return "\n".join(lines)


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "n/a"
    return (
        f"min {fmt.format(min(values))}  median {fmt.format(statistics.median(values))}  max {fmt.format(max(values))}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep and print each pair and the spread; 1 when a run failed or ended below the bar."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pairs",
        nargs="+",
        type=parse_pair,
        default=list(DEFAULT_PAIRS),
        metavar="M:T",
        help="model_seed:trainer_seed pairs (default: 3 model seeds x 2 trainer seeds)",
    )
    parser.add_argument("--parallel", type=int, default=1, help="pairs run at the same time (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run, OMP_NUM_THREADS (default 1)")
    parser.add_argument("--bar", type=float, default=0.5, help="held-out accuracy each run must reach (default 0.5)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (repeatable)",
    )
    parser.add_argument("--out", help="folder for run directories, caches and logs (default: a new temporary one)")
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_RUN,
        help="the run's config (default examples/tiny_cpu.yaml; examples/vllm_cpu.yaml: the vllm rollout)",
    )
    parser.add_argument(
        "--results", type=Path, help="also write the sweep (machine, commit, every run) to this JSON file"
    )
    parser.add_argument(
        "--table",
        type=Path,
        metavar="RESULTS",
        help="print the README's table of a results file and exit (runs nothing)",
    )
    args = parser.parse_args(argv)
    if args.table is not None:
        try:
            print(results_table(json.loads(args.table.read_text())))
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.exit(2, f"default_run.py: {args.table} is not a results file written by --results ({e})\n")
        return 0
    if args.parallel < 1 or args.threads < 1:
        parser.error("--parallel and --threads must be >= 1")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="conveyor-default-run-"))
    out.mkdir(parents=True, exist_ok=True)

    print(f"machine: {_cpu_name()}, {os.cpu_count()} logical CPUs; load average before: {_load()}")
    print(
        f"runs: {len(args.pairs)} pairs, {args.parallel} at a time, OMP_NUM_THREADS={args.threads} each; "
        f"overrides: {args.overrides or 'none'}; output in {out}",
        flush=True,
    )
    start = time.perf_counter()
    results = []
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(run_pair, m, t, out, args.threads, args.overrides, args.config) for m, t in args.pairs]
        for future in futures:
            r = future.result()
            results.append(r)
            first = f"{r['first'][1]:.3f}" if r["first"] else "-"
            last = f"{r['last'][1]:.3f} at step {r['last'][0]}" if r["last"] else "-"
            failed = "" if r["status"] == 0 else f"  FAILED (exit status {r['status']}; see {r['log']})"
            print(
                f"model seed {r['model_seed']}  trainer seed {r['trainer_seed']}:  held-out accuracy "
                f"{first} -> {last}  warm start {r['warm_start_steps']} steps  wall {r['wall_s']:.0f} s  "
                f"cpu {r['cpu_s']:.0f} s{failed}",
                flush=True,
            )
    finals = [r["last"][1] for r in results if r["status"] == 0 and r["last"]]
    walls = [r["wall_s"] for r in results if r["status"] == 0]
    cpus = [r["cpu_s"] for r in results if r["status"] == 0]
    passed = sum(1 for v in finals if v >= args.bar)
    print(f"final held-out accuracy: {_spread(finals, '{:.3f}')}")
    print(f"wall time per run (s):   {_spread(walls, '{:.0f}')}")
    # With one thread per run, CPU time is about what the wall time is on an otherwise idle machine.
    print(f"CPU time per run (s):    {_spread(cpus, '{:.0f}')}")
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "machine": f"{_cpu_name()}, {os.cpu_count()} logical CPUs",
            "commit": _commit(),
            "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
            "overrides": args.overrides,
            "parallel": args.parallel,
            "threads": args.threads,
            "bar": args.bar,
            "sweep_s": round(time.perf_counter() - start, 1),
            "load_after": _load(),
            "runs": [{k: v for k, v in r.items() if k != "log"} for r in results],
        }
        args.results.write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"{passed} of {len(results)} runs reached >= {args.bar}; sweep took {time.perf_counter() - start:.0f} s; "
        f"load average after: {_load()}"
    )
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
