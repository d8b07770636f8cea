"""Tests for the critic (transformer body + value head)."""

from __future__ import annotations

import pytest
import torch

from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.models.value_head import ValueModel


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture
def policy(tok):
    return build_tiny_model("qwen3_moe", tok, seed=1).eval()


def _batch(tok):
    enc = tok(["1+2=", "12+34="], padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def test_initial_values_are_zero_float32(policy, tok) -> None:
    critic = ValueModel.from_causal_lm(policy)
    ids, mask = _batch(tok)
    values = critic(ids, mask)
    assert values.shape == ids.shape and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros_like(values))
    assert not hasattr(critic, "lm_head") and not any("lm_head" in k for k in critic.state_dict())
    assert critic.config is critic.backbone.config


def test_values_are_the_head_over_the_policy_body(policy, tok) -> None:
    critic = ValueModel.from_causal_lm(policy).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        critic.value_head.weight.copy_(torch.randn(critic.value_head.weight.shape, generator=gen))
        critic.value_head.bias.fill_(0.25)
    ids, mask = _batch(tok)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        hidden = policy.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        expected = hidden @ critic.value_head.weight[0] + 0.25
        got = critic(ids, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_critic_owns_its_parameters(policy) -> None:
    critic = ValueModel.from_causal_lm(policy)
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in critic.parameters()}
    before = policy.model.embed_tokens.weight.clone()
    with torch.no_grad():
        critic.backbone.embed_tokens.weight.add_(1.0)
    assert torch.equal(policy.model.embed_tokens.weight, before)


def test_gradients_reach_the_backbone(policy, tok) -> None:
    critic = ValueModel.from_causal_lm(policy).train()
    ids, mask = _batch(tok)
    # Zero head: only the head gets gradient on the first step.
    critic(ids, mask).sum().backward()
    assert critic.value_head.weight.grad.abs().sum() > 0
    assert critic.backbone.embed_tokens.weight.grad is None or critic.backbone.embed_tokens.weight.grad.abs().sum() == 0
    critic.zero_grad()
    with torch.no_grad():
        critic.value_head.weight.fill_(0.1)
    critic(ids, mask).sum().backward()
    assert critic.backbone.embed_tokens.weight.grad.abs().sum() > 0


def test_left_padding_does_not_change_values(policy, tok) -> None:
    critic = ValueModel.from_causal_lm(policy).eval()
    with torch.no_grad():
        critic.value_head.weight.fill_(0.3)
    ids, mask = _batch(tok)
    alone = tok(["1+2="], return_tensors="pt")
    with torch.no_grad():
        padded = critic(ids, mask)[0, 2:]
        unpadded = critic(alone["input_ids"], alone["attention_mask"])[0]
    torch.testing.assert_close(padded, unpadded, atol=1e-5, rtol=1e-5)


def test_state_dict_round_trip(policy, tok) -> None:
    critic = ValueModel.from_causal_lm(policy).eval()
    with torch.no_grad():
        critic.value_head.weight.normal_()
    other = ValueModel.from_causal_lm(build_tiny_model("qwen3_moe", tok, seed=99)).eval()
    ids, mask = _batch(tok)
    assert not torch.allclose(other(ids, mask), critic(ids, mask))
    other.load_state_dict(critic.state_dict())
    assert torch.equal(other(ids, mask), critic(ids, mask))
