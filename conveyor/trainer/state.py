"""What a checkpoint of a training run holds, when one is due, and putting a run back into that state.

`Checkpoints` saves the roles' shards (through the workers), the model's
config and tokenizer (so `conveyor export` needs nothing else), and the
trainer state: the config, the step, and every part registered with it. A
stateful trainer-side part (the sample source's prompt order, the KL
controller, the MoE load and router-margin accumulators, the validation
history; the process's RNG states are registered by `Checkpoints` itself)
registers a name and how its state is read and put back
(`register(name, owner)` for an object with `state_dict`/`load_state_dict`),
and is then saved under that name and restored on resume with nothing else
to edit (a part whose state is large, such as an asynchronous run's batches
in flight, names a `file` of its own in the checkpoint directory instead);
tests/trainer/test_trainer_state.py walks the trainer's objects and fails on
one that holds run state without being registered. The step is
passed in and handed back, so nothing is read off the trainer: `save(step)`
writes a checkpoint, `resume()` loads the one `trainer.resume_mode` points at
(if any) back into the same parts and returns its step, and `due(step,
last=...)` says whether the loop saves after a step.

What it deliberately does not do: lay out files or keep the newest N
(`trainer/checkpoint.py` does), or check a resumed config against the saved
one (`run_dir.check_resume`, before anything is built).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from conveyor.config import config_to_dict
from conveyor.trainer import checkpoint as ckpt

if TYPE_CHECKING:
    from conveyor.config import Config
    from conveyor.workers.placement.roles import WorkerGroups

logger = logging.getLogger(__name__)

__all__ = ["Checkpoints", "StatePart", "trainer_state", "save_checkpoint", "maybe_resume"]

T = TypeVar("T")

# The entries of trainer_state.pt that are not a registered part's.
_RESERVED = ("global_step", "config", "roles", ckpt.FILES)

# What a damaged or foreign entry raises when it is read back (conveyor writes every entry it reads).
_UNUSABLE = (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError)


@dataclasses.dataclass(frozen=True)
class StatePart:
    """One registered part of the trainer state: saved under `name` in trainer_state.pt, put back by `load`."""

    name: str
    owner: Any  # the object whose state it is (None: the process's, as for the RNG states)
    save: Callable[[], Any]  # tensors and plain values only: checkpoints are read without unpickling
    load: Callable[[Any], None]
    # The state from a checkpoint written before the part had its entry (None: the entry is required).
    older: Callable[[Mapping[str, Any]], Any] | None = None
    # A file of its own in the checkpoint directory for the state (None: an entry of trainer_state.pt); a state of
    # None writes no file.
    file: str | None = None


@dataclasses.dataclass
class Checkpoints:
    """The parts of a run a checkpoint saves and restores, where checkpoints go, and when one is due."""

    cfg: Config
    ckpt_root: Path
    workers: WorkerGroups
    model_config: Any = None  # written beside the shards with the tokenizer, for `conveyor export`
    tokenizer: Any = None
    parts: dict[str, StatePart] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # First, so that a resume restores the RNG states before any other part or worker loads, as it always has.
        if "rng" not in self.parts:  # a copy made by dataclasses.replace keeps the parts it was given
            self.register("rng", None, save=ckpt.rng_state, load=ckpt.set_rng_state)

    def register(
        self,
        name: str,
        owner: T,
        *,
        save: Callable[[], Any] | None = None,
        load: Callable[[Any], None] | None = None,
        older: Callable[[Mapping[str, Any]], Any] | None = None,
        file: str | None = None,
    ) -> T:
        """Save `owner`'s state under `name` in every checkpoint and put it back on resume; returns `owner`.

        `save`/`load` default to `owner.state_dict`/`owner.load_state_dict`; `older(trainer_state)` gives the
        state to load from a checkpoint written before this entry existed (without it, such a checkpoint is refused);
        `file` keeps the state in a file of that name in the checkpoint directory rather than in trainer_state.pt.
        """
        assert name not in self.parts and name not in _RESERVED, f"trainer state entry {name!r} registered twice"
        self.parts[name] = StatePart(
            name,
            owner,
            save=save if save is not None else owner.state_dict,
            load=load if load is not None else owner.load_state_dict,
            older=older,
            file=file,
        )
        return owner

    def due(self, step: int, *, last: bool = False) -> bool:
        """Whether the loop saves after `step`: every `trainer.save_freq` steps, and after the `last` one."""
        freq = self.cfg.trainer.save_freq
        return bool(freq and step % freq == 0) or last

    def save(self, step: int) -> Path:
        """Write every role's shards, the model's config and tokenizer, and every registered part's state at `step`."""
        return save_checkpoint(self, step)

    def resume(self) -> int | None:
        """Load the checkpoint `trainer.resume_mode` selects into the parts; its step (None: nothing to resume)."""
        return maybe_resume(self)


def trainer_state(
    checkpoints: Checkpoints, step: int, roles: dict[str, Any], tmp: Path | None = None
) -> dict[str, Any]:
    """The trainer's own state at `step` (`roles`: what each role's `save_checkpoint` returned); the parts with a
    file of their own write it into the checkpoint directory `tmp` (without one, their state is the entry)."""
    state: dict[str, Any] = {
        "global_step": step,
        "config": config_to_dict(checkpoints.cfg),  # what a resume is checked against
        "roles": roles,
    }
    files: dict[str, str] = {}
    for name, part in checkpoints.parts.items():
        value = part.save()
        if part.file is None or tmp is None:
            state[name] = value
            continue
        # The entry says the part was saved; the file list, which file holds it (none: its state was None).
        state[name] = None
        if value is not None:
            ckpt.write_part_file(tmp / part.file, value)
            files[name] = part.file
    state[ckpt.FILES] = files
    return state


def _copy_image_processor(checkpoints: Checkpoints, hf: Path) -> None:
    """A vision-language policy's image processor beside its config: an exported checkpoint reads images as trained."""
    if getattr(checkpoints.model_config, "vision_config", None) is None:
        return
    import shutil

    source = Path(checkpoints.cfg.actor_rollout_ref.model.path or "") / "preprocessor_config.json"
    if source.is_file():
        shutil.copy(source, hf / source.name)


def save_checkpoint(checkpoints: Checkpoints, step: int) -> Path:
    """Write every role's shards, the model's config and tokenizer, and every registered part's state at `step`."""

    def write(tmp: Path) -> dict[str, Any]:
        roles = {"actor": checkpoints.workers.actor.save_checkpoint(str(tmp / "actor"))}
        if checkpoints.workers.critic is not None:
            roles["critic"] = checkpoints.workers.critic.save_checkpoint(str(tmp / "critic"))
        if checkpoints.model_config is not None:
            # What `conveyor export` needs besides the weights: a checkpoint is self-contained.
            checkpoints.model_config.save_pretrained(tmp / "hf")
            checkpoints.tokenizer.save_pretrained(tmp / "hf")
            _copy_image_processor(checkpoints, tmp / "hf")
        return trainer_state(checkpoints, step, roles, tmp)

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
    files = parts.get("files", {})
    file = path / "trainer_state.pt"
    try:
        step, roles = int(st["global_step"]), dict(st.get("roles", {}))
    except _UNUSABLE as err:
        raise _unusable(file, err) from err
    # Every part is restored before any worker loads: only an edited or foreign file lacks an entry or holds the
    # wrong kind of value (conveyor writes them all), and that must not surface steps later or half-way.
    for name, part in checkpoints.parts.items():
        where = path / files[name][0] if name in files else file
        try:
            if name in files:
                part.load(files[name][1])
            else:
                part.load(st[name] if name in st or part.older is None else part.older(st))
        except KeyError as err:
            raise _unusable(where, err) from err
        except ValueError as err:
            # The part's own words say what differs (another prompt data set or seed, say).
            raise ValueError(f"checkpoint file {where}, entry {name!r}: {err}") from err
        except _UNUSABLE as err:
            raise _unusable(where, err) from err
    checkpoints.workers.actor.load_checkpoint(str(parts["actor"]), roles.get("actor", {}))
    if checkpoints.workers.critic is not None:
        if "critic" not in parts:
            raise ValueError(f"checkpoint {path} has no critic state but this run uses a critic")
        checkpoints.workers.critic.load_checkpoint(str(parts["critic"]), roles.get("critic", {}))
    logger.info("resumed from %s (step %d)", path, step)
    return step


def _unusable(file: Path, err: Exception) -> ValueError:
    """The error of an entry of `file` missing (a KeyError) or holding a value no part can use."""
    what = f"lacks the entry {err}" if isinstance(err, KeyError) else f"holds an unusable entry ({err})"
    return ValueError(
        f"checkpoint file {file} {what}; it was edited or not written by conveyor: resume from another checkpoint "
        "(trainer.resume_mode=resume_path)"
    )
