"""The vllm rollout refuses at start what its engine cannot serve (context length; on a CPU head and MoE widths).

The checks read the model's Hugging Face config only: no engine starts here.
"""

from __future__ import annotations

import pytest

from conveyor.models.tiny import tiny_config
from conveyor.rollout.base import engine_spec
from conveyor.rollout.vllm import check_servable

SOURCE = "checkpoint /m (actor_rollout_ref.model.path)"
KEY = "actor_rollout_ref.rollout.max_model_len"


def _check(config, device: str = "cpu", max_model_len: int = 64) -> None:
    engine_spec("vllm").check_model(config, device=device, max_model_len=max_model_len, source=SOURCE, length_key=KEY)


def test_a_model_the_cpu_build_serves_is_accepted() -> None:
    _check(tiny_config("qwen3_moe", vocab_size=64, hidden_size=64, num_heads=2, num_kv_heads=2))
    _check(tiny_config("qwen3", vocab_size=64, hidden_size=160, num_heads=2, num_kv_heads=2))  # head 80
    _check(tiny_config("qwen3_moe", vocab_size=64, hidden_size=96, num_heads=2, num_kv_heads=2))  # head 48: works


# Measured on vLLM's CPU build: heads 16, 40 and 144 wide start an engine that fails at its first generation.
@pytest.mark.parametrize("hidden, heads", [(64, 4), (160, 4), (288, 2)])
def test_a_head_width_the_cpu_attention_lacks_is_refused_naming_the_checkpoint(hidden: int, heads: int) -> None:
    config = tiny_config("qwen3_moe", vocab_size=64, hidden_size=hidden, num_heads=heads, num_kv_heads=heads)
    with pytest.raises(
        ValueError,
        match=r"checkpoint /m .* heads \d+ wide .* serves head widths 32, 48, 64.*"
        r"actor_rollout_ref.rollout.name=hf",
    ):
        _check(config)
    _check(config, device="cuda")  # a GPU engine has other kernels: not refused here


def test_an_moe_hidden_width_the_cpu_experts_lack_is_refused() -> None:
    config = tiny_config("qwen3_moe", vocab_size=64, hidden_size=80, num_heads=1, num_kv_heads=1)  # head 80: served
    with pytest.raises(ValueError, match="MoE model of hidden_size 80.*divisible by 32"):
        _check(config)
    _check(tiny_config("qwen3", vocab_size=64, hidden_size=80, num_heads=1, num_kv_heads=1))  # dense: no experts


def test_an_expert_width_the_cpu_experts_lack_is_refused() -> None:
    # Measured: vLLM pads 40 to 64 at load and then fails at the first weight sync (128 vs 80 rows).
    config = tiny_config(
        "qwen3_moe", vocab_size=64, hidden_size=64, num_heads=2, num_kv_heads=2, moe_intermediate_size=40
    )
    with pytest.raises(ValueError, match=r"expert width \(moe_intermediate_size\) 40.*divisible by 32"):
        _check(config)
    mixtral = tiny_config("mixtral", vocab_size=64, hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=48)
    with pytest.raises(ValueError, match=r"expert width \(intermediate_size\) 48"):
        _check(mixtral)


def test_a_context_beyond_the_model_is_refused_naming_the_key() -> None:
    config = tiny_config("qwen3_moe", vocab_size=64, num_heads=2, num_kv_heads=2, max_position_embeddings=512)
    for device in ("cpu", "cuda"):
        with pytest.raises(
            ValueError,
            match=rf"{KEY} = 1024 tokens is beyond the 512 positions of checkpoint /m "
            r".*max_position_embeddings=512.*at most 512",
        ):
            _check(config, device=device, max_model_len=1024)
    _check(config, max_model_len=512)


def test_check_servable_takes_the_engine_s_own_arguments() -> None:
    # The hf rollout serves whatever the trainer runs: its module has no check.
    config = tiny_config("qwen3_moe", vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=4)
    engine_spec("hf").check_model(config, device="cpu", max_model_len=None, source=SOURCE, length_key=KEY)
    with pytest.raises(ValueError, match="16 wide"):
        check_servable(config, device="cpu", max_model_len=None, source=SOURCE, length_key=KEY)
