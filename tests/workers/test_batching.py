"""Token-budget micro-batches: under the budget, few, agreed over ranks, outputs back in row order and width."""

from __future__ import annotations

import math
import random

import pytest
import torch
from tensordict import TensorDict

from conveyor.workers.training.batching import (
    TokenBudget,
    in_row_order,
    plan_micro_batches,
    take,
    token_budget,
    token_micro_batches,
)

KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"


def _cost(rows: list[int], prompts: list[int], responses: list[int]) -> int:
    """What a micro-batch's forward processes once its all-padding columns are dropped."""
    return len(rows) * (max(prompts[i] for i in rows) + max(responses[i] for i in rows))


def test_micro_batches_fit_the_budget_and_are_few() -> None:
    """Every micro-batch's rows x (longest prompt + longest response) fits; the count stays near the real tokens'
    lower bound when the budget holds several rows (measured: at most 2 over it)."""
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 40)
        prompts = [rng.randint(8, 32) for _ in range(n)]
        responses = [rng.randint(1, 64) for _ in range(n)]
        budget = rng.randint(4 * 96, 1500)
        parts = token_micro_batches(prompts, responses, TokenBudget(budget, KEY))
        assert sorted(i for p in parts for i in p) == list(range(n))
        assert all(_cost(p, prompts, responses) <= budget for p in parts)
        real = sum(prompts) + sum(responses)
        assert math.ceil(real / budget) <= len(parts) <= math.ceil(real / budget) + 3


def test_like_lengths_share_a_micro_batch() -> None:
    """Short rows go together, long ones together: little of a micro-batch is padding."""
    prompts = [4] * 8
    responses = [60, 2, 58, 3, 61, 1, 59, 2]
    parts = token_micro_batches(prompts, responses, TokenBudget(130, KEY))
    assert sorted(sorted(p) for p in parts) == [[0, 4], [1, 3, 5, 7], [2, 6]]


def test_a_sequence_over_the_budget_names_the_key() -> None:
    with pytest.raises(ValueError, match=f"a sequence of 70 tokens .* exceeds {KEY}=64; set {KEY} to at least 70"):
        token_micro_batches([5, 10, 2], [5, 60, 3], TokenBudget(64, KEY))


def test_ranks_agree_on_the_count() -> None:
    """A rank told that another needs more passes splits its own rows into that many (at most one row each)."""
    prompts, responses = [5] * 4, [5] * 4
    assert len(token_micro_batches(prompts, responses, TokenBudget(40, KEY))) == 1
    assert len(token_micro_batches(prompts, responses, TokenBudget(40, KEY), agree=lambda k: 3)) == 3
    # More passes than rows: one row each, and `TrainedModel.passes` pairs the rest with dropped repeats.
    assert len(token_micro_batches(prompts, responses, TokenBudget(40, KEY), agree=lambda k: 9)) == 4
    seen = []
    token_micro_batches(prompts, responses, TokenBudget(20, KEY), agree=lambda k: seen.append(k) or k)
    assert seen == [2]


def test_outputs_come_back_in_row_order_and_width() -> None:
    prompt_mask = torch.tensor([[0, 1], [1, 1], [0, 1], [1, 1], [0, 1], [1, 1]], dtype=torch.bool)
    response_mask = torch.tensor(
        [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool
    )
    td = TensorDict(
        {
            "prompts": prompt_mask.long(),
            "prompt_mask": prompt_mask,
            "responses": response_mask.long(),
            "response_mask": response_mask,
            "advantages": response_mask.float() * torch.arange(6.0)[:, None],
            "routed_experts": torch.zeros(6, 6, 1, 1),
        },
        batch_size=[6],
    )
    for budget in (None, TokenBudget(7, KEY)):
        batches = plan_micro_batches(prompt_mask, response_mask, 4, budget)
        outs = []
        for b in batches:
            mb, window = take(td, b)
            if budget is not None:  # each keeps only the columns some row of it uses
                assert mb["responses"].shape[1] == int(mb["response_mask"].sum(-1).max())
                assert mb["prompts"].shape[1] == int(mb["prompt_mask"].sum(-1).max())
                assert mb["routed_experts"].shape[1] == mb["prompts"].shape[1] + mb["responses"].shape[1]
                assert mb["advantages"].shape[1] == mb["responses"].shape[1]
                assert window.sequence(mb["routed_experts"]).shape == (len(mb), 6, 1, 1)
            outs.append(window.responses(mb["advantages"]))
        assert torch.equal(in_row_order(outs, batches), td["advantages"])
    assert len(plan_micro_batches(prompt_mask, response_mask, 4, TokenBudget(7, KEY))) > 2


def test_null_keys_stand_for_the_keys_they_default_to() -> None:
    kw = {"enabled_default": True, "max_tokens_default": 100, "default_key": KEY}
    assert token_budget(None, None, "r.key", **kw) == TokenBudget(100, KEY)
    assert token_budget(None, 50, "r.key", **kw) == TokenBudget(50, "r.key")
    assert token_budget(False, 50, "r.key", **kw) is None
    assert token_budget(None, None, "r.key", **{**kw, "enabled_default": False}) is None
