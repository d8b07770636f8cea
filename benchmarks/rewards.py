"""Rewards that cost more than a string compare: sandboxed code execution against a bare subprocess per sample.

The workload is the code task's (`data.synthetic.task=code`): `--programs` reference solutions, each with its
test harness (four assertions), so every execution is a real program that passes its tests. Three ways to run
them, each timed over `--trials` rounds (the median round is reported):

- `subprocess.run` per sample, one after another: ``python -I -S main.py`` in a fresh temporary folder, no
  limits, no isolation (what a reward function that shells out does);
- the sandbox (`conveyor.tasks.sandbox`) with `max_concurrent` 1, 2 and 4 (`--concurrency`): a fresh folder,
  cleared environment, rlimits, namespaces where the kernel allows them, everything killed after.

Printed: executions per second of each (median round), and each one's ratio to the bare subprocess of the
same round (median, min and max over the rounds). Every result is checked
(score 1.0), so a fast wrong sandbox cannot win.

Then, in the same run, the reward model's section (`benchmarks/reward_model.py`'s `measure`): sequences/s
scored through the reward-model role against the same Hugging Face model called in a loop, and their ratio
(`--no-reward-model` leaves it out; `--smoke` runs it at a tiny size).

    python benchmarks/rewards.py
    python benchmarks/rewards.py --programs 128 --concurrency 1 2 4 8
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conveyor.tasks.code import code_program, make_code_records, parse_test_report
from conveyor.tasks.sandbox import Sandbox, SandboxLimits, SandboxPool


def _programs(n: int) -> list[dict[str, str]]:
    """`n` code-task programs that pass all their tests (the reference solutions)."""
    records = make_code_records(n, seed=0, max_operand=99, ops=["+", "-", "*"])
    return [code_program(r["extra_info"]["warmstart_target"], r["reward_model"]["ground_truth"]) for r in records]


def _passed_all(stdout: str) -> bool:
    report = parse_test_report(stdout)
    return report is not None and report[0] == report[1] > 0


def bare_subprocess(programs: list[dict[str, str]], python: str) -> float:
    """Seconds to run every program with one `subprocess.run` each, in a fresh folder, one after another."""
    start = time.perf_counter()
    for files in programs:
        work = Path(tempfile.mkdtemp(prefix="bench-bare-"))
        try:
            for name, text in files.items():
                (work / name).write_text(text)
            out = subprocess.run(
                [python, "-I", "-S", "-B", "main.py"], cwd=work, capture_output=True, text=True, timeout=60
            )
            assert out.returncode == 0 and _passed_all(out.stdout), out.stderr
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return time.perf_counter() - start


def sandboxed(programs: list[dict[str, str]], sandbox: Sandbox, max_concurrent: int) -> float:
    """Seconds to run every program in the sandbox, `max_concurrent` at once."""
    pool = SandboxPool(sandbox, max_concurrent)
    try:
        start = time.perf_counter()
        results = pool.run_all(programs)
        seconds = time.perf_counter() - start
    finally:
        pool.close()
    bad = [r for r in results if not (r.ok and _passed_all(r.stdout))]
    assert not bad, f"{len(bad)} sandboxed runs failed; first: {bad[0]}"
    return seconds


def sandbox_section(args: argparse.Namespace) -> dict[str, float]:
    """The sandbox's executions/s at each concurrency against the bare subprocess; prints the table."""
    programs = _programs(args.programs)
    sandbox = Sandbox(SandboxLimits(), isolation=args.isolation, python=args.python)
    python = sandbox.python
    rounds: dict[str, list[float]] = {"subprocess.run per sample": []}
    for c in args.concurrency:
        rounds[f"sandbox, max_concurrent={c}"] = []
    sandboxed(programs[:2], sandbox, 1)  # the namespace probe and the first interpreter start, outside the timing
    for _ in range(args.trials):
        rounds["subprocess.run per sample"].append(bare_subprocess(programs, python))
        for c in args.concurrency:
            rounds[f"sandbox, max_concurrent={c}"].append(sandboxed(programs, sandbox, c))
    rates = {name: len(programs) / statistics.median(secs) for name, secs in rounds.items()}
    bare = rounds["subprocess.run per sample"]
    # Each round's ratio against that round's bare run: the machine's load drifts between rounds, not within one.
    ratios = {name: [b / s for b, s in zip(bare, secs)] for name, secs in rounds.items()}
    print(
        f"\nsandboxed code execution: {len(programs)} code-task programs, isolation={sandbox.isolation}, "
        f"{os.cpu_count()} CPUs, {args.trials} rounds (median, and min..max of the per-round ratio)"
    )
    print(f"  {'':34s} {'exec/s':>8s} {'x bare':>8s}  {'min..max':>11s}")
    for name, rate in rates.items():
        r = ratios[name]
        print(f"  {name:34s} {rate:8.1f} {statistics.median(r):8.2f}  {min(r):5.2f}..{max(r):<5.2f}")
    figures = {f"{name} exec/s": rate for name, rate in rates.items()}
    figures.update({f"{name} / bare": statistics.median(r) for name, r in ratios.items()})
    figures["isolation=namespaces"] = float(sandbox.isolation == "namespaces")
    return figures


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Run every section in one process; return their figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=64, help="programs per round")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4], help="max_concurrent values")
    ap.add_argument("--trials", type=int, default=3, help="rounds; the median is reported")
    ap.add_argument("--isolation", default="auto", choices=["auto", "namespaces", "rlimits"])
    ap.add_argument("--python", default=None, help="interpreter for the programs (default: this one's base)")
    ap.add_argument("--no-reward-model", action="store_true", help="leave out the reward model's section")
    ap.add_argument("--smoke", action="store_true", help="the reward model's section at a tiny size, one repeat")
    args = ap.parse_args(argv)
    figures = sandbox_section(args)
    if not args.no_reward_model:
        figures.update(reward_model_section(args.smoke))
    return figures


def reward_model_section(smoke: bool) -> dict[str, float]:
    """Reward-model scoring through the role against the Hugging Face model in a loop (benchmarks/reward_model.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import reward_model

    size = dict(samples=24, hidden=64, layers=2, max_response=16, repeats=1) if smoke else {}
    result = reward_model.measure(**size)
    print()
    print(reward_model.report(result))
    return {f"reward model {k}": v for k, v in result.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
