"""Run every benchmark script in turn, each in its own subprocess, and fail if any of them failed.

The scripts, with the arguments used here (`make bench` runs this file):

- `e2e_vs_trl.py`: conveyor vs TRL's GRPOTrainer end to end (default size);
- `data_plane.py --backends memory ray transferqueue --threads 1 --create-reps 3`: every
  data-plane backend (one whose adapter or package is missing is skipped
  with a note by the script itself);
- `served_plane.py`: what one asynchronous batch's data-plane requests cost the trainer's process
  when the rollout runs in a process of its own;
- `rollout_call.py`: one batch's call to such a replica, a Ray task against the replica's link;
- `moe_metrics.py --threads 1`: the MoE load-balance metrics; `moe_metrics.py --overhead`: what the
  router-health metrics add to the default run's step;
- `router.py --threads 1`: does the rollout's router near-tie share predict the trainer's flips (bf16 vs float32);
- `token_balance.py`: the ranks' token balance and the token-budget micro-batches (synthetic lengths);
- `rewards.py`: sandboxed code execution at `max_concurrent` 1, 2 and 4 against one `subprocess.run` per sample;
- `rollout.py --threads 1`: the rollout engine against `model.generate`;
- `gateway.py`: the agent gateway against the built-in tool loop at 1, 8 and 64 sessions (same tokens);
- `lean_forward.py --threads 1`: the lean forward against the Hugging Face
  forward, in training and in the rollout;
- `sharding.py`: per-rank bytes of FSDP2 against DDP replicas on two gloo ranks;
- `weight_sync.py`: the streamed weight sync against a plain broadcast of the same bytes (2 gloo processes);
- `weight_sync.py --delta`: delta syncs' changed fraction and bytes over 10 AdamW steps at lr 1e-6, 1e-5, 6e-4 (507M);
- `in_flight.py`: what a weight load in the middle of a generation costs, keeping or recomputing the KV (hf, vllm);
- `vllm_loop.py`: vLLM driven one engine step at a time (every generation) against its own `LLM.generate`;
- `mismatch.py`: the rollout-vs-trainer log-prob gap and IS ratios over {replay} x {bf16, fp32 head} x {top_p}, and
  exact mode's cost;
- `vlm.py`: a GRPO step of the tiny VLM on the visual task against the tiny text model;
- `vlm_task.py`: the tiny VLM learning to count from random weights, 3 seeds: held-out accuracy and CPU time;
- `loading.py`: rank 1's loading peak under fsdp2 against the model's bytes;
- `memory.py`: each phase's peak memory per rank on 1 and 2 fsdp2 ranks (340M MoE);
- `default_run.py`: the default run over 6 seed pairs, one at a time, each from an
  empty model cache: final held-out accuracy and wall time, min / median / max;
- `algorithms.py --parallel 1`: the default run with GRPO, DAPO, Dr. GRPO, GSPO,
  RLOO and REINFORCE++, 4 seeds each: final held-out accuracy and time per run;
- `distillation.py --parallel 1`: on-policy distillation against GRPO, 3 seeds: steps to the teacher's accuracy.

Each script's output is printed as it runs, under a header; a summary line per
script follows at the end. The exit status is 0 only when every script exited
0. Extra arguments are not passed on: run a script directly to change its size.

This file does not install anything (`make bench` installs the peers first:
benchmarks/requirements.txt, and verl from benchmarks/requirements-no-deps.txt).

    python benchmarks/run_all.py
    python benchmarks/run_all.py --only data_plane moe_metrics
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: (name, arguments) of every benchmark, in the order they run.
BENCHMARKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("e2e_vs_trl", ()),
    ("data_plane", ("--backends", "memory", "ray", "transferqueue", "--threads", "1", "--create-reps", "3")),
    ("served_plane", ()),
    ("rollout_call", ()),
    ("moe_metrics", ("--threads", "1")),
    ("moe_metrics", ("--overhead",)),
    ("router", ("--threads", "1")),
    ("token_balance", ()),
    ("rewards", ()),
    ("rollout", ("--threads", "1")),
    ("gateway", ()),
    ("lean_forward", ("--threads", "1")),
    ("sharding", ()),
    ("weight_sync", ()),
    ("weight_sync", ("--delta",)),
    ("in_flight", ()),
    ("vllm_loop", ()),
    ("mismatch", ()),
    ("vlm", ()),
    ("vlm_task", ()),
    ("loading", ()),
    ("memory", ()),
    ("default_run", ()),
    ("algorithms", ("--parallel", "1")),
    ("distillation", ("--parallel", "1")),
)


def run_one(name: str, args: Sequence[str]) -> tuple[int, float]:
    """Run benchmarks/<name>.py with `args` in a subprocess, its output going straight to ours; (exit status,
    seconds)."""
    cmd = [sys.executable, str(HERE / f"{name}.py"), *args]
    print(f"\n===== {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    status = subprocess.run(cmd, cwd=HERE.parent).returncode
    return status, time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen benchmarks (all by default); the number of failed ones is printed, 1 is returned if any failed."""
    names = [name for name, _ in BENCHMARKS]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=names, metavar="NAME", help=f"run only these of {names}")
    args = parser.parse_args(argv)
    chosen = [(n, a) for n, a in BENCHMARKS if args.only is None or n in args.only]
    results = []
    for name, bench_args in chosen:
        status, seconds = run_one(name, bench_args)
        results.append((name, status, seconds))
    print("\n===== summary")
    for name, status, seconds in results:
        print(f"{name:12s} {'ok' if status == 0 else f'FAILED (exit status {status})':28s} {seconds:7.1f} s")
    failed = [name for name, status, _ in results if status != 0]
    print(
        f"{len(results) - len(failed)} of {len(results)} benchmarks succeeded"
        + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
