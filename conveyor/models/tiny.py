"""Tiny causal LMs built from config, for CPU runs and tests.

`tiny_config` gives a few-thousand-parameter Hugging Face config of a real
architecture (Qwen3-MoE by default, also dense Qwen3, Mixtral and OLMoE), so
the code paths that real checkpoints take (attention, rotary embeddings, MoE
routing, caches) are exercised on a laptop. `build_tiny_model` instantiates
one with a seeded random init and the special-token ids of a tokenizer.

It deliberately does not download or load weights (that is
`conveyor.models.loading`) and does not tune the architecture for quality:
the models are meant to be small and fast, not good.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3MoeConfig,
)

__all__ = ["TINY_ARCHS", "tiny_config", "build_tiny_model"]

#: The architectures `tiny_config` knows; the first is the default.
TINY_ARCHS: tuple[str, ...] = ("qwen3_moe", "qwen3", "mixtral", "olmoe")


def _common(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        # Qwen3's default head_dim is 128 whatever the hidden size; pin it to
        # hidden/heads so the attention stays as small as the rest.
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False,
        # Some configs default to ids of their real vocabularies, which may lie
        # outside a tiny one; build_tiny_model sets the tokenizer's ids.
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def _qwen3_moe(base: dict[str, Any], intermediate_size: int, num_experts: int, top_k: int) -> PretrainedConfig:
    return Qwen3MoeConfig(
        **base,
        intermediate_size=intermediate_size,
        # Each expert is half the dense MLP width, as in the real model family.
        moe_intermediate_size=max(1, intermediate_size // 2),
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )


def _qwen3(base: dict[str, Any], intermediate_size: int, num_experts: int, top_k: int) -> PretrainedConfig:
    return Qwen3Config(**base, intermediate_size=intermediate_size)


def _mixtral(base: dict[str, Any], intermediate_size: int, num_experts: int, top_k: int) -> PretrainedConfig:
    return MixtralConfig(
        **base,
        intermediate_size=intermediate_size,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
    )


def _olmoe(base: dict[str, Any], intermediate_size: int, num_experts: int, top_k: int) -> PretrainedConfig:
    return OlmoeConfig(
        **base,
        intermediate_size=intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
    )


_BUILDERS: dict[str, Callable[..., PretrainedConfig]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen3": _qwen3,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
}
assert tuple(_BUILDERS) == TINY_ARCHS


def tiny_config(
    arch: str = "qwen3_moe",
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    num_experts: int = 8,
    top_k: int = 2,
    max_position_embeddings: int = 512,
    **overrides: Any,
) -> PretrainedConfig:
    """A tiny Hugging Face config of `arch` (one of `TINY_ARCHS`); `overrides` set any config field last."""
    if arch not in _BUILDERS:
        raise ValueError(f"tiny_config: unknown `arch` {arch!r}; choose one of {list(TINY_ARCHS)}")
    if vocab_size <= 0:
        raise ValueError(f"tiny_config: `vocab_size` must be positive, got {vocab_size}")
    if hidden_size % num_heads != 0:
        raise ValueError(f"tiny_config: `hidden_size` ({hidden_size}) must be divisible by `num_heads` ({num_heads})")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"tiny_config: `num_heads` ({num_heads}) must be divisible by `num_kv_heads` ({num_kv_heads})")
    if (hidden_size // num_heads) % 2 != 0:
        raise ValueError(
            f"tiny_config: the head size `hidden_size / num_heads` = {hidden_size // num_heads} must be even "
            "for rotary embeddings"
        )
    if arch != "qwen3" and not 1 <= top_k <= num_experts:
        raise ValueError(f"tiny_config: `top_k` ({top_k}) must be between 1 and `num_experts` ({num_experts})")
    base = _common(vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, max_position_embeddings)
    config = _BUILDERS[arch](base, intermediate_size, num_experts, top_k)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def build_tiny_model(
    arch: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **kw: Any,
) -> PreTrainedModel:
    """A randomly initialised tiny causal LM (seeded, without touching the global RNG); `kw` go to `tiny_config`."""
    if "vocab_size" not in kw:
        kw["vocab_size"] = len(tokenizer)
    if kw["vocab_size"] < len(tokenizer):
        raise ValueError(
            f"build_tiny_model: `vocab_size` {kw['vocab_size']} is smaller than the tokenizer's {len(tokenizer)} tokens"
        )
    config = tiny_config(arch, **kw)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    # A private RNG scope: the same seed gives the same weights, and the
    # caller's global RNG stream is not advanced by model construction.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.to(dtype)
    # Keep generate() from inheriting the defaults of the real model family.
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.pad_token_id = tokenizer.pad_token_id
        gen.eos_token_id = tokenizer.eos_token_id
        gen.bos_token_id = tokenizer.bos_token_id
    return model
