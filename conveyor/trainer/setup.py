"""Everything a run needs before its first step: the model checkpoint, the prompts, the data plane, the device.

The workers are built by `conveyor.workers.roles.build_worker_groups`.

The default run needs no files: the tiny model and its character tokenizer are
built from config and warm-started once, then cached (CONVEYOR_CACHE, default
~/.cache/conveyor) under a name derived from every setting that shapes them,
so a changed setting builds a new one and an unchanged one is reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from conveyor.config import Config, ConfigError
from conveyor.data_plane import DataPlane, make_data_plane
from conveyor.ray_utils import data_plane_backend

logger = logging.getLogger(__name__)

__all__ = [
    "cache_dir",
    "prepare_default_model",
    "load_prompt_records",
    "resolve_device",
    "build_data_plane",
]

# Bump when the warm start or the tiny model's construction changes meaning.
_TINY_RECIPE_VERSION = 1


def cache_dir() -> Path:
    """Where built artefacts (the tiny model) are cached."""
    return Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))


def resolve_device(cfg: Config) -> str:
    """The torch device of this run's workers."""
    if cfg.trainer.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device: cuda was asked for but no CUDA device is visible; use trainer.device=cpu")
    return cfg.trainer.device


def load_prompt_records(cfg: Config) -> tuple[list[dict], list[dict]]:
    """(train, validation) prompt records: from parquet files when given, else the synthetic task's splits."""
    from conveyor.tasks.parquet import load_parquet_records
    from conveyor.tasks.synthetic import make_arithmetic_records

    d = cfg.data
    syn = d.synthetic
    if d.train_files:
        train = load_parquet_records(d.train_files)
    else:
        train = make_arithmetic_records(syn.num_train, seed=d.seed, max_operand=syn.max_operand, ops=syn.ops, split="train")
    if d.val_files:
        val = load_parquet_records(d.val_files)
    elif not d.train_files:
        val = make_arithmetic_records(syn.num_val, seed=d.seed + 1, max_operand=syn.max_operand, ops=syn.ops, split="test")
    else:
        val = []
    if d.val_batch_size is not None:
        val = val[: d.val_batch_size]
    if not cfg.reward.custom_reward_function.path:
        # Checked now, not at the first reward stage after the model is built and has generated.
        from conveyor.tasks.rewards import get_reward_fn

        checked: set[str] = set()
        for rec in train + val:
            source = rec.get("data_source")
            if isinstance(source, str) and source in checked:
                continue
            try:
                get_reward_fn(source)  # a non-string data_source is refused here too
            except ValueError as err:
                raise ValueError(f"{err}, or set reward.custom_reward_function.path") from err
            checked.add(source)
    return train, val


def _tiny_key(cfg: Config) -> str:
    tiny = dataclasses.asdict(cfg.actor_rollout_ref.model.tiny)
    syn = dataclasses.asdict(cfg.data.synthetic)
    blob = json.dumps({"tiny": tiny, "task": syn, "seed": cfg.data.seed, "v": _TINY_RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def prepare_default_model(cfg: Config) -> str:
    """The checkpoint directory of the policy: the configured path, or the cached tiny model (built on first use)."""
    from conveyor.models.loading import _check_checkpoint_dir  # one place that knows what a checkpoint dir needs

    path = cfg.actor_rollout_ref.model.path
    if path:
        _check_checkpoint_dir(path)
        return str(path)
    tiny = cfg.actor_rollout_ref.model.tiny
    target = cache_dir() / f"tiny-{tiny.arch}-{_tiny_key(cfg)}"
    if (target / "config.json").is_file():
        return str(target)
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer
    from conveyor.trainer.warmstart import supervised_warmstart

    logger.info("building the tiny %s model (first use) into %s", tiny.arch, target)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        tiny.arch, tokenizer, seed=tiny.seed, hidden_size=tiny.hidden_size, num_layers=tiny.num_layers,
        num_heads=tiny.num_heads, num_kv_heads=tiny.num_kv_heads, intermediate_size=tiny.intermediate_size,
        num_experts=tiny.num_experts, top_k=tiny.top_k,
        max_position_embeddings=cfg.data.max_prompt_length + cfg.data.max_response_length + 8,
    )
    if tiny.warmstart_steps:
        train, _ = load_prompt_records(cfg) if not cfg.data.train_files else (None, None)
        if train is None:
            raise ConfigError("actor_rollout_ref.model.tiny.warmstart_steps needs the synthetic task; "
                              "set it to 0 when using data.train_files, or give actor_rollout_ref.model.path")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(tiny.seed)
            supervised_warmstart(model, tokenizer, train, steps=tiny.warmstart_steps, lr=tiny.warmstart_lr, seed=tiny.seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename into place, so a concurrent or killed
    # build never leaves a half-written checkpoint under the final name.
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; its copy is identical
    return str(target)


def build_data_plane(cfg: Config, registry: Any = None) -> DataPlane:
    """The data plane of `transfer_queue.*` (`ray` instead of `memory` when workers run on Ray), metrics in `registry`."""
    tq = cfg.transfer_queue
    backend = data_plane_backend(cfg)
    options: dict[str, Any] = {}
    if backend == "ray":
        options = {"num_storage_actors": tq.num_storage_actors, "actor_cpus": tq.storage_actor_cpus,
                   "timeout_s": cfg.ray.timeout_s}
    elif backend == "transferqueue":
        options = {"tq_config": dict(tq.transferqueue)}
    return make_data_plane(
        backend,
        metrics_enabled=tq.metrics.enabled,
        metrics_port=tq.metrics.port,
        metrics_host=tq.metrics.host,
        registry=registry,
        **options,
    )
