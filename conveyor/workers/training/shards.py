"""Sharded checkpoints of a model and its optimizer with `torch.distributed.checkpoint` (DCP), loaded without pickle.

Every rank writes its own shards (under `fsdp2` each holds a slice of every
tensor; under `dp` the replicas are deduplicated, rank 0 writes); no rank
gathers the whole model. The keys are the model's parameter names (from
`torch.distributed.checkpoint.state_dict`), so what two ranks wrote loads
into one rank, or into four, or into another strategy.

Loading never runs code from the files: DCP's own reader unpickles its
`.metadata` file and any non-tensor values. Here only tensors go into DCP
(the optimizer's hyper-parameters go into a JSON file beside them), the
metadata is read by an unpickler that rebuilds DCP's own metadata classes and
nothing else, and a checkpoint that declares a non-tensor entry is refused.
Tensor data itself is read by DCP with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = [
    "save_shards",
    "load_shards",
    "load_model_weights",
    "load_model_tensors",
    "CheckpointFormatError",
    "SafeFileSystemReader",
]

_PARAM_GROUPS = "param_groups.json"


class CheckpointFormatError(ValueError):
    """A checkpoint file is not what conveyor writes (truncated, foreign, or holding objects that need unpickling)."""


# The classes DCP's metadata file is made of: nothing that can run code when rebuilt.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
        "BytesStorageMetadata",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch._utils", "_get_layout"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata rebuilt by an allow-list unpickler, and tensors only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata; CheckpointFormatError when it is not plain DCP metadata of tensors."""
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        except FileNotFoundError as err:
            raise CheckpointFormatError(
                f"{self.path}: no DCP metadata file ({err}); the checkpoint is incomplete"
            ) from err
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
            raise CheckpointFormatError(f"{self.path}: its metadata is not a conveyor checkpoint's ({err})") from err
        if not isinstance(metadata, Metadata):
            raise CheckpointFormatError(f"{self.path}: its metadata is a {type(metadata).__name__}, not DCP metadata")
        # DCP loads non-tensor entries with torch.load(weights_only=False); conveyor writes none.
        odd = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
        if odd:
            raise CheckpointFormatError(
                f"{self.path}: holds non-tensor entries {odd[:3]}, which conveyor never writes and will not unpickle"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it saves or loads in one process: without a process group that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _split_optimizer(optim_sd: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(tensor state for DCP, param_groups as plain JSON values)."""
    return {"state": optim_sd["state"]}, optim_sd["param_groups"]


def save_shards(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool = False
) -> None:
    """Write this rank's shards of `model` (and `optimizer`) under `path`; every rank of the role calls it.

    `trainable_only`: the parameters that train and nothing else (LoRA: the adapters; the frozen base is
    the checkpoint the run started from).
    """
    path = Path(path)
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        tensors, groups = _split_optimizer(optim_sd)
        state = {"model": model_sd, "optim": tensors}
    else:
        state, groups = {"model": get_model_state_dict(model, options=options)}, None
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(path), no_dist=not tdist.is_initialized())
    if groups is not None and (not tdist.is_initialized() or tdist.get_rank() == 0):
        (path / _PARAM_GROUPS).write_text(json.dumps(groups))


def _check_param_groups(groups: Any, expected: list[dict[str, Any]], groups_file: Path) -> None:
    """Refuse saved optimizer groups that do not match this optimizer's (an emptied or edited file).

    Checked here, at load: set_state_dict accepts them, and the next step then fails deep in the optimizer.
    """
    ok = (
        isinstance(groups, list)
        and len(groups) == len(expected)
        and all(
            isinstance(g, dict)
            and set(e) <= set(g)
            and isinstance(g.get("params"), list)
            and len(g["params"]) == len(e["params"])
            for g, e in zip(groups, expected)
        )
    )
    if not ok:
        want = [sorted(e) for e in expected]
        raise CheckpointFormatError(
            f"{groups_file} does not describe this optimizer ({len(expected)} groups with "
            f"keys {want[0] if want else []}); it was emptied or edited: resume from another "
            "checkpoint (trainer.resume_mode=resume_path)"
        )


def load_shards(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool = False
) -> None:
    """Load `path` into `model` (and `optimizer`), resharding to this role's strategy and world size.

    `trainable_only`: the checkpoint holds the trained parameters only (`save_shards`); the rest is kept.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointFormatError(f"{path} is not a sharded checkpoint (no .metadata)")
    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        tensors, _ = _split_optimizer(optim_sd)
        state = {"model": model_sd, "optim": tensors}
    else:
        state = {"model": get_model_state_dict(model)}
    _dcp_load(path, state, no_dist=not tdist.is_initialized())
    if optimizer is not None:
        groups_file = path / _PARAM_GROUPS
        try:
            groups = json.loads(groups_file.read_text())
        except (OSError, ValueError, RecursionError) as err:
            raise CheckpointFormatError(f"{groups_file}: missing or unreadable ({err})") from err
        _check_param_groups(groups, optim_sd["param_groups"], groups_file)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict={"state": state["optim"]["state"], "param_groups": groups},
            options=options,
        )
    else:
        set_model_state_dict(model, state["model"])


def load_model_weights(path: str | Path, model: nn.Module, adapters_only: bool = False) -> None:
    """Load only the model weights of a sharded checkpoint into a plain (unsharded) `model` in this process.

    `adapters_only`: the checkpoint holds a LoRA run's adapters (its trainable parameters) and no base weights.
    """
    sd = model.state_dict()
    if adapters_only:
        from conveyor.models.lora import is_adapter_key

        sd = {k: v for k, v in sd.items() if is_adapter_key(k)}
    state = {"model": sd}
    _dcp_load(Path(path), state, no_dist=True)
    model.load_state_dict(state["model"], strict=not adapters_only)


def load_model_tensors(path: str | Path, suffix: str) -> dict[str, torch.Tensor]:
    """The model tensors of a sharded checkpoint whose names end with `suffix`, whole, read in this process."""
    metadata = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    wanted = {
        k.removeprefix("model."): torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith("model.") and k.endswith(suffix)
    }
    if wanted:
        _dcp_load(Path(path), {"model": wanted}, no_dist=True)
    return wanted


def _dcp_load(path: Path, state: dict[str, Any], no_dist: bool) -> None:
    """dcp.load with the safe reader; the metadata is checked first, so a foreign file fails with its own message."""
    SafeFileSystemReader(str(path)).read_metadata()
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), storage_reader=SafeFileSystemReader(str(path)), no_dist=no_dist)
    # DCP reports a missing key or a shape mismatch in its own words, wrapped in a CheckpointException
    # (a BaseException, so `except Exception` alone would let it through).
    except (Exception, CheckpointException) as err:
        lines = [ln for ln in str(err).splitlines() if ln.strip() and not ln.startswith((" ", "Traceback"))]
        raise CheckpointFormatError(f"{path}: cannot load into this model: {lines[-1] if lines else err!r}") from err
