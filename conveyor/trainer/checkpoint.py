"""Crash-safe sharded checkpoints: written under a temporary name and renamed into place.

A checkpoint is a directory `checkpoints/global_step_N/` holding one sharded
`torch.distributed.checkpoint` directory per trained role (`actor/`, and
`critic/` when a critic runs; every rank writes its own shards, no rank
gathers the model, see `conveyor.workers.training.shards`), `hf/` (the model's config
and tokenizer, so `conveyor export` needs nothing else), and
`trainer_state.pt` (step, config, each role's lr-schedule state, and every
trainer-side part registered with `trainer/state.py`'s `Checkpoints`: data
order, RNG states, KL controller, MoE accumulators, validation history). It
appears under its final name only once complete (one `os.rename` of the
directory, after `trainer_state.pt` is written and synced), so a kill during a
save leaves the newest good checkpoint intact; half-written `*.tmp-*`
directories are ignored and removed on the next save.

Loading never unpickles code: every part is read with `torch.load(...,
weights_only=True)`, which rebuilds only tensors and plain containers of
numbers and strings, so a crafted checkpoint cannot run anything. For that,
what is saved is kept to those types (RNG states are stored as tensors).
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conveyor.files import environment_error, full_disk_error

logger = logging.getLogger(__name__)

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "rng_state",
    "set_rng_state",
    "resume_path",
]

_NAME = re.compile(r"^global_step_(\d+)$")


def list_checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `ckpt_root`, oldest first, as (step, path)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / "trainer_state.pt").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    found = list_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def resume_path(trainer_cfg: Any, ckpt_root: Path) -> Path | None:
    """The checkpoint a run resumes from (trainer.resume_mode): the newest, the one named, or None."""
    if trainer_cfg.resume_mode == "disable":
        return None
    if trainer_cfg.resume_mode == "resume_path":
        return Path(trainer_cfg.resume_from_path)
    return latest_checkpoint(ckpt_root)


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states of this process, as tensors and plain values (loadable without pickle)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    # The current device's generator only, and only once this process uses CUDA: reading every visible GPU's
    # (get_rng_state_all) would create a CUDA context on each of them in the driver.
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np.random.set_state(
        (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # written by get_rng_state_all (older checkpoints): one per device
            cuda = cuda[torch.cuda.current_device()] if torch.cuda.is_initialized() else cuda[0]
        # Deferred by torch until this process initialises CUDA itself; then on its current device only.
        torch.cuda.set_rng_state(cuda)


def save_checkpoint(
    ckpt_root: str | Path,
    step: int,
    write: Callable[[Path], dict[str, Any]],
    max_to_keep: int | None = None,
    keep: str | Path | None = None,
) -> Path:
    """Checkpoint `step`: `write(tmp_dir)` writes the roles' shards and returns the trainer state; prune to
    `max_to_keep`.

    Pruning never removes `keep` (the checkpoint a run was explicitly resumed from: only ever read).
    """
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("global_step_*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"global_step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=root))
    try:
        state = write(tmp)
        # trainer_state.pt is written last: its presence marks a complete checkpoint.
        with open(tmp / "trainer_state.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as err:
        # DCP's CheckpointException is a BaseException: look through anything but a stop. torch's own writer
        # reports a real full disk as a RuntimeError ("unexpected pos"), so the disk is asked too, while the
        # half-written copy still fills it.
        cause = None
        if not isinstance(err, (KeyboardInterrupt, SystemExit)):
            cause = environment_error(err, any_errno=True, through_context=True) or full_disk_error(root)
        shutil.rmtree(tmp, ignore_errors=True)  # a failed save must not leave a half-written copy filling the disk
        if cause is not None:
            newest = latest_checkpoint(root)
            raise ValueError(
                f"saving checkpoint {final} failed: {cause.strerror or cause} (the half-written copy was removed; "
                f"the newest complete checkpoint is {newest or 'none'}); free space or fix the permissions of {root}, "
                "then resume"
            ) from err
        raise
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    if max_to_keep is not None:
        kept = Path(keep).resolve() if keep is not None else None
        for _, old in list_checkpoints(root)[:-max_to_keep]:
            if old.resolve() != kept:
                shutil.rmtree(old, ignore_errors=True)
                # Said every time: a checkpoint a user meant to replay or export from is gone.
                logger.info("checkpoint pruned: %s (trainer.max_ckpt_to_keep=%d keeps the newest)", old, max_to_keep)
    logger.info("checkpoint saved: %s", final)
    return final


ROLES = ("actor", "critic")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """`trainer_state` (read without unpickling code) and the shard directory of each role the checkpoint holds."""
    p = Path(path)
    state_file = p / "trainer_state.pt"
    if not state_file.is_file():
        raise ValueError(f"{p} is not a complete checkpoint (no trainer_state.pt); check trainer.resume_from_path")
    if (p / "actor.pt").is_file() and not (p / "actor").is_dir():
        raise ValueError(
            f"{p} was written by an older conveyor (one actor.pt, not sharded); it cannot be resumed "
            "by this version: start a new run (trainer.resume_mode=disable)"
        )
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # weights_only refuses anything that would run code to rebuild: say so, without the library's advice
        # to turn the check off.
        raise ValueError(
            f"checkpoint file {state_file} holds objects other than tensors and plain values, which "
            "conveyor never unpickles (it could run code); it was not written by conveyor: "
            f"{str(err).splitlines()[0]}"
        ) from err
    except (EOFError, RuntimeError, OSError) as err:
        raise ValueError(
            f"checkpoint file {state_file} is truncated or unreadable ({err}); resume from an older "
            "checkpoint with trainer.resume_mode=resume_path"
        ) from err
    if not isinstance(state, dict) or "global_step" not in state:
        raise ValueError(
            f"checkpoint file {state_file} is not a conveyor trainer state; resume from another checkpoint"
        )
    match = _NAME.match(p.name)
    if match and int(match.group(1)) != int(state["global_step"]):
        raise ValueError(
            f"checkpoint {p} is inconsistent: its directory says step {match.group(1)} but its state "
            f"says step {state['global_step']}; it was edited or mixed up, resume from another checkpoint"
        )
    out: dict[str, Any] = {"trainer_state": state}
    for role in ROLES:
        if (p / role).is_dir():
            out[role] = p / role
    return out


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
