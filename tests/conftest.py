"""Suite-wide fixtures: one model cache per test session, tiny run configs."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest


def _closed_stream_handlers() -> list[tuple[logging.Logger, logging.Handler]]:
    """Every (logger, handler) whose stream is a closed file: a capture stream of a test that has ended."""
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    return [
        (lg, h)
        for lg in loggers
        for h in lg.handlers
        if isinstance(h, logging.StreamHandler) and getattr(getattr(h, "stream", None), "closed", False)
    ]


@pytest.fixture(autouse=True)
def _no_handler_on_a_closed_stream():
    """Many runs share this process: a library that binds a log handler to the stream a test captured (at its
    first import, say) would make every later log line a `--- Logging error ---` traceback in another test's
    output. Such handlers are dropped when the test that owned the stream ends."""
    yield
    for lg, h in _closed_stream_handlers():
        lg.removeHandler(h)


@pytest.fixture(scope="session", autouse=True)
def _conveyor_cache(tmp_path_factory: pytest.TempPathFactory):
    """Build tiny models into a session-local cache, never the user's ~/.cache."""
    old = os.environ.get("CONVEYOR_CACHE")
    path = tmp_path_factory.mktemp("conveyor-cache")
    os.environ["CONVEYOR_CACHE"] = str(path)
    yield str(path)
    if old is None:
        os.environ.pop("CONVEYOR_CACHE", None)
    else:
        os.environ["CONVEYOR_CACHE"] = old


# A run small enough for a test: 4 prompts x 2 samples, 2 steps, no warm start.
TINY_RUN = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "critic.ppo_mini_batch_size=2",
    "data.synthetic.num_train=64",
    "data.synthetic.num_val=8",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
    "trainer.total_training_steps=2",
    "trainer.test_freq=0",
    "trainer.logger=[jsonl]",
    "trainer.progress_bar=false",
    "trainer.dump_freq=0",
]


@pytest.fixture(scope="session")
def tiny_run_base():
    """The tiny run's overrides without a run directory (for a run that a module's tests share)."""
    return list(TINY_RUN)


@pytest.fixture
def tiny_run(tmp_path):
    """Overrides for a tiny run writing into tmp_path."""
    return TINY_RUN + [f"trainer.default_local_dir={tmp_path}"]


def _wait_until(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.25)
    return condition()


@pytest.fixture
def wait_until():
    """`wait_until(condition, seconds=30)`: poll `condition` every 0.25 s until true or out of time; its last value."""
    return _wait_until


# --------------------------------------------------------------------------- what `make test-fast` runs

# Tests that start the run's own machinery: a training run, a rollout engine, Ray, an interpreter that imports the
# stack (`conveyor` in a child process), worker ranks or agents in processes of their own. By path under tests/ (a
# folder, a file, or one test's node id); `pytest_collection_modifyitems` marks them `process`, and `make test-fast`
# runs everything that is neither `process` nor `slow`, so a new unit test is in it wherever it is written. A new
# test that starts such a thing is added here, or marks itself (`@pytest.mark.process`, or `pytestmark` for a whole
# module). Helper processes that are the unit under test or its reference do not count: a sandboxed program, verl's
# reference run in tests/algos/test_verl_parity.py.
PROCESS_TESTS: tuple[str, ...] = (
    "agent/",
    "benchmarks/",
    "data_plane/test_backend_agreement.py",
    "data_plane/test_ray_store.py",
    "data_plane/test_served.py",
    "data_plane/test_transferqueue.py",
    "reliability/test_async_interrupt.py",
    "reliability/test_async_stops.py",
    "reliability/test_bad_input.py",
    "reliability/test_engine_checks.py",
    "reliability/test_faults.py",
    "reliability/test_fuzz_boundaries.py",
    "reliability/test_hostile_input.py",
    "reliability/test_interrupt.py",
    "reliability/test_out_of_space.py",
    "reliability/test_replica_faults.py",
    "reliability/test_resume.py",
    "reliability/test_stops_and_resume_checks.py",
    "rollout/test_agent_loop.py",
    "rollout/test_conformance.py",
    "rollout/test_engine_registry.py",
    "rollout/test_hf_rollout.py",
    "rollout/test_hf_vision.py",
    "rollout/test_placement.py",
    "rollout/test_vllm_",
    "rollout/test_weight_channel.py",
    "rollout/test_weight_sync.py",
    "tasks/test_code_task.py::test_a_few_steps_train_through_the_sandbox_above_chance",
    "test_cli.py",
    "test_config.py::test_the_implementation_imports_the_config_without_a_cycle",
    "test_protocol.py::test_concat_resolves_object_refs",
    "test_registry.py",
    "trainer/test_algorithm_runs.py",
    "trainer/test_async",
    "trainer/test_distillation.py",
    "trainer/test_e2e.py",
    "trainer/test_estimator_inputs.py",
    "trainer/test_vlm.py",
    "trainer/test_export",
    "trainer/test_lora.py",
    "trainer/test_moe_training.py",
    "trainer/test_observability_run.py",
    "trainer/test_one_construction_path.py",
    "trainer/test_plan.py::test_the_command_line_refuses_r3_with_bypass_on_the_vllm_cpu_engine_before_building_anything",
    "trainer/test_ray_training.py",
    "trainer/test_reaper.py",
    "trainer/test_reproducibility.py",
    "trainer/test_resume_schedule.py",
    "trainer/test_reward_model_runs.py",
    "trainer/test_rollout_replay.py",
    "trainer/test_stages.py",
    "trainer/test_trainer_state.py",
    "workers/test_expert_parallel.py",
    "workers/test_gpu_paths.py",
    "workers/test_judge.py",
    "workers/test_link.py",
    "workers/test_lora_strategies.py",
    "workers/test_loss_terms.py::test_a_term_registered_from_a_plugin_is_trained_with",
    "workers/test_rank0_loading.py",
    "workers/test_ray_group.py",
    "workers/test_reward_model.py",
    "workers/test_rollout_staging.py",
    "workers/test_router_controls.py",
    "workers/test_sequence_parallel.py",
    "workers/test_strategies.py",
)

_TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    """Register the `process` marker (pyproject.toml registers `gpu` and `slow`)."""
    config.addinivalue_line(
        "markers",
        "process: starts a training run, a rollout engine, Ray, conveyor in a child process, ranks or agents "
        "(left out of make test-fast; tests/conftest.py PROCESS_TESTS)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `process` every test under PROCESS_TESTS."""
    for item in items:
        path = Path(str(item.path)).resolve()
        if not path.is_relative_to(_TESTS):
            continue
        node = path.relative_to(_TESTS).as_posix() + item.nodeid[len(item.nodeid.split("::")[0]) :]
        if node.startswith(PROCESS_TESTS):
            item.add_marker(pytest.mark.process)
