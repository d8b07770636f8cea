"""What images cost: a GRPO run of the tiny VLM on the visual task against the tiny text model on arithmetic.

Both runs go through `run_training` in this process with the same batch (`--prompts` x `--n` samples), the same
response length and the same text-model width (hidden 64, 2 layers, 4 heads), the old-log-prob forward on:

- vlm: a tiny Qwen2.5-VL (`conveyor build-vlm`) on `data.synthetic.task=visual_sum`, each prompt an image of 4
  merged patches (16 patches through the vision tower) and `=`;
- text: the tiny dense Qwen3 on the arithmetic task (no warm start, the Hugging Face forward as the VLM's), prompts
  of 4 tokens against the VLM's 7 (tokens/s compares them per token).

Prints, per run, the median over the steps after the first of: step seconds, samples/s, tokens/s
(`perf/throughput`), the seconds of generation, old log-probs and update, and the actor's peak resident memory
(`actor/perf/cpu_memory_used_gb`); then the ratios vlm / text. It measures; it sets no bar.

    python benchmarks/vlm.py                    # 6 steps of 8 x 4 samples each (about a minute on 2 cores)
    python benchmarks/vlm.py --smoke            # 2 steps of 2 x 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.models.tiny_vlm import save_tiny_vlm
from conveyor.trainer.run import run_training

KEYS = {
    "step_s": "timing_s/step",
    "gen_s": "timing_s/gen",
    "old_lp_s": "timing_s/old_log_prob",
    "update_s": "timing_s/update_actor",
    "tokens_per_s": "perf/throughput",
    "rss_gb": "actor/perf/cpu_memory_used_gb",
}


def _common(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The overrides both runs share."""
    return [
        f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        "data.max_prompt_length=16",
        "data.max_response_length=4",
        "data.synthetic.max_operand=9",
        "data.synthetic.num_train=64",
        "data.synthetic.num_val=8",
        f"trainer.total_training_steps={args.steps}",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.val_before_train=false",
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=false",
        "trainer.dump_freq=0",
        "algorithm.rollout_correction.bypass_mode=false",
        f"trainer.default_local_dir={run_dir}",
    ]


def measure(overrides: list[str], run_dir: Path, samples: int) -> dict[str, float]:
    """Run the training and return the medians of its steps after the first (the first pays warm-up)."""
    run_training(load_config(None, overrides))
    rows = [r for r in read_metrics_jsonl(run_dir / "metrics.jsonl") if r.get("step", 0) >= 1]
    rows = rows[1:] or rows
    out = {name: statistics.median(r[key] for r in rows if key in r) for name, key in KEYS.items()}
    out["samples_per_s"] = samples / out["step_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run both trainings, print the table."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--smoke", action="store_true", help="2 steps of 2 x 2 samples")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.steps = 2, 2, 2
    samples = args.prompts * args.n
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = save_tiny_vlm("qwen2_5_vl", root / "vlm_model")
        vlm = measure(
            [*_common(args, root / "vlm"), f"actor_rollout_ref.model.path={model}", "data.synthetic.task=visual_sum"],
            root / "vlm",
            samples,
        )
        text = measure(
            [
                *_common(args, root / "text"),
                "actor_rollout_ref.model.tiny.arch=qwen3",
                "actor_rollout_ref.model.tiny.warmstart_steps=0",
                "actor_rollout_ref.model.forward_impl=hf",  # the forward the VLM runs: no lean shortcut
            ],
            root / "text",
            samples,
        )
    names = ["step_s", "samples_per_s", "tokens_per_s", "gen_s", "old_lp_s", "update_s", "rss_gb"]
    print(f"{'':8}" + "".join(f"{n:>14}" for n in names))
    for label, row in (("vlm", vlm), ("text", text)):
        print(f"{label:8}" + "".join(f"{row[n]:>14.3f}" for n in names))
    print(f"{'vlm/text':8}" + "".join(f"{vlm[n] / text[n]:>14.2f}" if text[n] else f"{'-':>14}" for n in names))


if __name__ == "__main__":
    main()
