"""Validation: greedy (or `val_kwargs`) decoding of the held-out prompts, scored, and the accuracy over the run.

`Validation.run(stages, generate)` writes the held-out prompts into a partition
of their own, generates and scores them with the training stages (so a
validation sample is made exactly as a training one, with `val_kwargs`), and
returns `val/accuracy` (score >= 1), `val/reward`, `val/response_length` and,
with several data sources, `val/accuracy/<source>`. It keeps each run's
accuracy (`history`, saved in checkpoints) and `report()` prints the first
against the last when the run ends.

`due(step, last=...)` says when the loop validates: before the first update
(`trainer.val_before_train`), every `trainer.test_freq` steps and after the
last one, and never without held-out prompts.

What it deliberately does not do: log the numbers (they go out with the
step's metrics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from conveyor.trainer.stages import Generate, Stages

__all__ = ["Validation"]


class Validation:
    """The held-out prompts of a run and the accuracy each validation measured, as (step, accuracy)."""

    def __init__(self, records: list[dict], *, every: int = 0, before_train: bool = False):
        self.records = records
        self.every = every  # trainer.test_freq (0: only after the last step)
        self.before_train = before_train
        self.history: list[tuple[int, float]] = []

    def __bool__(self) -> bool:
        return bool(self.records)

    def due(self, step: int, *, last: bool = False) -> bool:
        """Whether the loop validates at `step`: 0 (before training) if asked, every `every` steps, the `last` one."""
        if not self.records:
            return False
        if step == 0:
            return self.before_train
        return bool(self.every and step % self.every == 0) or last

    def run(self, stages: Stages, generate: Generate) -> dict[str, float]:
        """Greedy decoding on the held-out prompts by `generate` (a source's, with the current weights): val/accuracy
        (score >= 1) and val/reward."""
        step = stages.global_step
        part = f"val-{step}"
        try:
            meta = stages.put_prompts(self.records, part, n=stages.cfg.actor_rollout_ref.rollout.val_kwargs.n)
            meta, _ = stages.generate(meta, seed=stages.seed("val"), validate=True, generate=generate)
            meta, _ = stages.compute_reward(meta)
            td = stages.data_plane.get(meta, ["acc", "data_source", "response_mask"])
        finally:
            stages.data_plane.kv_clear(part)
        scores = td["acc"].float()
        correct = (scores >= 1.0).float()
        out = {
            "val/accuracy": float(correct.mean()),
            "val/reward": float(scores.mean()),
            "val/response_length": float(td["response_mask"].sum(-1).float().mean()),
        }
        sources = list(td["data_source"])
        if len(set(sources)) > 1:
            for src in sorted(set(sources)):
                idx = torch.tensor([s == src for s in sources])
                out[f"val/accuracy/{src}"] = float(correct[idx].mean())
        self.history.append((step, out["val/accuracy"]))
        return out

    def report(self) -> None:
        """Print the first and the last held-out accuracy of the run (nothing with fewer than two)."""
        if len(self.history) < 2:
            return
        first_step, first = self.history[0]
        last_step, last = self.history[-1]
        ratio = f"{last / first:.1f}x" if first > 0 else "n/a (step-0 accuracy is 0)"
        msg = f"held-out exact-match accuracy: step {first_step} = {first:.3f}, step {last_step} = {last:.3f} ({ratio})"
        print(msg, flush=True)

    def state_dict(self) -> list[tuple[int, float]]:
        """What a checkpoint keeps: the history."""
        return list(self.history)

    def load_state_dict(self, history: list[Any]) -> None:
        self.history = [tuple(x) for x in history]
