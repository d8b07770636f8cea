"""What a checkpoint of a training run holds, when one is due, and putting a run back into that state.

`Checkpoints` names every part a checkpoint saves and restores: the roles'
shards (through the workers), the model's config and tokenizer (so
`conveyor export` needs nothing else), and the trainer state: config, the
sample source's prompt order, RNG states, the KL controller's coefficient,
the MoE load counters and the validation history. The step is passed in and
handed back, so nothing is read off the trainer: `save(step)` writes a
checkpoint, `resume()` loads the one `trainer.resume_mode` points at (if any)
back into the same parts and returns its step, and `due(step, last=...)` says
whether the loop saves after a step.

What it deliberately does not do: lay out files or keep the newest N
(`trainer/checkpoint.py` does), or check a resumed config against the saved
one (`run_dir.check_resume`, before anything is built).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.config import config_to_dict
from conveyor.trainer import checkpoint as ckpt

if TYPE_CHECKING:
    from conveyor.config import Config
    from conveyor.trainer.sources import SampleSource
    from conveyor.trainer.validation import Validation
    from conveyor.workers.placement.roles import WorkerGroups

logger = logging.getLogger(__name__)

__all__ = ["Checkpoints", "trainer_state", "save_checkpoint", "maybe_resume"]


@dataclasses.dataclass
class Checkpoints:
    """The parts of a run a checkpoint saves and restores, where checkpoints go, and when one is due."""

    cfg: Config
    ckpt_root: Path
    workers: WorkerGroups
    source: SampleSource  # its prompt order (an asynchronous one's: before the oldest batch not yet trained)
    validation: Validation  # its accuracy history
    kl_ctrl: Any  # its coefficient
    moe_acc: Any  # its load counters and retry step
    model_config: Any = None  # written beside the shards with the tokenizer, for `conveyor export`
    tokenizer: Any = None

    def due(self, step: int, *, last: bool = False) -> bool:
        """Whether the loop saves after `step`: every `trainer.save_freq` steps, and after the `last` one."""
        freq = self.cfg.trainer.save_freq
        return bool(freq and step % freq == 0) or last

    def save(self, step: int) -> Path:
        """Write every role's shards, the model's config and tokenizer, data order and RNG states of `step`."""
        return save_checkpoint(self, step)

    def resume(self) -> int | None:
        """Load the checkpoint `trainer.resume_mode` selects into the parts; its step (None: nothing to resume)."""
        return maybe_resume(self)


def trainer_state(checkpoints: Checkpoints, step: int, roles: dict[str, Any]) -> dict[str, Any]:
    """The trainer's own state at `step` (`roles`: what each role's `save_checkpoint` returned)."""
    return {
        "global_step": step,
        "config": config_to_dict(checkpoints.cfg),  # what a resume is checked against
        "roles": roles,
        # The sample source's prompt order (an asynchronous one's: before the oldest batch not yet trained).
        "dataset": checkpoints.source.state_dict()["dataset"],
        "rng": ckpt.rng_state(),
        "kl_coef": float(checkpoints.kl_ctrl.value),
        "moe_counts": checkpoints.moe_acc.counts,
        "moe_retry_step": checkpoints.moe_acc.routed_experts_retry_step,
        "val_history": checkpoints.validation.state_dict(),
    }


def save_checkpoint(checkpoints: Checkpoints, step: int) -> Path:
    """Write every role's shards, the model's config and tokenizer, data order and RNG states of `step`."""

    def write(tmp: Path) -> dict[str, Any]:
        roles = {"actor": checkpoints.workers.actor.save_checkpoint(str(tmp / "actor"))}
        if checkpoints.workers.critic is not None:
            roles["critic"] = checkpoints.workers.critic.save_checkpoint(str(tmp / "critic"))
        if checkpoints.model_config is not None:
            # What `conveyor export` needs besides the weights: a checkpoint is self-contained.
            checkpoints.model_config.save_pretrained(tmp / "hf")
            checkpoints.tokenizer.save_pretrained(tmp / "hf")
        return trainer_state(checkpoints, step, roles)

    t = checkpoints.cfg.trainer
    # The checkpoint named by resume_path is only read: rotation never takes it.
    keep = t.resume_from_path if t.resume_mode == "resume_path" else None
    return ckpt.save_checkpoint(checkpoints.ckpt_root, step, write, t.max_ckpt_to_keep, keep=keep)


def maybe_resume(checkpoints: Checkpoints) -> int | None:
    """Load the checkpoint `trainer.resume_mode` selects into `checkpoints`' parts; its step (None if none)."""
    path = ckpt.resume_path(checkpoints.cfg.trainer, checkpoints.ckpt_root)
    if path is None:
        return None
    parts = ckpt.load_checkpoint(path)
    if "actor" not in parts:
        raise ValueError(f"checkpoint {path} has no actor shards (no actor/ directory); it is incomplete")
    st = parts["trainer_state"]
    try:
        # Every entry is read (and the RNG restored) before any worker loads: only an edited or foreign file lacks
        # one or holds the wrong kind of value (conveyor writes them all), and that must not surface steps later.
        step, dataset, kl_coef = int(st["global_step"]), dict(st["dataset"]), float(st["kl_coef"])
        int(dataset["epoch"]), int(dataset["position"])
        roles, retry_step = dict(st.get("roles", {})), int(st.get("moe_retry_step", 0))
        ckpt.set_rng_state(st["rng"])
        checkpoints.validation.load_state_dict(st.get("val_history", []))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError) as err:
        what = f"lacks the entry {err}" if isinstance(err, KeyError) else f"holds an unusable entry ({err})"
        raise ValueError(
            f"checkpoint file {path / 'trainer_state.pt'} {what}; it was edited or not written by "
            "conveyor: resume from another checkpoint (trainer.resume_mode=resume_path)"
        ) from err
    try:
        # Before the workers load too: its errors say what differs.
        checkpoints.source.load_state_dict({"dataset": dataset})
    except ValueError as err:
        raise ValueError(f"checkpoint file {path / 'trainer_state.pt'}: {err}") from err
    checkpoints.workers.actor.load_checkpoint(str(parts["actor"]), roles.get("actor", {}))
    if checkpoints.workers.critic is not None:
        if "critic" not in parts:
            raise ValueError(f"checkpoint {path} has no critic state but this run uses a critic")
        checkpoints.workers.critic.load_checkpoint(str(parts["critic"]), roles.get("critic", {}))
    checkpoints.kl_ctrl.value = kl_coef
    checkpoints.moe_acc.counts = st.get("moe_counts")
    checkpoints.moe_acc.routed_experts_retry_step = retry_step
    logger.info("resumed from %s (step %d)", path, step)
    return step
