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
