"""What a checkpoint of a training run holds, and putting a trainer back into that state.

`save_checkpoint(trainer)` writes every role's shards (through the workers),
the model's config and tokenizer (so `conveyor export` needs nothing else),
and the trainer state: step, config, data order, RNG states, the KL
controller's coefficient, the MoE load counters and the validation history.
`maybe_resume(trainer)` loads the checkpoint `trainer.resume_mode` points at,
if any, back into the same places.

What it deliberately does not do: lay out files or keep the newest N
(`trainer/checkpoint.py` does), check a resumed config against the saved one
(`run_dir.check_resume`, before anything is built), or decide when to save
(the loop does).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.config import config_to_dict
from conveyor.trainer import checkpoint as ckpt

if TYPE_CHECKING:
    from conveyor.trainer.ppo import PPOTrainer

logger = logging.getLogger(__name__)

__all__ = ["trainer_state", "save_checkpoint", "maybe_resume"]


def trainer_state(trainer: PPOTrainer, roles: dict[str, Any]) -> dict[str, Any]:
    """The trainer's own state at this step (`roles`: what each role's `save_checkpoint` returned)."""
    return {
        "global_step": trainer.global_step,
        "config": config_to_dict(trainer.cfg),  # what a resume is checked against
        "roles": roles,
        # The sample source's prompt order (an asynchronous one's: before the oldest batch not yet trained).
        "dataset": trainer.source.state_dict()["dataset"],
        "rng": ckpt.rng_state(),
        "kl_coef": float(trainer.kl_ctrl.value),
        "moe_counts": trainer.moe_acc.counts,
        "moe_retry_step": trainer.moe_acc.routed_experts_retry_step,
        "val_history": trainer.validation.state_dict(),
    }


def save_checkpoint(trainer: PPOTrainer) -> Path:
    """Write every role's shards, the model's config and tokenizer, data order and RNG states of this step."""

    def write(tmp: Path) -> dict[str, Any]:
        roles = {"actor": trainer.workers.actor.save_checkpoint(str(tmp / "actor"))}
        if trainer.workers.critic is not None:
            roles["critic"] = trainer.workers.critic.save_checkpoint(str(tmp / "critic"))
        if trainer.model_config is not None:
            # What `conveyor export` needs besides the weights: a checkpoint is self-contained.
            trainer.model_config.save_pretrained(tmp / "hf")
            trainer.tokenizer.save_pretrained(tmp / "hf")
        return trainer_state(trainer, roles)

    t = trainer.cfg.trainer
    # The checkpoint named by resume_path is only read: rotation never takes it.
    keep = t.resume_from_path if t.resume_mode == "resume_path" else None
    return ckpt.save_checkpoint(trainer.ckpt_root, trainer.global_step, write, t.max_ckpt_to_keep, keep=keep)


def maybe_resume(trainer: PPOTrainer) -> None:
    """Load the checkpoint `trainer.resume_mode` selects into the workers and the trainer (nothing if none)."""
    path = ckpt.resume_path(trainer.cfg.trainer, trainer.ckpt_root)
    if path is None:
        return
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
        trainer.validation.load_state_dict(st.get("val_history", []))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError) as err:
        what = f"lacks the entry {err}" if isinstance(err, KeyError) else f"holds an unusable entry ({err})"
        raise ValueError(f"checkpoint file {path / 'trainer_state.pt'} {what}; it was edited or not written by "
                         "conveyor: resume from another checkpoint (trainer.resume_mode=resume_path)") from err
    try:
        trainer.source.load_state_dict({"dataset": dataset})  # before the workers load too: its errors say what differs
    except ValueError as err:
        raise ValueError(f"checkpoint file {path / 'trainer_state.pt'}: {err}") from err
    trainer.workers.actor.load_checkpoint(str(parts["actor"]), roles.get("actor", {}))
    if trainer.workers.critic is not None:
        if "critic" not in parts:
            raise ValueError(f"checkpoint {path} has no critic state but this run uses a critic")
        trainer.workers.critic.load_checkpoint(str(parts["critic"]), roles.get("critic", {}))
    trainer.global_step = step
    trainer.kl_ctrl.value = kl_coef
    trainer.moe_acc.counts = st.get("moe_counts")
    trainer.moe_acc.routed_experts_retry_step = retry_step
    logger.info("resumed from %s (step %d)", path, trainer.global_step)
