"""Suite-wide fixtures: one model cache per test session, tiny run configs."""

from __future__ import annotations

import logging
import os
import time

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
