"""Train the same tiny MoE model with conveyor and with TRL's `GRPOTrainer`, alternating, and compare speed and
learning.

Each run is one fresh subprocess (so its peak resident memory is its own),
and the runs alternate conveyor, TRL, conveyor, TRL, ... for `--pairs`
pairs, so a noisy neighbour on the machine hurts both sides alike. Both
sides train from the same starting point on the same work:

- model: the tiny Qwen3-MoE of conveyor's default config (hidden size 64,
  2 layers, 8 experts, top-2) with the locally built character tokenizer,
  warm-started as the default run does, built once by `prepare_default_model`
  into CONVEYOR_CACHE before any run starts. conveyor loads that directory;
  TRL loads it with `AutoModelForCausalLM.from_pretrained` and the same
  tokenizer. Both train in float32 on the CPU.
- prompts: the synthetic arithmetic train split, rendered by `render_prompt`
  with the tokenizer's chat template (the bare problem text, e.g. "23+45=").
  TRL gets the records in the order conveyor's `PromptDataset` serves them
  and `shuffle_dataset=False`, so step k of both sides sees the same batch of
  prompts.
- reward: conveyor's registered reward for `synthetic/arithmetic`, called
  through `compute_score`; on the TRL side a reward function wraps it.
- batch: `--batch` prompts per step, each sampled `--n` times
  (`actor_rollout_ref.rollout.n` = TRL's `num_generations`), at most
  `--max-new-tokens` new tokens (`data.max_response_length` = TRL's
  `max_completion_length`), temperature 1, no top-k / top-p.
- update: one optimizer step per training step on both sides (conveyor:
  `ppo_mini_batch_size` = the batch, one PPO epoch, one micro-batch; TRL:
  `per_device_train_batch_size` = batch x n, no gradient accumulation,
  `steps_per_generation=1`, `num_iterations=1`), AdamW with the same
  learning rate, betas, zero weight decay and a constant schedule, gradient
  norm clipped at 1, clip range 0.2, token-mean loss (TRL `loss_type="dapo"`),
  advantages normalised by the group's standard deviation, no KL term and so
  no reference model (`beta=0`), no MoE auxiliary loss (TRL's
  `router_aux_loss_coef=0`; conveyor has none), no vLLM, and no gradient
  checkpointing (TRL turns it on by default; conveyor keeps activations).
- seed: the same seed for conveyor's `trainer.seed` and TRL's `seed` within
  a pair; pair k uses `--seed` + k - 1, so pairs are independent
  trajectories. The samples of a pair still differ: the two sides draw from
  different random streams.
- logging: conveyor writes only `metrics.jsonl`, which is read back; TRL
  reports to no tracker, and its figures are recorded by the reward function
  (reward and completion tokens of each step) and a callback (step times).

What is measured, per run:

- steps/s over the timed steps, i.e. all but the first `--warmup` steps
  (default 2; the first steps pay for lazy initialisation). A step's time is
  conveyor's `timing_s/step` (prompts to metrics: rollout, reward, old
  log-probs, advantages, update) and, for TRL, the time from the trainer's
  `on_step_begin` to `on_step_end` callbacks (generation, reward, loss,
  backward, optimizer step). Neither includes process start-up or model
  loading; conveyor's final validation and checkpoint happen outside its
  step time, and TRL does neither.
- generated tokens/s over the same steps: response tokens including EOS
  (conveyor: `rollout/generated_tokens`; TRL: the lengths of the completion
  ids its reward function receives, which also run through the EOS).
- the median step time, and CPU steps/s: timed steps per second of process
  CPU time spent inside them (`time.process_time` around conveyor's
  `PPOTrainer.step` and between TRL's step callbacks). On a machine shared
  with other work these two move much less than wall-clock steps/s, which
  counts every moment the process waited for a core.
- peak resident memory of the run's process (`ru_maxrss`).
- the reward of every step (mean over the batch x n samples).

Threads: each run uses `--threads` torch threads, 1 by default. On two cores
that other processes also use, two threads per run make step times swing by
several times (a thread waits at every parallel region for its partner to
be scheduled); one thread keeps both sides steady and equal. Pass
`--threads 2` (or 0 for torch's default) on an otherwise idle machine.

The ratio conveyor/TRL of steps/s, tokens/s, median step time and CPU
steps/s is printed for every pair, with the medians over the pairs; the
target is a median (wall-clock) steps/s ratio of at least `TARGET_RATIO`.
The reward curves of both sides (mean over the pairs) are printed as well,
with a check that conveyor's mean reward over the second half of the steps
is not below TRL's by more than two standard errors (of the runs' late
rewards when there are two or more pairs, so that seed-to-seed variation
counts), so that speed is not bought with worse learning. For a learning
comparison over more steps, run for example `--steps 200 --pairs 4`.

It needs `trl` (see benchmarks/requirements.txt); it does not install
anything. Runs write into a temporary directory that is removed afterwards.

    python benchmarks/e2e_vs_trl.py                       # 3 pairs of 20 steps
    python benchmarks/e2e_vs_trl.py --steps 2 --pairs 1 --warmup 1 \\
        --set actor_rollout_ref.model.tiny.warmstart_steps=0   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SIDES: tuple[str, ...] = ("conveyor", "trl")
TARGET_RATIO = 2.0  # median conveyor/TRL steps/s (checked and printed, not enforced)
_MIB = 2**20


# --------------------------------------------------------------------------- arguments and the shared config
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options (the same for the parent and for each run's subprocess)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--pairs", type=int, default=3, help="conveyor/TRL pairs of runs, alternating")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the timing")
    parser.add_argument(
        "--batch", type=int, default=None, help="prompts per step (default: conveyor's data.train_batch_size)"
    )
    parser.add_argument(
        "--n", type=int, default=None, help="samples per prompt (default: conveyor's actor_rollout_ref.rollout.n)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="most tokens per response (default: conveyor's data.max_response_length)",
    )
    parser.add_argument(
        "--lr", type=float, default=None, help="learning rate (default: conveyor's actor_rollout_ref.actor.optim.lr)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="sampling seed of both sides in the first pair; pair k uses seed + k - 1"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in each run (0 = torch's default; see the note on threads above)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a conveyor config override applied before the shared settings are read, e.g. "
        "actor_rollout_ref.model.tiny.warmstart_steps=0 or data.synthetic.num_train=256 "
        "(repeatable; both sides use the resulting model, prompts and settings; the settings "
        "this script fixes for a like-for-like run, listed above, take precedence)",
    )
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds before a run is killed")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("steps", "pairs"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be > 0")
    for name in ("batch", "n", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.lr is not None and not args.lr > 0:
        parser.error("--lr must be > 0")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be >= 0 and below --steps ({args.steps}) so that at least one step is timed")
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    if args.child is not None and not args.result_file:
        parser.error("--child needs --result-file")
    return args


def shared_config(args: argparse.Namespace, run_dir: str | None = None):
    """conveyor's `Config` for these options: the single source of every setting both sides share."""
    from conveyor.config import load_config

    # The warm start these figures were measured with (docs/BENCHMARKS.md): a fixed 350 steps, where
    # the default run now stops at an accuracy. --set can still change it.
    overrides = [
        "actor_rollout_ref.model.tiny.warmstart_steps=350",
        "actor_rollout_ref.model.tiny.warmstart_until_accuracy=0",
        *args.overrides,
    ]
    base = load_config(overrides=overrides)
    batch = args.batch if args.batch is not None else base.data.train_batch_size
    n = args.n if args.n is not None else base.actor_rollout_ref.rollout.n
    overrides += [
        f"data.train_batch_size={batch}",
        f"actor_rollout_ref.rollout.n={n}",
        # One optimizer step per training step, over the whole batch in one forward/backward, as TRL does below.
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch * n}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch * n}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=0",
        "actor_rollout_ref.rollout.do_sample=true",
        # TRL records no MoE routing: neither side pays for it.
        "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=0",
        "actor_rollout_ref.model.dtype=float32",
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=true",
        "algorithm.use_kl_in_reward=false",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0.0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.optim.lr_scheduler=constant",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        "transfer_queue.backend=memory",
        "trainer.device=cpu",
        "trainer.num_cpu_workers=1",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.seed={args.seed}",
        "trainer.logger=[jsonl]",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "data.val_batch_size=8",
        "trainer.save_freq=0",
        "trainer.max_ckpt_to_keep=1",
        "trainer.dump_freq=0",
        "trainer.resume_mode=disable",
        "trainer.progress_bar=false",
    ]
    if args.max_new_tokens is not None:
        overrides.append(f"data.max_response_length={args.max_new_tokens}")
    if args.lr is not None:
        overrides.append(f"actor_rollout_ref.actor.optim.lr={args.lr}")
    if run_dir is not None:
        overrides.append(f"trainer.default_local_dir={run_dir}")
    return load_config(overrides=overrides)


def ordered_prompt_records(cfg: Any, steps: int) -> list[dict]:
    """The prompt records of the first `steps` steps, in the order conveyor's trainer draws them."""
    from conveyor.tasks.dataset import PromptDataset
    from conveyor.trainer.setup import load_prompt_records

    train, _ = load_prompt_records(cfg)
    data = PromptDataset(train, seed=cfg.data.seed)
    return [rec for _ in range(steps) for rec in data.next_batch(cfg.data.train_batch_size)]


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports kilobytes


# --------------------------------------------------------------------------- one run of each side (in its subprocess)
def run_conveyor(args: argparse.Namespace, run_dir: str) -> dict[str, Any]:
    """Train with conveyor's `run_training`; per-step seconds, generated tokens and rewards from its metrics.jsonl."""
    import conveyor
    from conveyor.metrics.trackers import read_metrics_jsonl
    from conveyor.trainer.ppo import PPOTrainer
    from conveyor.trainer.run import run_training

    cfg = shared_config(args, run_dir)
    # The trainer reports each step's wall time itself; its CPU time is read around the same call here.
    cpu_s: list[float] = []
    original_step = PPOTrainer.step

    def timed_step(self: PPOTrainer) -> dict[str, float]:
        t0 = time.process_time()
        try:
            return original_step(self)
        finally:
            cpu_s.append(time.process_time() - t0)

    PPOTrainer.step = timed_step
    try:
        start = time.perf_counter()
        run_training(cfg)
        wall = time.perf_counter() - start
    finally:
        PPOTrainer.step = original_step
    rows = read_metrics_jsonl(Path(run_dir) / "metrics.jsonl")
    if not (len(rows) == len(cpu_s) == args.steps):
        raise RuntimeError(f"conveyor logged {len(rows)} steps and ran {len(cpu_s)}, expected {args.steps}")
    stages = sorted({k for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    return {
        "version": getattr(conveyor, "__version__", "dev"),
        "step_s": [float(r["timing_s/step"]) for r in rows],
        "cpu_s": cpu_s,
        "tokens": [float(r["rollout/generated_tokens"]) for r in rows],
        "reward": [float(r["reward/mean"]) for r in rows],
        "stage_s": {k.removeprefix("timing_s/"): [float(r.get(k, 0.0)) for r in rows] for k in stages},
        "train_wall_s": wall,
    }


class ScoreRecorder:
    """A TRL reward function around conveyor's `compute_score` that records each call's mean reward and tokens."""

    __name__ = "conveyor_compute_score"  # TRL names reward functions by their __name__

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.tokens: list[float] = []

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        data_source: list[str],
        ground_truth: list[str],
        **kwargs: Any,
    ) -> list[float]:
        """One score per completion (B*n,); the step's mean and token count are kept."""
        from conveyor.tasks.rewards import compute_score

        scores = [compute_score(src, text, truth) for src, text, truth in zip(data_source, completions, ground_truth)]
        self.rewards.append(sum(scores) / len(scores))
        self.tokens.append(float(sum(len(ids) for ids in completion_ids)))
        return scores


def run_trl(args: argparse.Namespace, run_dir: str) -> dict[str, Any]:
    """Train with TRL's `GRPOTrainer` on the CPU with the settings of `shared_config`; per-step figures recorded."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from conveyor.models.loading import load_tokenizer
    from conveyor.tasks.dataset import render_prompt
    from conveyor.trainer.setup import prepare_default_model

    transformers.utils.logging.disable_progress_bar()
    cfg = shared_config(args)
    arr = cfg.actor_rollout_ref
    batch, n = cfg.data.train_batch_size, arr.rollout.n
    model_path = prepare_default_model(cfg)
    tokenizer = load_tokenizer(model_path)
    records = ordered_prompt_records(cfg, args.steps)
    dataset = Dataset.from_list(
        [
            {
                "prompt": render_prompt(rec, tokenizer),
                "data_source": rec["data_source"],
                "ground_truth": str(rec["reward_model"]["ground_truth"]),
            }
            for rec in records
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optim = arr.actor.optim

    class StepTimer(TrainerCallback):
        """Wall and CPU seconds from each optimizer step's start to its end."""

        def __init__(self) -> None:
            self.durations: list[float] = []
            self.cpu: list[float] = []
            self._t0 = self._c0 = 0.0

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            self.durations.append(time.perf_counter() - self._t0)
            self.cpu.append(time.process_time() - self._c0)

    config = GRPOConfig(
        output_dir=run_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=args.seed,
        data_seed=args.seed,
        max_steps=args.steps,
        per_device_train_batch_size=batch * n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=n,
        max_completion_length=cfg.data.max_response_length,
        temperature=arr.rollout.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=optim.lr,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        weight_decay=optim.weight_decay,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=arr.actor.grad_clip,
        epsilon=arr.actor.clip_ratio,
        loss_type="dapo",  # token-mean over the whole batch, like conveyor's token-mean
        scale_rewards="group" if cfg.algorithm.norm_adv_by_std_in_grpo else "none",
        beta=0.0,
        router_aux_loss_coef=0.0,
        use_vllm=False,
        # TRL defaults to recomputing activations in the backward; conveyor keeps them, so keep them here too.
        gradient_checkpointing=False,
        shuffle_dataset=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
    )
    recorder, timer = ScoreRecorder(), StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[recorder],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    if not (len(timer.durations) == len(recorder.rewards) == args.steps):
        raise RuntimeError(
            f"TRL ran {len(timer.durations)} steps with {len(recorder.rewards)} reward calls, "
            f"expected {args.steps} of each"
        )
    return {
        "version": trl.__version__,
        "step_s": timer.durations,
        "cpu_s": timer.cpu,
        "tokens": recorder.tokens,
        "reward": recorder.rewards,
        "stage_s": {},
        "train_wall_s": wall,
    }


def child_main(args: argparse.Namespace) -> dict[str, Any]:
    """The body of one run's subprocess: train one side, add the process's figures, write them as JSON."""
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    run_dir = args.run_dir or tempfile.mkdtemp(prefix=f"e2e-{args.child}-")
    result = (run_conveyor if args.child == "conveyor" else run_trl)(args, run_dir)
    result.update(
        side=args.child, threads=torch.get_num_threads(), peak_rss_bytes=_peak_rss_bytes(), torch=torch.__version__
    )
    Path(args.result_file).write_text(json.dumps(result))
    return result


# --------------------------------------------------------------------------- the parent: alternate, summarise, print
def summarize_run(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """steps/s, generated tokens/s and mean reward of the timed steps (all but the first `warmup`) of one run."""
    step_s = result["step_s"][warmup:]
    cpu_s = result["cpu_s"][warmup:]
    tokens = result["tokens"][warmup:]
    seconds = sum(step_s)
    return {
        "timed_steps": len(step_s),
        "steps_per_s": len(step_s) / seconds,
        "tokens_per_s": sum(tokens) / seconds,
        "cpu_steps_per_s": len(cpu_s) / sum(cpu_s),
        "peak_rss_mib": result["peak_rss_bytes"] / _MIB,
        "median_step_ms": statistics.median(step_s) * 1e3,
        "mean_reward": statistics.fmean(result["reward"]),
    }


def run_side(side: str, raw_argv: Sequence[str], work_dir: Path, index: int, timeout: float) -> dict[str, Any]:
    """Run one side in a fresh subprocess of this script and return what it wrote (plus its process wall time)."""
    run_dir = work_dir / f"{index:02d}-{side}"
    result_file = work_dir / f"{index:02d}-{side}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        *raw_argv,
        "--child",
        side,
        "--result-file",
        str(result_file),
        "--run-dir",
        str(run_dir),
    ]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not result_file.is_file():
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise RuntimeError(f"the {side} run (#{index}) failed with exit status {proc.returncode}:\n{tail}")
    result = json.loads(result_file.read_text())
    result["process_wall_s"] = wall
    return result


def reward_check(
    conveyor_curves: Sequence[Sequence[float]], trl_curves: Sequence[Sequence[float]]
) -> dict[str, float | bool]:
    """Compare the second halves of each side's reward curves: conveyor passes unless it is below TRL by > 2 standard
    errors.

    A run's late reward is the mean of the second half of its curve. With two or
    more runs per side (each pair samples with its own seed), the standard error
    is that of the runs' late rewards, so seed-to-seed variation counts; with one
    run per side it is that of the per-step rewards of its second half.
    """
    half = len(conveyor_curves[0]) // 2

    def se(x: list[float]) -> float:
        return statistics.stdev(x) / math.sqrt(len(x)) if len(x) > 1 else 0.0

    if len(conveyor_curves) > 1 and len(trl_curves) > 1:
        a = [statistics.fmean(c[half:]) for c in conveyor_curves]
        b = [statistics.fmean(c[half:]) for c in trl_curves]
        basis = "runs"
    else:
        a, b = list(conveyor_curves[0][half:]), list(trl_curves[0][half:])
        basis = "steps"
    diff = statistics.fmean(a) - statistics.fmean(b)
    tolerance = 2.0 * math.hypot(se(a), se(b))
    return {
        "from_step": half + 1,
        "conveyor_late": statistics.fmean(a),
        "trl_late": statistics.fmean(b),
        "difference": diff,
        "tolerance": tolerance,
        "no_worse": diff >= -tolerance,
        "basis": basis,
    }


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    print(_row(head, widths))
    print(_row(["-" * w for w in widths], widths))
    for r in rows:
        print(_row(r, widths))


def mean_curve(curves: Sequence[Sequence[float]]) -> list[float]:
    """Step-wise mean of equally long curves."""
    return [statistics.fmean(values) for values in zip(*curves)]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the alternating pairs, print per-run figures, ratios, reward curves and the target checks; return them."""
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv)
    if args.child is not None:
        return child_main(args)

    import torch

    from conveyor.trainer.setup import prepare_default_model

    cfg = shared_config(args)
    # Built (or found) once here, so no run pays for the warm start and two runs never race to build it.
    model_path = prepare_default_model(cfg)
    arr = cfg.actor_rollout_ref
    settings = {
        "model": f"{arr.model.tiny.arch} hidden {arr.model.tiny.hidden_size}, {arr.model.tiny.num_layers} layers, "
        f"{arr.model.tiny.num_experts} experts top-{arr.model.tiny.top_k}, "
        f"warm start {arr.model.tiny.warmstart_steps} steps",
        "model_path": model_path,
        "batch": cfg.data.train_batch_size,
        "n": arr.rollout.n,
        "max_new_tokens": cfg.data.max_response_length,
        "lr": arr.actor.optim.lr,
        "steps": args.steps,
        "warmup": args.warmup,
        "pairs": args.pairs,
        "seed": args.seed,
    }
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, threads per run: "
        f"{args.threads if args.threads else 'torch default'}"
    )
    print(f"model: {settings['model']} ({model_path})")
    print(
        f"per step: {settings['batch']} prompts x {settings['n']} samples, <= {settings['max_new_tokens']} new tokens, "
        f"lr {settings['lr']:g}; {args.steps} steps per run, first {args.warmup} untimed; "
        f"{args.pairs} pair(s), alternating conveyor/TRL",
        flush=True,
    )

    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="e2e-vs-trl-") as tmp:
        index = 0
        for pair in range(args.pairs):
            # Both runs of a pair sample with the same seed; each pair has its own, so
            # the pairs are independent trajectories and the reward check sees their spread.
            pair_argv = [*raw_argv, "--seed", str(args.seed + pair)]
            for side in SIDES:
                index += 1
                result = run_side(side, pair_argv, Path(tmp), index, args.run_timeout)
                result["summary"] = summarize_run(result, args.warmup)
                runs[side].append(result)
                s = result["summary"]
                print(
                    f"pair {pair + 1} {side:8s}: {s['steps_per_s']:.3f} steps/s, {s['tokens_per_s']:.0f} tokens/s, "
                    f"peak RSS {s['peak_rss_mib']:.0f} MiB, mean reward {s['mean_reward']:.3f} "
                    f"(process {result['process_wall_s']:.1f} s)",
                    flush=True,
                )

    pairs = []
    for c, t in zip(runs["conveyor"], runs["trl"]):
        cs, ts = c["summary"], t["summary"]
        pairs.append(
            {
                "steps_ratio": cs["steps_per_s"] / ts["steps_per_s"],
                "tokens_ratio": cs["tokens_per_s"] / ts["tokens_per_s"],
                "cpu_steps_ratio": cs["cpu_steps_per_s"] / ts["cpu_steps_per_s"],
                "median_step_ratio": ts["median_step_ms"] / cs["median_step_ms"],
                "memory_ratio": cs["peak_rss_mib"] / ts["peak_rss_mib"],
            }
        )
    median_ratio = statistics.median(p["steps_ratio"] for p in pairs)
    median_tokens_ratio = statistics.median(p["tokens_ratio"] for p in pairs)
    median_cpu_ratio = statistics.median(p["cpu_steps_ratio"] for p in pairs)
    median_step_ratio = statistics.median(p["median_step_ratio"] for p in pairs)
    curves = {side: mean_curve([r["reward"] for r in runs[side]]) for side in SIDES}
    check = reward_check([r["reward"] for r in runs["conveyor"]], [r["reward"] for r in runs["trl"]])

    print()
    head = ["pair", "side", "steps/s", "gen tokens/s", "median step ms", "CPU steps/s", "peak RSS MiB", "mean reward"]
    rows = []
    for i in range(args.pairs):
        for side in SIDES:
            s = runs[side][i]["summary"]
            rows.append(
                [
                    str(i + 1),
                    side,
                    f"{s['steps_per_s']:.2f}",
                    f"{s['tokens_per_s']:.0f}",
                    f"{s['median_step_ms']:.0f}",
                    f"{s['cpu_steps_per_s']:.2f}",
                    f"{s['peak_rss_mib']:.0f}",
                    f"{s['mean_reward']:.3f}",
                ]
            )
        p = pairs[i]
        rows.append(
            [
                str(i + 1),
                "ratio c/t",
                f"{p['steps_ratio']:.2f}x",
                f"{p['tokens_ratio']:.2f}x",
                f"{p['median_step_ratio']:.2f}x",
                f"{p['cpu_steps_ratio']:.2f}x",
                f"{p['memory_ratio']:.2f}x",
                "",
            ]
        )
    _table(head, rows)
    print(
        f"median over pairs of the ratio conveyor/TRL: steps/s {median_ratio:.2f}x, "
        f"generated tokens/s {median_tokens_ratio:.2f}x; less sensitive to a busy machine: "
        f"by median step {median_step_ratio:.2f}x, by CPU time {median_cpu_ratio:.2f}x"
    )

    stage_means = {}
    for run in runs["conveyor"]:
        for stage, values in run["stage_s"].items():
            stage_means.setdefault(stage, []).extend(values[args.warmup :])
    if stage_means:
        parts = sorted(((statistics.fmean(v) * 1e3, k) for k, v in stage_means.items()), reverse=True)
        print("conveyor mean ms per timed step by stage: " + ", ".join(f"{k} {ms:.0f}" for ms, k in parts if ms >= 0.5))

    print()
    print(f"reward per step (mean over {args.pairs} run(s) per side):")
    _table(
        ["step", "conveyor", "trl"],
        [[str(i + 1), f"{c:.3f}", f"{t:.3f}"] for i, (c, t) in enumerate(zip(curves["conveyor"], curves["trl"]))],
    )
    print(
        f"steps {check['from_step']}..{args.steps}: conveyor {check['conveyor_late']:.3f}, TRL {check['trl_late']:.3f} "
        f"(difference {check['difference']:+.3f}, tolerance {check['tolerance']:.3f}: two standard errors "
        f"over the {check['basis']})"
    )
    speed_ok = median_ratio >= TARGET_RATIO
    print(f"target median steps/s ratio >= {TARGET_RATIO:g}: {'met' if speed_ok else 'MISSED'} ({median_ratio:.2f}x)")
    print(f"target conveyor's reward no worse than TRL's: {'met' if check['no_worse'] else 'MISSED'}")
    return {
        "settings": settings,
        "threads": {side: runs[side][0]["threads"] for side in SIDES},
        "versions": {side: runs[side][0]["version"] for side in SIDES},
        "runs": runs,
        "pairs": pairs,
        "median_steps_ratio": median_ratio,
        "median_tokens_ratio": median_tokens_ratio,
        "median_cpu_steps_ratio": median_cpu_ratio,
        "median_step_time_ratio": median_step_ratio,
        "reward_curves": curves,
        "reward_check": check,
        "conveyor_stage_ms": {k: statistics.fmean(v) * 1e3 for k, v in stage_means.items()},
        "targets_met": speed_ok and bool(check["no_worse"]),
    }


if __name__ == "__main__":
    main()
