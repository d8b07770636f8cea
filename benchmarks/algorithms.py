"""The default task trained with the algorithms users pick by name, several seeds each: held-out accuracy and time.

Each (algorithm, seed) is one run of `benchmarks/default_run.py`'s kind: the
default run (`conveyor train --config examples/tiny_cpu.yaml`: the built-in
arithmetic task and tiny MoE model) in its own process, from an empty model
cache so its time includes the warm start, with `--threads` torch threads,
changing only the keys that make the algorithm (verl's names, as its recipes
set them) and `trainer.seed`; every run has the same steps, batch, learning
rate and model. The table gives the final held-out exact-match accuracy over
the seeds (mean, standard deviation, min..max), the mean wall and CPU time of
a run (with one thread, the CPU time is about the wall time on an idle
machine, whatever else runs), and, for DAPO, the generation batches a step
took.

    python benchmarks/algorithms.py                          # 12 algorithms x 4 seeds, 2 runs at a time
    python benchmarks/algorithms.py --algorithms GRPO DAPO --seeds 0 1 --steps 50
    python benchmarks/algorithms.py --set data.train_batch_size=16   # any override, for every run

Runs in parallel share the machine: `--parallel` times `--threads` should not
exceed its cores, or the wall times measure the contention.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_run import run_pair  # noqa: E402  (a sibling script: one way to run and time a default run)

#: The keys that make each algorithm, on top of the default run (GRPO).
ALGORITHMS: dict[str, list[str]] = {
    "GRPO": [],
    "DAPO": [
        "algorithm.filter_groups.enable=true",
        "reward_model.overlong_buffer.enable=true",
        "actor_rollout_ref.actor.clip_ratio_low=0.2",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    ],
    "Dr. GRPO": [
        "algorithm.norm_adv_by_std_in_grpo=false",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
    ],
    "GSPO": [
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.actor.clip_ratio_low=0.0003",
        "actor_rollout_ref.actor.clip_ratio_high=0.0004",
    ],
    "RLOO": ["algorithm.adv_estimator=rloo"],
    "REINFORCE++": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "GDPO": ["algorithm.adv_estimator=gdpo"],
    "OTB": ["algorithm.adv_estimator=optimal_token_baseline"],
    "TIR-OTB": ["algorithm.adv_estimator=tir_optimal_token_baseline"],
    # verl's DPPO recipe: divergence thresholds 0.15 (TV) and 0.05 (binary KL), the ratio truncation off.
    "DPPO-TV": [
        "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv",
        "actor_rollout_ref.actor.clip_ratio_low=0.15",
        "actor_rollout_ref.actor.clip_ratio_high=0.15",
        "actor_rollout_ref.actor.clip_ratio_c=10000",
    ],
    "DPPO-KL": [
        "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_kl",
        "actor_rollout_ref.actor.clip_ratio_low=0.05",
        "actor_rollout_ref.actor.clip_ratio_high=0.05",
        "actor_rollout_ref.actor.clip_ratio_c=10000",
    ],
    # verl has no DRO recipe and no default beta.
    "DRO": ["actor_rollout_ref.actor.policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
}


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def run_one(name: str, seed: int, args: argparse.Namespace, root: Path) -> dict:
    """Train one (algorithm, seed) in a subprocess; its first and final held-out accuracy, wall and CPU time."""
    overrides = [
        *ALGORITHMS[name],
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=false",
        "trainer.save_freq=0",
        *args.set,
    ]
    if args.steps:
        overrides.append(f"trainer.total_training_steps={args.steps}")
    out = root / _slug(name)
    out.mkdir(parents=True, exist_ok=True)
    r = run_pair(args.model_seed, seed, out, args.threads, overrides)
    if r["status"] != 0 or r["last"] is None:
        raise RuntimeError(f"{name} seed {seed} failed ({r['status']}); its log: {r['log']}")
    run_dir = out / f"model{args.model_seed}_trainer{seed}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    gen_batches = [rec["train/num_gen_batches"] for rec in records if "train/num_gen_batches" in rec]
    return {
        "algorithm": name,
        "seed": seed,
        "first": r["first"][1],
        "final": r["last"][1],
        "steps": r["last"][0],
        "wall_s": r["wall_s"],
        "cpu_s": r["cpu_s"],
        "gen_batches": statistics.fmean(gen_batches) if gen_batches else 1.0,
    }


def summarise(results: list[dict], order: Sequence[str]) -> str:
    """A Markdown table: per algorithm, final accuracy (mean, std, min..max over seeds) and mean wall and CPU time."""
    lines = [
        "| algorithm | final held-out accuracy, mean | std | min .. max | seeds | wall time per run (s) "
        "| CPU time per run (s) | generation batches per step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in order:
        rows = [r for r in results if r["algorithm"] == name]
        if not rows:
            continue
        acc = [r["final"] for r in rows]
        std = statistics.stdev(acc) if len(acc) > 1 else 0.0
        lines.append(
            f"| {name} | {statistics.fmean(acc):.3f} | {std:.3f} | {min(acc):.3f} .. {max(acc):.3f} "
            f"| {len(rows)} | {statistics.fmean(r['wall_s'] for r in rows):.0f} "
            f"| {statistics.fmean(r['cpu_s'] for r in rows):.0f} "
            f"| {statistics.fmean(r['gen_batches'] for r in rows):.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep and print each run, then the table; 0 when every run finished."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=list(ALGORITHMS),
        choices=list(ALGORITHMS),
        metavar="NAME",
        help=f"any of: {', '.join(ALGORITHMS)} (default: all)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3], help="trainer.seed values")
    parser.add_argument("--model-seed", type=int, default=0, help="actor_rollout_ref.model.tiny.seed of every run")
    parser.add_argument(
        "--steps", type=int, default=None, help="trainer.total_training_steps (default: the default run's)"
    )
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for every run")
    parser.add_argument("--out", default=None, help="keep the run directories here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.parallel < 1 or args.threads < 1:
        parser.error("--parallel and --threads must be >= 1")

    jobs = [(name, seed) for name in args.algorithms for seed in args.seeds]
    print(
        f"{len(jobs)} runs ({len(args.algorithms)} algorithms x {len(args.seeds)} seeds), {args.parallel} at a "
        f"time, {args.threads} torch thread(s) each, on {os.cpu_count()} CPUs",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out) if args.out else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        results = []
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            futures = [pool.submit(run_one, name, seed, args, root) for name, seed in jobs]
            for fut in futures:
                r = fut.result()
                results.append(r)
                print(
                    f"{r['algorithm']:>12} seed {r['seed']}: held-out accuracy {r['first']:.3f} -> "
                    f"{r['final']:.3f} at step {r['steps']}, wall {r['wall_s']:.0f} s, CPU {r['cpu_s']:.0f} s",
                    flush=True,
                )
    print()
    print(summarise(results, args.algorithms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
