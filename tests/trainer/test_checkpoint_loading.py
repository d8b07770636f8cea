"""Checkpoints load without unpickling code, and what conveyor saves survives that restriction exactly."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.trainer import checkpoint as ckpt
from conveyor.workers.training.shards import CheckpointFormatError, load_model_weights, load_shards, save_shards


class _RunsCode:
    """Unpickling this calls `Path.touch` on a marker file: the shape of a crafted checkpoint that runs a command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_crafted_checkpoint_runs_nothing_and_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    step_dir = tmp_path / "checkpoints" / "global_step_3"
    step_dir.mkdir(parents=True)
    with open(step_dir / "trainer_state.pt", "wb") as f:
        pickle.dump({"global_step": 3, "payload": _RunsCode(marker)}, f)
    with pytest.raises(ValueError, match="never unpickles"):
        ckpt.load_checkpoint(step_dir)
    assert not marker.exists(), "loading the checkpoint ran code from it"
    # The same object through torch.save, as a crafted trainer state written with torch would be.
    torch.save({"global_step": 3, "payload": _RunsCode(marker)}, step_dir / "trainer_state.pt")
    with pytest.raises(ValueError, match="never unpickles"):
        ckpt.load_checkpoint(step_dir)
    assert not marker.exists(), "loading the checkpoint ran code from it"


def test_crafted_shard_metadata_runs_nothing_and_is_refused(tmp_path: Path) -> None:
    """DCP itself unpickles its .metadata file; conveyor's reader rebuilds only DCP's own metadata classes."""
    model = torch.nn.Linear(3, 2)
    shards = tmp_path / "actor"
    save_shards(shards, model, torch.optim.AdamW(model.parameters()))
    load_model_weights(shards, torch.nn.Linear(3, 2))  # a real one loads
    marker = tmp_path / "ran"
    with open(shards / ".metadata", "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    with pytest.raises(CheckpointFormatError, match="not a conveyor checkpoint"):
        load_model_weights(shards, torch.nn.Linear(3, 2))
    with pytest.raises(CheckpointFormatError, match="not a conveyor checkpoint"):
        load_shards(shards, model, torch.optim.AdamW(model.parameters()))
    assert not marker.exists(), "loading the shards ran code from them"


def test_non_tensor_entries_in_shards_are_refused(tmp_path: Path) -> None:
    """DCP would load a non-tensor entry with torch.load(weights_only=False): conveyor never writes one, and refuses
    it."""
    import torch.distributed.checkpoint as dcp

    shards = tmp_path / "actor"
    dcp.save(
        {"model": {"weight": torch.zeros(2)}, "extra": {"note": "any python object"}},
        checkpoint_id=str(shards),
        no_dist=True,
    )
    with pytest.raises(CheckpointFormatError, match="non-tensor entries"):
        load_model_weights(shards, torch.nn.Linear(1, 2, bias=False))


def test_saved_parts_round_trip_under_weights_only(tmp_path: Path) -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.normal()  # leave a cached gaussian in NumPy's state
    state = ckpt.rng_state()
    want = (random.random(), float(np.random.rand()), float(np.random.normal()), float(torch.rand(1)))
    trainer_state = {
        "global_step": 2,
        "rng": state,
        "val_history": [(0, 0.1), (2, 0.5)],
        "moe_counts": torch.ones(2, 4, dtype=torch.long),
        "kl_coef": 0.001,
    }
    path = ckpt.save_checkpoint(tmp_path / "checkpoints", 2, lambda tmp: trainer_state)
    loaded = ckpt.load_checkpoint(path)
    assert torch.equal(loaded["trainer_state"]["moe_counts"], trainer_state["moe_counts"])
    assert loaded["trainer_state"]["val_history"] == [(0, 0.1), (2, 0.5)]
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    ckpt.set_rng_state(loaded["trainer_state"]["rng"])
    got = (random.random(), float(np.random.rand()), float(np.random.normal()), float(torch.rand(1)))
    assert got == want


def test_checkpoints_are_all_kept_by_default_and_each_pruned_one_is_logged(tmp_path: Path, caplog) -> None:
    import logging

    from conveyor.config import load_config
    from conveyor.trainer.checkpoint import list_checkpoints, save_checkpoint

    assert load_config(None, []).trainer.max_ckpt_to_keep is None  # verl keeps every checkpoint too
    write = lambda d: {"global_step": 0}  # noqa: E731 - the shards are not the point here
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, write, None)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2, 3]
    with caplog.at_level(logging.INFO, logger="conveyor.trainer.checkpoint"):
        save_checkpoint(tmp_path, 4, write, 2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    pruned = [r.getMessage() for r in caplog.records if "checkpoint pruned" in r.getMessage()]
    assert len(pruned) == 2 and "global_step_1" in pruned[0] and "max_ckpt_to_keep=2" in pruned[0]
