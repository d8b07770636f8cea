"""The one registration rule (conveyor.registry), and a plugin file that adds a rollout engine and a data plane.

The plugin file is written here, named by `trainer.plugins`, and its engine and backend are chosen by the
config like the built-in ones: a tiny run trains with both, and the engine conformance suite runs the plugin's
engine when pointed at the same file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conveyor.config import ConfigError, load_config
from conveyor.data_plane import BACKENDS
from conveyor.registry import lookup, registrar
from conveyor.rollout.base import ROLLOUT_ENGINES

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
"""A rollout engine (the hf engine under another name, counting what it builds) and a data plane (the memory
store, counting its puts), both registered by name."""

from conveyor.data_plane import register_data_plane
from conveyor.data_plane.memory import MemoryDataPlane
from conveyor.rollout.base import ROLLOUT_ENGINES, EngineSpec, register_rollout_engine
from conveyor.rollout.hf import build_engine as build_hf

BUILT = []
PUTS = []


class CountingPlane(MemoryDataPlane):
    def kv_batch_put(self, *args, **kwargs):
        PUTS.append(1)
        return super().kv_batch_put(*args, **kwargs)


@register_data_plane("counting")
def counting(metrics=None, **options):
    return CountingPlane(metrics=metrics)


def build_engine(context):
    BUILT.append(context.rank)
    return build_hf(context)


register_rollout_engine(EngineSpec("plugin_hf", __name__, ROLLOUT_ENGINES["hf"].capabilities))
'''


@pytest.fixture
def plugin(tmp_path):
    """The plugin file's path; the engine and backend it registers are removed again afterwards."""
    engines, backends = dict(ROLLOUT_ENGINES), dict(BACKENDS)
    path = tmp_path / "my_plugin.py"
    path.write_text(textwrap.dedent(PLUGIN))
    yield path
    for table, saved in ((ROLLOUT_ENGINES, engines), (BACKENDS, backends)):
        table.clear()
        table.update(saved)


def test_a_name_is_registered_once_unless_overwritten() -> None:
    table: dict = {}
    register = registrar(table, "a", "widget")
    assert register(len) is len and register(len) is len  # the same object again: a no-op
    with pytest.raises(ValueError, match=r"^widget 'a' is already registered \(builtins.len\); pass overwrite=True"):
        registrar(table, "a", "widget")(abs)
    assert registrar(table, "a", "widget", overwrite=True)(abs) is abs and table == {"a": abs}
    with pytest.raises(ValueError, match="non-empty string"):
        registrar(table, "", "widget")


def test_lookup_names_the_key_the_nearest_and_every_valid_name() -> None:
    table = {"grpo": 1, "gae": 2, "rloo": 3}
    assert lookup(table, "gae", "algorithm.adv_estimator") == 2
    with pytest.raises(ValueError) as info:
        lookup(table, "grpoo", "algorithm.adv_estimator")
    assert str(info.value) == (
        "algorithm.adv_estimator: unknown 'grpoo' (did you mean 'grpo'?); valid names are gae, grpo, rloo"
    )
    with pytest.raises(ValueError, match=r"^k: unknown \['x'\]; valid names are gae, grpo, rloo$"):
        lookup(table, ["x"], "k")  # type: ignore[arg-type]  # an unhashable name from YAML


def test_a_plugin_registers_an_engine_and_a_data_plane_the_config_selects(plugin, tiny_run) -> None:
    overrides = tiny_run + [
        f"trainer.plugins=[{plugin}]",
        "actor_rollout_ref.rollout.name=plugin_hf",
        "transfer_queue.backend=counting",
        "trainer.total_training_steps=1",
    ]
    cfg = load_config(None, overrides)
    assert (cfg.actor_rollout_ref.rollout.name, cfg.transfer_queue.backend) == ("plugin_hf", "counting")
    # The names are the registries' at once: a misspelling lists the plugin's names among the valid ones.
    with pytest.raises(ConfigError, match=r"transfer_queue.backend: unknown 'countng' \(did you mean 'counting'\?\)"):
        load_config(None, overrides + ["transfer_queue.backend=countng"])
    from conveyor.trainer.run import run_training

    module = sys.modules[next(m for m in sys.modules if m.startswith("conveyor_user_my_plugin_"))]
    run_training(cfg)
    assert module.BUILT == [0] and module.PUTS  # the run built the plugin's engine and wrote into its store


def test_the_conformance_suite_runs_a_plugin_engine(plugin) -> None:
    env = {**os.environ, "CONFORMANCE_PLUGINS": str(plugin), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/rollout/test_conformance.py",
            "-k",
            "plugin_hf",
            "-rA",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:warnings",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Every engine test but the weight sync (the plugin's engine shares the trainer's modules) ran on it.
    passed = [line for line in proc.stdout.splitlines() if line.startswith("PASSED") and "[plugin_hf]" in line]
    assert len(passed) == 5, proc.stdout[-3000:]
