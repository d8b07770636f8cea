"""The actor's loss is the sum of registered terms: the default terms reproduce the policy objective, and a term
registered from a plugin file is trained with, without touching the worker."""

from __future__ import annotations

import pytest

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.trainer.run import run_training
from conveyor.workers.ranks.loss_terms import LOSS_TERMS

PLUGIN = '''
from conveyor.workers.ranks.loss_terms import LossTerm, register_loss_term


class LengthBonus(LossTerm):
    """A toy term: pushes up the log-prob of every token in the loss, and reports its value."""

    name = "length_bonus"
    fields = ("response_mask",)

    def __call__(self, mb):
        value = -(mb.log_prob * mb.loss_mask).sum() / mb.num_tokens
        return 0.01 * value, {"length_bonus@sum": float(value.detach()), "length_bonus@count": 1.0}


register_loss_term("length_bonus", lambda settings, worker: LengthBonus(), overwrite=True)
'''


def test_the_default_terms_are_the_policy_loss_alone() -> None:
    assert list(LOSS_TERMS)[:3] == ["policy", "distillation", "router_aux"]


@pytest.mark.parametrize("with_term", [False, True])
def test_a_term_registered_from_a_plugin_is_trained_with(tiny_run, tmp_path, with_term) -> None:
    plugin = tmp_path / "term.py"
    plugin.write_text(PLUGIN)
    extra = [f"trainer.plugins=[{plugin}]"] if with_term else []
    try:
        run_training(load_config(None, tiny_run + ["trainer.total_training_steps=1"] + extra))
    finally:
        LOSS_TERMS.pop("length_bonus", None)
    row = read_metrics_jsonl(tmp_path / "metrics.jsonl")[-1]
    assert ("actor/length_bonus" in row) == with_term
    if with_term:
        assert row["actor/length_bonus"] > 0 and "actor/pg_loss" in row
