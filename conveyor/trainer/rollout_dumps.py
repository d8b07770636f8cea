"""Rollout bundles: a step's samples as its update read them, kept on disk, and the source that replays them.

Every `trainer.dump_rollouts.freq` steps the trainer writes the step's batch, as
stages 1-3 left it in the data plane, to `run_dir/rollouts/step_{step:06d}/`:

- `tensors.safetensors`: every tensor column (a dense column under its field
  name; a ragged one row by row, as `field/row`);
- `bundle.json`: the format version, the step, the policy version that
  sampled it, the seeds, the keys and tags of the samples, the non-tensor
  columns, the sample stages' metrics (rewards as recorded, no timings), the
  prompt order after the step drew its prompts, and what a replay must match
  (`compat`: the model, the batch sizes and lengths), and the SHA-256 of
  `tensors.safetensors` (safetensors itself keeps no checksum).

A replay reads every bundle it will train on before its first step: a bundle
that is cut short, edited or not a bundle is refused naming its file, not
when its step comes.

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
import hashlib
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
    "read_record",
    "check_tensors",
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
        # safetensors has no checksum: a flipped byte in a tensor would replay as a wrong token id or reward.
        record["tensors_sha256"] = _sha256(tmp / "tensors.safetensors")
        (tmp / "bundle.json").write_text(json.dumps(record, allow_nan=True) + "\n", encoding="utf-8")
        shutil.rmtree(final, ignore_errors=True)  # a step written again (a resumed run repeats it)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk must not keep half a bundle filling it further
        raise
    return final


# What bundle.json holds beside the columns, and the type each must have (what the replay reads of it).
_RECORD_TYPES = {
    "step": int,
    "keys": list,
    "tags": list,
    "kinds": dict,
    "lists": dict,
    "metrics": dict,
}
# Written by the trainer's dumps, not by every writer of a bundle: checked where present (a replay needs them).
_OPTIONAL_TYPES = {"dataset": dict, "compat": dict}


def read_record(path: str | Path) -> dict[str, Any]:
    """bundle.json of the bundle in `path`, checked to be what `write_bundle` writes; a ValueError naming the file."""
    file = Path(path) / "bundle.json"
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # a torn write, foreign bytes, nesting past the parser
        raise ValueError(f"{_KEY}: {file} is not readable JSON ({_first_line(err)}); {_REDO}") from err
    if not isinstance(record, dict) or record.get("version") != BUNDLE_VERSION:
        what = (
            f"a JSON {type(record).__name__}" if not isinstance(record, dict) else f"version {record.get('version')!r}"
        )
        raise ValueError(f"{_KEY}: {file} is {what}, not a rollout bundle of version {BUNDLE_VERSION}; {_REDO}")
    for key, kind in _RECORD_TYPES.items():
        value = record.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(
                f"{_KEY}: {file}: {key!r} is {type(value).__name__ if key in record else 'missing'}, not a "
                f"{kind.__name__}; {_REDO}"
            )
    bad = next(
        (k for k, v in record["metrics"].items() if isinstance(v, bool) or not isinstance(v, (int, float))), None
    )
    if bad is not None:
        raise ValueError(f"{_KEY}: {file}: metric {bad!r} is not a number; {_REDO}")
    keys, tags = record["keys"], record["tags"]
    if not all(isinstance(k, str) for k in keys) or (
        tags and (len(tags) != len(keys) or not all(isinstance(t, dict) for t in tags))
    ):
        raise ValueError(
            f"{_KEY}: {file}: 'keys' or 'tags' are not one string key and one tag mapping a sample; {_REDO}"
        )
    for key, kind in _OPTIONAL_TYPES.items():
        if key in record and not isinstance(record[key], kind):
            raise ValueError(
                f"{_KEY}: {file}: {key!r} is a {type(record[key]).__name__}, not a {kind.__name__}; {_REDO}"
            )
    return record


def check_tensors(path: str | Path, record: dict[str, Any]) -> None:
    """Refuse a bundle whose tensors.safetensors is missing, truncated, not safetensors, or (when `record`, its
    bundle.json, holds the digest written with it) changed since it was written."""
    from safetensors import safe_open

    file = Path(path) / "tensors.safetensors"
    try:
        with safe_open(str(file), framework="pt"):  # the header, checked against the file's length
            pass
        digest = _sha256(file) if "tensors_sha256" in record else None
    except Exception as err:  # safetensors' own error type, an OSError, or anything a damaged header provokes
        raise ValueError(
            f"{_KEY}: {file} is truncated or not a safetensors file ({_first_line(err)}); {_REDO}"
        ) from err
    if digest is not None and digest != record["tensors_sha256"]:
        raise ValueError(
            f"{_KEY}: {file} was changed or damaged after it was written (its SHA-256 is not the one in "
            f"bundle.json); {_REDO}"
        )


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_bundle(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(record, columns) of the bundle in `path`: bundle.json's content and its columns as they were written."""
    path = Path(path)
    record = read_record(path)
    check_tensors(path, record)
    try:
        tensors = load_file(str(path / "tensors.safetensors"))
    except Exception as err:
        raise ValueError(
            f"{_KEY}: {path / 'tensors.safetensors'} cannot be read ({_first_line(err)}); {_REDO}"
        ) from err
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
    except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as err:
        # RuntimeError: rows of one jagged column that no longer agree in dtype or trailing shape.
        raise ValueError(
            f"{_KEY}: {path} is an incomplete rollout bundle ({type(err).__name__}: {_first_line(err)}); it was "
            f"edited or cut short: {_REDO}"
        ) from err
    return record, columns


_REDO = "record the bundle again (trainer.dump_rollouts.freq) or point trainer.replay_rollouts_from at another one"


def _first_line(err: BaseException) -> str:
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    return lines[0][:300] if lines else repr(err)


def _where(cfg: Any) -> tuple[Path, int | None]:
    """(dump root, the one bundle's step or None): what trainer.replay_rollouts_from points at."""
    path = Path(cfg.trainer.replay_rollouts_from).expanduser()
    if (path / "bundle.json").is_file():
        m = _BUNDLE.match(path.name)
        return path.parent, int(m.group(1)) if m else read_record(path)["step"]
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
            record = read_record(self._path(step))
            check_tensors(self._path(step), record)  # a bundle cut short is refused now, not when its step comes
            if "dataset" not in record:
                raise ValueError(
                    f"{_KEY}: {self._path(step) / 'bundle.json'} has no prompt order ('dataset'); it was not written "
                    f"by a run's trainer.dump_rollouts: {_REDO}"
                )
            missing = _missing_fields(self.stages.plan, self.greedy_baseline, list(record["kinds"]))
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
