"""Tests for the tiny model configs and their construction."""

from __future__ import annotations

import pytest
import torch

from conveyor.models.moe_routing import moe_info
from conveyor.models.tiny import TINY_ARCHS, build_tiny_model, tiny_config
from conveyor.models.tokenizer import build_char_tokenizer

MOE_ARCHS = [a for a in TINY_ARCHS if a != "qwen3"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_archs_and_default() -> None:
    assert TINY_ARCHS == ("qwen3_moe", "qwen3", "mixtral", "olmoe")
    assert tiny_config(vocab_size=10).model_type == "qwen3_moe"


def test_unknown_arch_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="llama.*qwen3_moe.*qwen3.*mixtral.*olmoe"):
        tiny_config("llama", vocab_size=10)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_config_sizes(arch) -> None:
    cfg = tiny_config(
        arch,
        vocab_size=50,
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=1,
        intermediate_size=48,
        num_experts=4,
        top_k=1,
        max_position_embeddings=100,
    )
    assert cfg.model_type == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (50, 32, 3)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 8)
    assert cfg.max_position_embeddings == 100
    assert cfg.tie_word_embeddings is False
    if arch != "qwen3":
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (4, 1)


def test_qwen3_moe_every_layer_sparse_with_normalised_top_k() -> None:
    cfg = tiny_config("qwen3_moe", vocab_size=20, num_layers=3, intermediate_size=128)
    assert cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == []
    assert cfg.norm_topk_prob is True
    assert cfg.moe_intermediate_size == 64


def test_overrides_are_applied_last() -> None:
    cfg = tiny_config("mixtral", vocab_size=20, rms_norm_eps=1e-3, router_jitter_noise=0.5)
    assert cfg.rms_norm_eps == 1e-3 and cfg.router_jitter_noise == 0.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"vocab_size": 10, "hidden_size": 30, "num_heads": 4}, "hidden_size"),
        ({"vocab_size": 10, "num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
        ({"vocab_size": 10, "num_experts": 2, "top_k": 3}, "top_k"),
    ],
)
def test_bad_sizes_raise(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config("qwen3_moe", **kwargs)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_build_forward_and_token_ids(arch, tok) -> None:
    model = build_tiny_model(arch, tok, num_layers=2)
    assert model.config.vocab_size == len(tok)
    assert (model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id) == (0, 1, 2)
    assert model.generation_config.pad_token_id == 0 and model.generation_config.eos_token_id == 1
    ids = tok(["1+2=", "3*4="], return_tensors="pt")["input_ids"]
    logits = model(input_ids=ids).logits
    assert logits.shape == (2, 4, len(tok)) and torch.isfinite(logits).all()
    info = moe_info(model)
    if arch == "qwen3":
        assert info is None
    else:
        assert (info.num_layers, info.num_experts, info.top_k) == (2, 8, 2)


def test_seeded_init_is_reproducible_and_leaves_global_rng_alone(tok) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model("qwen3_moe", tok, seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    b = build_tiny_model("qwen3_moe", tok, seed=7)
    c = build_tiny_model("qwen3_moe", tok, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_dtype_and_vocab_size(tok) -> None:
    model = build_tiny_model("qwen3", tok, dtype=torch.bfloat16, vocab_size=len(tok) + 6)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.vocab_size == len(tok) + 6
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model("qwen3", tok, vocab_size=len(tok) - 1)
