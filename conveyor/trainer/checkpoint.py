"""Crash-safe sharded checkpoints: written under a temporary name and renamed into place.

A checkpoint is a directory `checkpoints/global_step_N/` holding one sharded
`torch.distributed.checkpoint` directory per trained role (`actor/`, and
`critic/` when a critic runs; every rank writes its own shards, no rank
gathers the model, see `conveyor.workers.training.shards`), `hf/` (the model's config
and tokenizer, so `conveyor export` needs nothing else), and
`trainer_state.pt` (step, config, each role's lr-schedule state, and every
trainer-side part registered with `trainer/state.py`'s `Checkpoints`: data
order, RNG states, KL controller, MoE accumulators, validation history),
and a file of its own for each part registered with one (`in_flight.pt`: an
asynchronous run's batches in flight), listed in the state's `files`. It
appears under its final name only once complete (one `os.rename` of the
directory, after `trainer_state.pt` is written and synced), so a kill during a
save leaves the newest good checkpoint intact; half-written `*.tmp-*`
directories are ignored and removed on the next save.

Loading never unpickles code: every part is read with `torch.load(...,
weights_only=True)`, which rebuilds only tensors and plain containers of
numbers and strings, so a crafted checkpoint cannot run anything. For that,
what is saved is kept to those types (RNG states are stored as tensors).
A checkpoint that is chosen is checked whole before anything is built: its
trainer state must read as one, each part file it lists must read, each
role's DCP metadata must read, and every shard file must be as long as the
metadata says. Any damage (random bytes, a
cut, a foreign file) is a `ValueError` naming the file, whichever error the
readers underneath raised.
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
    "check_shards",
    "write_part_file",
    "FILES",
]

_NAME = re.compile(r"^global_step_(\d+)$")

# The entry of trainer_state.pt naming each part's own file: {part name: file name in the checkpoint directory}.
FILES = "files"


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


def write_part_file(path: Path, state: Any) -> None:
    """Write one part's state (tensors and plain values) to `path`, synced: it is complete before the checkpoint's
    directory takes its final name."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


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
    state = _read_state(state_file)
    match = _NAME.match(p.name)
    if match and int(match.group(1)) != state["global_step"]:
        raise ValueError(
            f"checkpoint {p} is inconsistent: its directory says step {match.group(1)} but its state "
            f"says step {state['global_step']}; it was edited or mixed up, resume from another checkpoint"
        )
    out: dict[str, Any] = {"trainer_state": state, "files": _read_part_files(p, state_file, state)}
    for role in ROLES:
        if (p / role).is_dir():
            if (p / role / ".metadata").is_file():  # without one, the shard loader refuses the directory itself
                check_shards(p / role)
            out[role] = p / role
    return out


def _read_part_files(p: Path, state_file: Path, state: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """The part files the trainer state lists, read: {part name: (file name, its state)}."""
    listed = state.get(FILES) or {}
    if not isinstance(listed, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v and Path(v).name == v and v != "trainer_state.pt"
        for k, v in listed.items()
    ):
        raise ValueError(
            f"checkpoint file {state_file}: its entry {FILES!r} is not a mapping of part names to file names in "
            f"{p}; it was edited or not written by conveyor: resume from another checkpoint"
        )
    out = {}
    for name, file_name in listed.items():
        path = p / file_name
        if not path.is_file():
            raise ValueError(
                f"checkpoint file {path} is missing (trainer_state.pt lists it for {name!r}); the checkpoint is "
                "incomplete: resume from another checkpoint with trainer.resume_mode=resume_path"
            )
        out[name] = (file_name, _load_plain(path))
    return out


def _load_plain(path: Path) -> Any:
    """A checkpoint file read without unpickling code; a ValueError naming the file for anything else in it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = _unpickler_reason(err)
        if "Unsupported global" in reason or (reason.startswith("Unsupported operand") and _is_pickle(path)):
            # weights_only refused something that would run code to rebuild: say so, without the library's
            # advice to turn the check off.
            raise ValueError(
                f"checkpoint file {path} holds objects other than tensors and plain values, which "
                f"conveyor never unpickles (it could run code); it was not written by conveyor: {reason}"
            ) from err
        raise _unreadable(path, reason) from err
    # Random bytes reach the unpickler's and the zip reader's every error path (IndexError, KeyError,
    # UnicodeDecodeError, MemoryError, ...): what matters is which file, not which of them.
    except Exception as err:
        raise _unreadable(path, f"{type(err).__name__}: {_first_line(err)}") from err


def _read_state(state_file: Path) -> dict[str, Any]:
    """trainer_state.pt read without unpickling code; a ValueError naming the file for anything else in it."""
    state = _load_plain(state_file)
    step = state.get("global_step") if isinstance(state, dict) else None
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(
            f"checkpoint file {state_file} is not a conveyor trainer state (no whole-number global_step); "
            "resume from another checkpoint"
        )
    for entry in ("config", "roles"):
        if state.get(entry) is not None and not isinstance(state[entry], dict):
            raise ValueError(
                f"checkpoint file {state_file}: its entry {entry!r} is a {type(state[entry]).__name__}, not a "
                "mapping; it was edited or not written by conveyor: resume from another checkpoint"
            )
    return state


def check_shards(role_dir: Path) -> None:
    """Refuse a role's shard directory whose DCP metadata cannot be read or whose shard files are shorter than it
    says: found here, when the checkpoint is chosen, not after the model is built."""
    from conveyor.workers.training.shards import CheckpointFormatError, SafeFileSystemReader

    meta_file = role_dir / ".metadata"
    if not meta_file.is_file():
        raise ValueError(f"{role_dir} is not a sharded checkpoint (no .metadata); resume from another checkpoint")
    try:
        metadata = SafeFileSystemReader(str(role_dir)).read_metadata()
        extents: dict[str, int] = {}
        for info in metadata.storage_data.values():
            end = int(info.offset) + int(info.length)
            extents[info.relative_path] = max(extents.get(info.relative_path, 0), end)
    except CheckpointFormatError as err:
        raise ValueError(
            f"checkpoint file {meta_file}: {' '.join(str(err).split())}; resume from another checkpoint"
        ) from err
    except Exception as err:  # the allow-list unpickler on damaged bytes: any of its error paths
        raise ValueError(
            f"checkpoint file {meta_file} is truncated or corrupted ({type(err).__name__}: {_first_line(err)}); "
            "resume from another checkpoint"
        ) from err
    for name, end in sorted(extents.items()):
        shard = role_dir / str(name)
        if Path(str(name)).name != str(name) or not shard.is_file():
            raise ValueError(
                f"checkpoint file {meta_file} names the shard file {name!r}, which is not in {role_dir}; "
                "the checkpoint is incomplete: resume from another checkpoint"
            )
        size = shard.stat().st_size
        if size < end:
            raise ValueError(
                f"checkpoint file {shard} is truncated ({size} bytes, its metadata says at least {end}); "
                "resume from another checkpoint"
            )


def _first_line(err: BaseException) -> str:
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    return lines[0][:300] if lines else repr(err)


def _is_pickle(path: Path) -> bool:
    """Whether `path` starts as a pickle stream or a zip archive (torch.save's format) does, not as random bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
    except OSError:
        return False
    return head[:1] == b"\x80" or head == b"PK"


def _unpickler_reason(err: BaseException) -> str:
    """torch's own reason inside a weights_only refusal (its advice to turn the check off left out)."""
    text = str(err)
    marker = "WeightsUnpickler error:"
    if marker in text:
        rest = [ln.strip() for ln in text.split(marker, 1)[1].splitlines() if ln.strip()]
        if rest:
            return rest[0][:300]
    return _first_line(err)


def _unreadable(state_file: Path, reason: str) -> ValueError:
    what = "trainer state" if state_file.name == "trainer_state.pt" else "checkpoint file"
    return ValueError(
        f"checkpoint file {state_file} is truncated or unreadable ({reason}): it is damaged or not a conveyor "
        f"{what}; resume from an older checkpoint with trainer.resume_mode=resume_path"
    )


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
