"""Crash-safe checkpoints: written under a temporary name and renamed into place.

A checkpoint is a directory `checkpoints/global_step_N/` holding `actor.pt`,
`critic.pt` (when a critic runs) and `trainer_state.pt` (step, data order, RNG
states, KL controller, MoE accumulator). It appears under its final name only
once complete (one `os.rename` of the directory), so a kill during a save
leaves the newest good checkpoint intact; half-written `*.tmp-*` directories
are ignored and removed on the next save.

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
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "rng_state", "set_rng_state"]

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


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states of this process, as tensors and plain values (loadable without pickle)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_root: str | Path, step: int, parts: dict[str, Any], max_to_keep: int | None = None) -> Path:
    """Write `parts` (name -> object for torch.save) as checkpoint `step`; prune to `max_to_keep` newest."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("global_step_*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"global_step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=root))
    # trainer_state.pt is written last: its presence marks a complete checkpoint.
    names = sorted(parts, key=lambda n: n == "trainer_state")
    for name in names:
        path = tmp / f"{name}.pt"
        with open(path, "wb") as f:
            torch.save(parts[name], f)
            f.flush()
            os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    if max_to_keep is not None:
        for _, old in list_checkpoints(root)[:-max_to_keep]:
            shutil.rmtree(old, ignore_errors=True)
    logger.info("checkpoint saved: %s", final)
    return final


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Every part of a checkpoint directory, by name; a part that is not plain tensors and values is refused."""
    p = Path(path)
    if not (p / "trainer_state.pt").is_file():
        raise ValueError(f"{p} is not a complete checkpoint (no trainer_state.pt); check trainer.resume_from_path")
    parts = {}
    for f in sorted(p.glob("*.pt")):
        try:
            parts[f.stem] = torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            # weights_only refuses anything that would run code to rebuild: say so, without the library's advice
            # to turn the check off.
            raise ValueError(f"checkpoint file {f} holds objects other than tensors and plain values, which conveyor "
                             "never unpickles (it could run code); it was not written by conveyor: "
                             f"{str(err).splitlines()[0]}") from err
    return parts


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
