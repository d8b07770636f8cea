"""The example configs stay valid as the config evolves."""

from pathlib import Path

import pytest

from conveyor.config import load_config

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_config_loads(path):
    cfg = load_config(path)
    assert cfg.trainer.total_training_steps > 0


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


def test_tiny_cpu_example_is_the_defaults_plus_router_load_balance():
    # `make train` runs it: the defaults, with the MoE load-balance metrics on (off by default).
    example = load_config(Path(__file__).parent.parent / "examples" / "tiny_cpu.yaml")
    assert example.actor_rollout_ref.rollout.moe_load_balance_metrics_interval == 10
    assert example == load_config(None, ["actor_rollout_ref.rollout.moe_load_balance_metrics_interval=10"])
