"""Ctrl-C and SIGTERM at random moments of a run's start-up: exit status, traceback, native stack, leftovers.

Runs `conveyor train --config examples/tiny_cpu.yaml` asynchronously with the
rollout in Ray actors of its own (`rollout_process=own`: a local Ray starts,
then the replicas are built), and sends SIGINT or SIGTERM at a moment drawn
uniformly between the run's first log line and its first logged step (that
span is measured first, by one run left alone). Each try is checked for: exit
status 130 (SIGINT) / 143 (SIGTERM), no Python traceback and no native stack
(Ray's `*** SIGTERM received` dump) on stderr, and no process of the run alive
5 s after it exits.

    python benchmarks/startup_stops.py                 # 10 tries of each signal
    python benchmarks/startup_stops.py --tries 3 --seed 1

It prints one line per try and, per signal, how many tries passed.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
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
    "trainer.total_training_steps=2",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
    "trainer.progress_bar=false",
    "trainer.logger=[jsonl]",
    "trainer.v1.trainer_mode=separate_async",
    "trainer.v1.separate_async.rollout_process=own",
    "ray.num_cpus=4",
)

EXPECTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _start(run_dir: Path, err_path: Path) -> subprocess.Popen:
    with open(err_path, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "conveyor.cli", "train", *RUN, f"trainer.default_local_dir={run_dir}"],
            cwd=ROOT,
            env=_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 300) -> float:
    """Poll `cond` until true; the monotonic time it became true (an error if the run exits first)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited with {proc.returncode} before the awaited point")
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting for the run")
        time.sleep(0.005)
    return time.monotonic()


def _first_log_line(err_path: Path) -> bool:
    return " INFO " in err_path.read_text()


def start_up_span(work: Path) -> float:
    """Seconds from the first log line to the first logged step of a run left alone."""
    run_dir, err_path = work / "span", work / "span.err"
    proc = _start(run_dir, err_path)
    try:
        t0 = _wait_for(lambda: _first_log_line(err_path), proc)
        t1 = _wait_for(lambda: (run_dir / "metrics.jsonl").is_file(), proc)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return t1 - t0


def try_once(signum: int, delay: float, work: Path) -> dict:
    """One run stopped by `signum` `delay` s after its first log line; what it did."""
    tag = f"{signal.Signals(signum).name}-{time.monotonic_ns()}"
    run_dir, err_path = work / tag, work / f"{tag}.err"
    proc = _start(run_dir, err_path)
    family: list[psutil.Process] = []
    try:
        _wait_for(lambda: _first_log_line(err_path), proc)
        time.sleep(delay)
        if (run_dir / "metrics.jsonl").exists() or proc.poll() is not None:
            # Start-up was over before the moment drawn (a busy machine runs slower or faster than the span measured):
            # not a try of a stop during start-up; the caller draws again.
            proc.wait(timeout=300)
            return {"signal": signal.Signals(signum).name, "delay_s": delay, "missed": True, "ok": False}
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        proc.send_signal(signum)
        status = proc.wait(timeout=120)
        deadline = time.monotonic() + 5
        alive = family
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in family:
            try:
                p.kill()
            except psutil.Error:
                pass
    err = err_path.read_text()
    result = {
        "signal": signal.Signals(signum).name,
        "delay_s": delay,
        "status": status,
        "traceback": "Traceback" in err,
        "native_stack": "*** " in err or "logging.cc" in err,
        "left": [" ".join(p.cmdline())[:80] for p in alive if p.is_running()],
        "last_line": err.strip().splitlines()[-1] if err.strip() else "",
        "missed": False,
    }
    result["ok"] = (
        status == EXPECTED[signum] and not result["traceback"] and not result["native_stack"] and not result["left"]
    )
    return result


def main(argv: list[str] | None = None) -> int:
    """Measure the start-up span, then `--tries` stops of each signal at random moments in it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--span", type=float, default=None, help="seconds of start-up to draw from (default: measured)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="startup-stops-") as tmp:
        work = Path(tmp)
        span = args.span if args.span is not None else start_up_span(work)
        print(f"start-up span (first log line to first step): {span:.1f} s")
        passed = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            ok = 0
            done = 0
            while done < args.tries:
                r = try_once(signum, rng.uniform(0.0, span), work)
                if r["missed"]:
                    print(f"{r['signal']:7s} at {r['delay_s']:5.2f} s: start-up was already over; drawn again")
                    span = r["delay_s"]  # draw within what start-up took this time
                    continue
                done += 1
                ok += r["ok"]
                print(
                    f"{r['signal']:7s} at {r['delay_s']:5.2f} s: exit {r['status']}, traceback {r['traceback']}, "
                    f"native stack {r['native_stack']}, left {len(r['left'])}  ({r['last_line'][:60]})"
                )
            passed[signal.Signals(signum).name] = ok
        for name, ok in passed.items():
            print(f"{name}: {ok}/{args.tries} tries clean")
    return 0 if all(ok == args.tries for ok in passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
