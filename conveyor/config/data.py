"""The `data` section: where prompts come from and how they are shaped.

It deliberately reads no files: the dataset code (`conveyor.tasks`) does, and
names its truncation modes and synthetic tasks, which are read from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config.fields import F, S, check, registry

__all__ = ["SyntheticTaskConfig", "DataConfig"]


@dataclass
class SyntheticTaskConfig:
    """The built-in arithmetic task used when no data files are given."""

    num_train: int = F(8000, "number of training problems generated (at most the train split holds)", gt=0)
    num_val: int = F(128, "number of held-out problems (never in the training set)", gt=0)
    max_operand: int = F(99, "largest operand", ge=1)
    ops: list = F(["+"], "operators to draw from: any of +, -, *")
    task: str = F(
        "arithmetic",
        "arithmetic, arithmetic_tool (n-digit operands, a calculator to call; see docs/agent.md), code, or "
        "visual_sum (two numbers drawn into an image) or visual_count (discs to count): a vision-language policy, "
        "docs/vlm.md",
        choices=registry("conveyor.tasks", "SYNTHETIC_TASKS"),
    )

    def validate(self, prefix: str) -> None:
        """The operators are a non-empty list of +, -, *."""
        bad = [o for o in self.ops if o not in ("+", "-", "*")]
        check(not bad and bool(self.ops), f"{prefix}.ops", f"must be a non-empty list of +, -, *; got {self.ops}")


@dataclass
class DataConfig:
    """Where prompts come from and how they are shaped."""

    train_files: list | None = F(None, "verl-style parquet files of training prompts; null = the synthetic task")
    val_files: list | None = F(
        None, "parquet files of held-out prompts; null = the synthetic task's test split", resume_neutral=True
    )
    train_batch_size: int = F(32, "prompts per step (each sampled actor_rollout_ref.rollout.n times)", gt=0)
    val_batch_size: int | None = F(None, "held-out prompts used per validation; null = all", gt=0, resume_neutral=True)
    max_prompt_length: int = F(64, "longest prompt in tokens", gt=0)
    max_response_length: int = F(6, "most tokens generated per response", gt=0)
    truncation: str = F(
        "error",
        "what to do with a prompt longer than max_prompt_length (error, or cut at the left or right)",
        choices=registry("conveyor.tasks.dataset", "TRUNCATION_MODES"),
    )
    shuffle: bool = F(True, "shuffle training prompts each epoch")
    seed: int = F(1, "seed of the prompt order and of the synthetic task")
    synthetic: SyntheticTaskConfig = S(SyntheticTaskConfig, "the built-in task")

    def validate(self, prefix: str) -> None:
        """Data files, when given, are a non-empty list of paths."""
        for key in ("train_files", "val_files"):
            files = getattr(self, key)
            if files is None:
                continue
            check(
                bool(files), f"{prefix}.{key}", "is an empty list; give parquet files, or null for the synthetic task"
            )
            bad = [f for f in files if not isinstance(f, str) or not f.strip()]
            check(
                not bad,
                f"{prefix}.{key}",
                f"{bad[0] if bad else ''!r} is not a file path; give a list of parquet file paths",
            )
