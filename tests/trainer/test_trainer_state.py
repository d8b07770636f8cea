"""Every part of the trainer that carries state from one step to the next is registered with its `Checkpoints`.

The walk goes through the trainer's attributes and, one level down, through those of the trainer's own objects
that are neither registered nor declared here. It fails on

- an object (a conveyor class or any other non-plain value) that is neither registered with `trainer.checkpoints`
  nor declared in `NOT_RUN_STATE` with the reason it holds no run state: each new part is a decision; and
- a plain value (number, tensor, container of them, frozen dataclass) or walked object that changes while the
  trainer runs steps, with the MoE metrics on and the steps ending mid-interval so that every accumulator holds
  counts: that is run state a resumed run would lose.

The router-margin accumulator was once the part that was missed (a resumed run logged other `near_tie` metrics);
`test_the_walk_finds_an_unregistered_part` shows the walk catches it both ways.

A registered part is then checked for what it saves: what `save` returns loads back through `load`, and a
checkpoint written before a part had an entry of its own still resumes.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_stages import build_trainer  # tests/trainer is on sys.path (rootdir import mode)

from conveyor.trainer.state import maybe_resume, trainer_state

# What the walk neither flags nor enters, by attribute path, and why no checkpoint needs more of it.
NOT_RUN_STATE: dict[str, str] = {
    "cfg": "the validated config, frozen (saved as the trainer state's `config`)",
    "plan": "the run's decisions, frozen (plan.json)",
    "data_plane": "samples live in a step's partition, cleared when the step ends",
    "workers": "the roles' models, optimizers, schedules and router biases: saved by each role's save_checkpoint",
    "tokenizer": "read only",
    "model_config": "read only (written beside the shards for `conveyor export`)",
    "tracking": "a view of the metrics: a resumed run appends to the same files",
    "prometheus": "a view of the metrics",
    "checkpoints": "the registry itself",
    "stages.prompts": "the tokenizer and the prompt length settings, read only",
    "stages.train_data": "the prompt order, saved through the sample source (`dataset`)",
    "stages.global_step": "the checkpoint's step (`global_step`), handed back by resume",
    "stages._train_width": "a cache of the longest training prompt, computed again from the records",
}

INTERVAL = "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=3"


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether `value` is compared by value: a scalar, a path, a tensor, a frozen dataclass, or a container of them."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, Path, enum.Enum, torch.Tensor, range)):
        return True
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__dataclass_params__.frozen
    if isinstance(value, (list, tuple, set, frozenset)) and depth < 6:
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict) and depth < 6:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _same(a: Any, b: Any) -> bool:
    """Equality that compares tensors by dtype, shape and values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.equal(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _walk(trainer: Any, declared: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """(path -> snapshot of every value the walk watches, the objects neither registered nor declared)."""
    registered = {id(part.owner) for part in trainer.checkpoints.parts.values() if part.owner is not None}
    seen: set[int] = {id(trainer)}
    watched: dict[str, Any] = {}
    problems: list[str] = []

    def visit(path: str, value: Any, level: int) -> None:
        plain = _plain(value)
        if id(value) in registered or (not plain and id(value) in seen):  # another name of an object classified
            return
        if path in declared:
            seen.add(id(value))  # stages.workers is workers
            return
        if plain:
            watched[path] = copy.deepcopy(value)
            return
        seen.add(id(value))
        if level == 1 and type(value).__module__.startswith("conveyor."):
            # One of the trainer's own parts: whatever it holds is watched, one level down.
            for name, attr in vars(value).items():
                visit(f"{path}.{name}", attr, 2)
            return
        problems.append(
            f"{path} ({type(value).__name__}) is neither registered with trainer.checkpoints nor declared in "
            "NOT_RUN_STATE"
        )

    for name, value in vars(trainer).items():
        visit(name, value, 1)
    return watched, problems


def _unregistered_state(trainer: Any, steps: int, declared: dict[str, str] = NOT_RUN_STATE) -> list[str]:
    """What the walk finds before and after each of `steps` training steps (see the module's docstring)."""
    before, problems = _walk(trainer, declared)
    for _ in range(steps):
        trainer.global_step += 1
        trainer.step()
        after, more = _walk(trainer, declared)
        problems += [p for p in more if p not in problems]
        problems += [
            f"{path} changed during step {trainer.global_step} but is not registered with trainer.checkpoints"
            for path in before
            if path in after and not _same(before[path], after[path])
        ]
        before = after
    return problems


def _trainer(base: list[str], tmp_path: Path, *extra: str) -> Any:
    """A synchronous trainer of the tiny run `base` logging the MoE metrics every 3 steps, writing into tmp_path."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    trainer, *_ = build_trainer(
        [*base, f"trainer.default_local_dir={tmp_path}", INTERVAL, *extra], with_model_config=True
    )
    return trainer


@pytest.mark.parametrize("extra", [[], ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"]])
def test_every_part_that_holds_run_state_is_registered(
    tiny_run_base: list[str], tmp_path: Path, extra: list[str]
) -> None:
    trainer = _trainer(tiny_run_base, tmp_path, *extra)
    assert not _unregistered_state(trainer, steps=2)
    # Mid-interval: the accumulators hold counts, which is what a checkpoint taken now must keep.
    assert trainer.margin_acc.known is not None and trainer.moe_acc.counts is not None


def test_the_walk_finds_an_unregistered_part(tiny_run_base: list[str], tmp_path: Path) -> None:
    trainer = _trainer(tiny_run_base, tmp_path)
    del trainer.checkpoints.parts["router_margins"]  # as it was before it was registered
    problems = _unregistered_state(trainer, steps=1)
    assert "margin_acc.known changed during step 1 but is not registered with trainer.checkpoints" in problems
    # An object the walk does not know, held by one of the trainer's parts, is a decision to make.
    trainer.stages.cache = object()
    assert _walk(trainer, NOT_RUN_STATE)[1] == [
        "stages.cache (object) is neither registered with trainer.checkpoints nor declared in NOT_RUN_STATE"
    ]


def test_every_registered_part_loads_what_it_saves(tiny_run_base: list[str], tmp_path: Path) -> None:
    trainer = _trainer(tiny_run_base, tmp_path)
    for _ in range(2):
        trainer.global_step += 1
        trainer.step()
    parts = trainer.checkpoints.parts
    assert {"rng", "dataset", "kl_coef", "moe_load", "router_margins", "val_history"} <= parts.keys()
    saved = {name: part.save() for name, part in parts.items()}
    torch.save(saved, tmp_path / "state.pt")  # tensors and plain values only: read back without unpickling
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    fresh = _trainer(tiny_run_base, tmp_path / "fresh")
    for name, part in fresh.checkpoints.parts.items():
        part.load(loaded[name])
    for name, part in fresh.checkpoints.parts.items():
        if name != "rng":  # the process's RNG is one: loaded, it moves on
            assert _same(part.save(), saved[name]), name
    assert fresh.margin_acc.known.equal(trainer.margin_acc.known)


def test_a_checkpoint_written_before_the_accumulators_had_entries_resumes(
    tiny_run_base: list[str], tmp_path: Path
) -> None:
    from conveyor.trainer.checkpoint import rng_state

    trainer = _trainer(tiny_run_base, tmp_path)
    trainer.margin_acc.known = torch.ones(2, dtype=torch.long)  # counts of this run's own: the checkpoint has none
    older = {
        "global_step": 2,
        "config": {},
        "roles": {"actor": {}},
        "dataset": {**trainer.stages.train_data.state_dict(), "position": 8},
        "rng": rng_state(),
        "kl_coef": 0.25,
        "moe_counts": torch.ones(2, 4, dtype=torch.long),
        "moe_retry_step": 7,
        "val_history": [(1, 0.5)],
    }
    path = tmp_path / "checkpoints" / "global_step_2"
    (path / "actor").mkdir(parents=True)
    torch.save(older, path / "trainer_state.pt")
    loaded: list[str] = []
    actor = SimpleNamespace(load_checkpoint=lambda shards, state: loaded.append(shards))
    # The trainer's own registrations, with workers that only note what they were asked to load.
    checkpoints = copy.copy(trainer.checkpoints)
    checkpoints.workers = SimpleNamespace(actor=actor, critic=None)
    assert maybe_resume(checkpoints) == 2 and loaded == [str(path / "actor")]
    assert trainer.kl_ctrl.value == 0.25 and trainer.validation.history == [(1, 0.5)]
    assert trainer.moe_acc.counts.equal(older["moe_counts"]) and trainer.moe_acc.routed_experts_retry_step == 7
    assert trainer.margin_acc.known is None and trainer.stages.train_data.state_dict()["position"] == 8
    state = trainer_state(checkpoints, 2, {})
    assert (
        state["moe_load"]["retry_step"] == 7 and "moe_counts" not in state and state["router_margins"]["known"] is None
    )
