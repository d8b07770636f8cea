"""Rollout bundles: a step's samples as its update read them, kept on disk, and the source that replays them.

Every `trainer.dump_rollouts.freq` steps the trainer writes the step's batch, as
stages 1-3 left it in the data plane, to `run_dir/rollouts/step_{step:06d}/`:

- `tensors.safetensors`: every tensor column (a dense column under its field
  name; a ragged one row by row, as `field/row`);
- `bundle.json`: the format version, the step, the policy version that
  sampled it, the seeds, the keys and tags of the samples, the non-tensor
  columns, the sample stages' metrics (rewards as recorded, no timings), the
  prompt order after the step drew its prompts, and what a replay must match
  (`compat`: the model, the batch sizes and lengths).

A bundle is written into a hidden directory and renamed into place, so a
reader never sees half of one; only the newest `trainer.dump_rollouts.window`
are kept. Nothing is pickled: a bundle from anywhere is safe to load.

`trainer.replay_rollouts_from=DIR` (a bundle, or a dump root holding one per
step) makes `ReplaySource` the run's sample source: each step puts its bundle's
columns into the step's partition and the stages after generation run as
configured. The run builds no rollout engine (the plan's rollout placement is
`none`) and no validation (it would generate).

What it deliberately does not do: decide what the update computes (the trainer
does, from the same plan as the recorded run) or keep generation dumps for
reading (`conveyor.metrics.dumps`, `conveyor show`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from conveyor.protocol import KVBatchMeta
from conveyor.trainer.sources import Batch, SampleSource
from conveyor.trainer.stages import Stages

logger = logging.getLogger(__name__)

__all__ = [
    "BUNDLE_VERSION",
    "ReplaySource",
    "RolloutDumps",
    "bundle_path",
    "bundle_compat",
    "check_replay",
    "list_bundles",
    "read_bundle",
    "write_bundle",
]

BUNDLE_VERSION = 1
_KEY = "trainer.replay_rollouts_from"
_BUNDLE = re.compile(r"^step_(\d+)$")
# Metrics of the sample stages that measure this machine, not the samples: a replay does not repeat them.
_MEASURED = ("timing_s/", "timing_cpu_s/", "perf/", "gen_time_s")
# What every update reads of a batch, whatever the config (stage 7's inputs and the update's).
_REQUIRED = ("responses", "response_mask", "rollout_log_probs", "rm_scores", "uid")


def bundle_path(root: str | Path, step: int) -> Path:
    """Where the bundle of `step` lives under a dump root: root/step_{step:06d}."""
    return Path(root) / f"step_{step:06d}"


def list_bundles(root: str | Path) -> list[int]:
    """The steps with a complete bundle under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _BUNDLE.match(p.name)
        if m and (p / "bundle.json").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def bundle_compat(cfg: Any) -> dict[str, Any]:
    """What a replaying run must share with the recorded one, by config key: the model, batch sizes, lengths and the
    run's length (the lr schedule spans it)."""
    m = cfg.actor_rollout_ref.model
    return {
        "trainer.total_training_steps": cfg.trainer.total_training_steps,
        "actor_rollout_ref.model.path": m.path,
        "actor_rollout_ref.model.tiny": None if m.path else dataclasses.asdict(m.tiny),
        "data.train_batch_size": cfg.data.train_batch_size,
        "actor_rollout_ref.rollout.n": cfg.actor_rollout_ref.rollout.n,
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "data.max_response_length": cfg.data.max_response_length,
    }


def _json_safe(name: str, values: list) -> list:
    """A non-tensor column as JSON, refused (naming the field) when JSON would not give back the same values."""
    try:
        text = json.dumps(values, allow_nan=True)
    except (TypeError, ValueError) as err:
        raise ValueError(f"rollout bundle: field {name!r} holds values JSON cannot store ({err})") from err
    if json.loads(text) != values:
        raise ValueError(f"rollout bundle: field {name!r} would not read back as written (tuples or non-str keys)")
    return values


def write_bundle(
    root: str | Path,
    step: int,
    meta: KVBatchMeta,
    columns: dict[str, Any],
    *,
    metrics: dict[str, float],
    info: dict[str, Any],
) -> Path:
    """Write one step's bundle (`columns`: field -> tensor, jagged tensor or list of per-sample values); its path."""
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    lists: dict[str, list] = {}
    for name, col in columns.items():
        if isinstance(col, torch.Tensor) and not col.is_nested:
            tensors[name], kinds[name] = col.detach().cpu().contiguous(), "dense"
        elif isinstance(col, torch.Tensor) or (col and all(isinstance(v, torch.Tensor) for v in col)):
            rows = list(col.unbind(0)) if isinstance(col, torch.Tensor) else list(col)
            kinds[name] = "nested" if isinstance(col, torch.Tensor) else "tensor_list"
            tensors.update({f"{name}/{i}": r.detach().cpu().contiguous() for i, r in enumerate(rows)})
        else:
            lists[name], kinds[name] = _json_safe(name, list(col)), "list"
    record = {
        "version": BUNDLE_VERSION,
        "step": step,
        **info,
        "keys": list(meta.keys),
        "tags": [dict(t) for t in meta.tags] if meta.tags else [],
        "kinds": kinds,
        "lists": lists,
        "metrics": {k: v for k, v in metrics.items() if not any(m in k for m in _MEASURED)},
    }
    final = bundle_path(root, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_file(tensors, str(tmp / "tensors.safetensors"))
        (tmp / "bundle.json").write_text(json.dumps(record, allow_nan=True) + "\n", encoding="utf-8")
        shutil.rmtree(final, ignore_errors=True)  # a step written again (a resumed run repeats it)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk must not keep half a bundle filling it further
        raise
    return final


def read_bundle(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(record, columns) of the bundle in `path`: bundle.json's content and its columns as they were written."""
    path = Path(path)
    try:
        record = json.loads((path / "bundle.json").read_text(encoding="utf-8"))
        tensors = load_file(str(path / "tensors.safetensors"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{_KEY}: {path} is not a readable rollout bundle ({err})") from err
    if not isinstance(record, dict) or record.get("version") != BUNDLE_VERSION:
        raise ValueError(f"{_KEY}: {path} is not a rollout bundle of version {BUNDLE_VERSION}")
    columns: dict[str, Any] = {}
    try:
        n = len(record["keys"])
        for name, kind in record["kinds"].items():
            if kind == "dense":
                columns[name] = tensors[name]
            elif kind == "list":
                columns[name] = record["lists"][name]
            else:
                rows = [tensors[f"{name}/{i}"] for i in range(n)]
                columns[name] = torch.nested.nested_tensor(rows, layout=torch.jagged) if kind == "nested" else rows
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"{_KEY}: {path} is an incomplete rollout bundle (no {err}); it was edited or cut short"
        ) from err
    return record, columns


def _where(cfg: Any) -> tuple[Path, int | None]:
    """(dump root, the one bundle's step or None): what trainer.replay_rollouts_from points at."""
    path = Path(cfg.trainer.replay_rollouts_from).expanduser()
    if (path / "bundle.json").is_file():
        m = _BUNDLE.match(path.name)
        record = json.loads((path / "bundle.json").read_text(encoding="utf-8"))
        return path.parent, int(m.group(1)) if m else int(record.get("step", -1))
    if path.is_dir() and list_bundles(path):
        return path, None
    raise ValueError(
        f"{_KEY}={path}: neither a rollout bundle (a directory with bundle.json) nor a dump root holding "
        "step_NNNNNN bundles; point it at run_dir/rollouts of a run with trainer.dump_rollouts.freq > 0"
    )


def check_replay(cfg: Any) -> None:
    """Refuse, before anything is built, bundles that do not match this config (naming the key to change)."""
    root, only = _where(cfg)
    steps = [only] if only is not None else list_bundles(root)
    record, _ = read_bundle(bundle_path(root, steps[-1]) if only is None else Path(cfg.trainer.replay_rollouts_from))
    ours = bundle_compat(cfg)
    for key, theirs in record.get("compat", {}).items():
        if key in ours and ours[key] != theirs:
            raise ValueError(
                f"{_KEY}: the bundle was recorded with {key}={json.dumps(theirs)}, this run has "
                f"{json.dumps(ours[key])}; set {key} as recorded to replay it"
            )


def _missing_fields(plan: Any, greedy_baseline: bool, have: list[str]) -> list[str]:
    """The fields this run's stages after generation read that a bundle lacks."""
    need = list(_REQUIRED)
    if greedy_baseline:
        need.append("reward_baselines")
    if plan.replay_mode == "R3":
        need.append("routed_experts")
    return [f for f in need if f not in have]


class ReplaySource(SampleSource):
    """Each step's batch from its recorded bundle: the columns go into the step's partition, nothing generates.

    The prompt order is the recorded run's after the step drew its prompts, so the step's metrics and a checkpoint
    written after it are the recorded run's; its `state_dict` is every source's (the prompt order), so a normal run
    resumes from a replay's checkpoint and a replay from a normal run's.
    """

    def __init__(self, stages: Stages, *, greedy_baseline: bool = False):
        self.stages, self.greedy_baseline = stages, greedy_baseline
        self.root, self.only = _where(stages.cfg)

    @property
    def last_step(self) -> int:
        """The last step a replay trains: its one bundle's, or the newest bundle's under a dump root."""
        if self.only is not None:
            return self.only
        return list_bundles(self.root)[-1]

    def _path(self, step: int) -> Path:
        """The bundle of `step`, or a ValueError naming what to change."""
        if self.only is not None:
            if step != self.only:
                raise ValueError(
                    f"{_KEY}: the bundle is of step {self.only}, but this run trains step {step}: resume from the "
                    f"checkpoint of step {self.only - 1} (trainer.resume_mode=resume_path "
                    f"trainer.resume_from_path=.../checkpoints/global_step_{self.only - 1}), or start fresh for step 1"
                )
            return Path(self.stages.cfg.trainer.replay_rollouts_from).expanduser()
        have = list_bundles(self.root)
        if step not in have:
            raise ValueError(
                f"{_KEY}: no bundle of step {step} in {self.root} (it holds steps {have}); resume from the checkpoint "
                f"of step {have[0] - 1} (trainer.resume_mode=resume_path) or point {_KEY} at one bundle"
            )
        return bundle_path(self.root, step)

    def start(self) -> None:
        """Every step this run will train has a bundle with the fields its stages read: refused now, not after the
        first steps."""
        for step in range(self.stages.global_step + 1, self.last_step + 1):
            record = json.loads((self._path(step) / "bundle.json").read_text(encoding="utf-8"))
            missing = _missing_fields(self.stages.plan, self.greedy_baseline, list(record.get("kinds", {})))
            if missing:
                raise ValueError(
                    f"{_KEY}: the bundle of step {step} lacks {', '.join(missing)}, which this run's stages read; "
                    "replay it with the config it was recorded with"
                )
        if self.stages.global_step >= self.last_step:
            raise ValueError(
                f"{_KEY}: this run resumed at step {self.stages.global_step}, at or after the last bundle's step "
                f"{self.last_step}: resume from the checkpoint of the step before the one to replay"
            )

    def next(self, step_meta: KVBatchMeta, draw: int = 0) -> Batch:
        """The step's recorded batch, written into its partition with its keys and tags."""
        step = self.stages.global_step
        record, columns = read_bundle(self._path(step))
        meta = self.stages.data_plane.kv_batch_put(
            keys=record["keys"], partition_id=step_meta.partition_id, fields=columns, tags=record["tags"] or None
        )
        self.stages.train_data.load_state_dict(record["dataset"])
        return Batch(meta, dict(record["metrics"]), {})

    def generate(self, meta: KVBatchMeta) -> KVBatchMeta:
        """A replay has no rollout: nothing outside training can generate."""
        raise ValueError(f"{_KEY}: a replaying run builds no rollout engine, so it cannot generate")

    def state_dict(self) -> dict[str, Any]:
        """The prompt order now."""
        return {"dataset": self.stages.train_data.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the prompt order of a checkpoint (of any run with the same data)."""
        self.stages.train_data.load_state_dict(state["dataset"])


class RolloutDumps:
    """Writes the step's bundle every `trainer.dump_rollouts.freq` steps and keeps the newest `window`."""

    def __init__(self, stages: Stages, run_dir: Path):
        self.stages = stages
        self.root = Path(run_dir) / "rollouts"
        dr = stages.cfg.trainer.dump_rollouts
        self.freq, self.window = dr.freq, dr.window

    def due(self, step: int) -> bool:
        """Whether `step`'s bundle is written."""
        return self.freq > 0 and step % self.freq == 0

    def write(self, step: int, meta: KVBatchMeta, metrics: dict[str, float]) -> Path:
        """Write `step`'s bundle from the partition as the sample stages left it, then drop the oldest beyond the
        window."""
        stages = self.stages
        columns = stages.data_plane.kv_batch_get_columns(meta.keys, meta.partition_id, list(meta.fields))
        version = step - 1
        if "policy_version" in columns and isinstance(columns["policy_version"], torch.Tensor):
            version = int(columns["policy_version"].min())  # asynchronous: the oldest weights in the batch
        info = {
            "policy_version": version,
            "seeds": {"trainer.seed": stages.cfg.trainer.seed, "generation": stages.seed("gen", step)},
            "dataset": stages.train_data.state_dict(),
            "compat": bundle_compat(stages.cfg),
        }
        path = write_bundle(self.root, step, meta, columns, metrics=metrics, info=info)
        for old in list_bundles(self.root)[: -self.window]:
            shutil.rmtree(bundle_path(self.root, old), ignore_errors=True)
        return path
