"""Token-budget micro-batches: under the budget, the fewest that fit, agreed over ranks, outputs back in row order."""

from __future__ import annotations

import math
import random

import pytest
import torch

from conveyor.workers.batching import TokenBudget, in_row_order, plan_micro_batches, token_budget, token_micro_batches

KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"


def test_micro_batches_fit_the_budget_and_are_few() -> None:
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(64, 300)
        parts = token_micro_batches(lengths, TokenBudget(budget, KEY))
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in p) <= budget for p in parts)
        # Never fewer than the token count allows; a balanced packing stays close to that bound.
        assert math.ceil(sum(lengths) / budget) <= len(parts) <= math.ceil(sum(lengths) / budget) + 2


def test_a_sequence_over_the_budget_names_the_key() -> None:
    with pytest.raises(ValueError, match=f"a sequence of 70 tokens .* exceeds {KEY}=64; set {KEY} to at least 70"):
        token_micro_batches([10, 70, 5], TokenBudget(64, KEY))


def test_ranks_agree_on_the_count() -> None:
    """A rank told that another needs more passes splits its own rows into that many (at most one row each)."""
    lengths = [10, 10, 10, 10]
    assert len(token_micro_batches(lengths, TokenBudget(40, KEY))) == 1
    assert len(token_micro_batches(lengths, TokenBudget(40, KEY), agree=lambda k: 3)) == 3
    assert len(token_micro_batches(lengths, TokenBudget(40, KEY), agree=lambda k: 9)) == 4  # passes() pads the rest
    seen = []
    token_micro_batches(lengths, TokenBudget(20, KEY), agree=lambda k: seen.append(k) or k)
    assert seen == [2]


def test_outputs_come_back_in_row_order() -> None:
    prompt_mask = torch.ones(6, 2, dtype=torch.bool)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]],
                                 dtype=torch.bool)
    rows = torch.arange(6.0)[:, None].expand(6, 3)
    for budget in (None, TokenBudget(7, KEY)):
        batches = plan_micro_batches(prompt_mask, response_mask, 4, budget)
        if budget is not None:
            assert len(batches) > 2 and any(b.tolist() != sorted(b.tolist()) or len(b) == 1 for b in batches)
        assert torch.equal(in_row_order([rows[b] for b in batches], batches), rows)


def test_null_keys_stand_for_the_keys_they_default_to() -> None:
    kw = {"enabled_default": True, "max_tokens_default": 100, "default_key": KEY}
    assert token_budget(None, None, "r.key", **kw) == TokenBudget(100, KEY)
    assert token_budget(None, 50, "r.key", **kw) == TokenBudget(50, "r.key")
    assert token_budget(False, 50, "r.key", **kw) is None
    assert token_budget(None, None, "r.key", **{**kw, "enabled_default": False}) is None
