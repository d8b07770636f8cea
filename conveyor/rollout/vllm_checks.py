"""What the vllm rollout engine can serve, checked before anything is built; and its CPU KV-cache sizing.

`check_servable` (a model: its context length, and on a CPU its attention head width and an MoE model's
widths, which vLLM's CPU kernels restrict) and `validate_config` (a run's config) are the engine's hooks
in the registry (conveyor.rollout.base looks them up on conveyor.rollout.vllm, which re-exports them).
`kv_bytes_per_token` sizes a CPU engine's KV cache.

It deliberately does not import vLLM: a config or a model is checked on a machine without it, and the
checks say what to change rather than leaving vLLM to refuse it later.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_servable", "kv_bytes_per_token", "validate_config"]

# What vLLM's CPU build serves. Attention: the head widths its kernels are compiled for (the
# template instantiations in vllm/_C*.so; the Python backend's get_supported_head_sizes omits 48, which
# works); measured, heads 16, 40 and 144 wide start an engine that fails at its first generation. MoE:
# vllm/model_executor/layers/fused_moe/experts/cpu_moe.py, CPUUnquantizedExperts, the portable kernel
# every CPU falls back to, needs the hidden width divisible by its output alignment, and pads the expert
# width up to it.
_CPU_HEAD_SIZES = (32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_CPU_MOE_ALIGNMENT = 32


def check_servable(hf_config: Any, *, device: str, max_model_len: int | None, source: str, length_key: str) -> None:
    """Refuse (ValueError) a model the vllm engine cannot serve on `device`, naming `source` and what to change.

    Checked before anything is built, so that a model vLLM would reject (or fail on at its first
    generation or weight sync) never starts a run: the context length on every device; on a CPU, the
    attention head width and an MoE model's hidden and expert widths, which vLLM's CPU kernels restrict.
    """
    from conveyor.models.loading import max_positions

    found = max_positions(hf_config.to_dict()) if hasattr(hf_config, "to_dict") else None
    if found is not None and max_model_len is not None and max_model_len > found[0]:
        # vLLM would refuse it with its own validation error, naming one of its environment variables.
        raise ValueError(
            f"{length_key} = {max_model_len} tokens is beyond the {found[0]} positions of {source} "
            f"({found[1]} in its config); set it to at most {found[0]}"
        )
    if torch.device(device).type != "cpu":
        return
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
    hidden = int(getattr(hf_config, "hidden_size", 0) or 0)
    head_dim = _head_dim(hf_config) if heads else None
    sizes = _CPU_HEAD_SIZES
    if head_dim is not None and head_dim not in sizes:
        by_width = f"hidden_size {hidden} / num_attention_heads {heads}"
        how = "head_dim" if getattr(hf_config, "head_dim", None) else by_width
        raise ValueError(
            f"{source} has attention heads {head_dim} wide ({how}); vLLM's CPU build serves head widths "
            f"{', '.join(map(str, sizes))} only: use a model with one of those, or the hf rollout "
            "(actor_rollout_ref.rollout.name=hf)"
        )
    from conveyor.metrics.moe_load_balance import infer_moe_num_experts

    if not (infer_moe_num_experts(hf_config) or 0) > 0:
        return
    # The expert width is padded to the alignment at load; a weight sync then sends the unpadded tensors,
    # which the engine cannot take: the run would fail at its first sync, after the first update.
    expert_key = "moe_intermediate_size" if getattr(hf_config, "moe_intermediate_size", None) else "intermediate_size"
    widths = (("hidden_size", hidden), (f"expert width ({expert_key})", getattr(hf_config, expert_key, None)))
    for name, width in widths:
        if width is not None and int(width) % _CPU_MOE_ALIGNMENT:
            raise ValueError(
                f"{source} is an MoE model of {name} {width}; vLLM's CPU expert kernels need it "
                f"divisible by {_CPU_MOE_ALIGNMENT}: use such a model, or the hf rollout "
                "(actor_rollout_ref.rollout.name=hf)"
            )


def _head_dim(hf_config: Any) -> int:
    """The width of one attention head of a model with `hf_config` (its head_dim, else hidden_size / heads)."""
    return int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads)


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype) -> int:
    """Key and value bytes one token occupies in the KV cache of a model with `hf_config`."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = _head_dim(hf_config)
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * size


def validate_config(cfg: Any) -> None:
    """The vllm engine's checks of a config: its context length and, for the tiny model, vLLM's CPU head widths."""
    from conveyor.config.fields import check

    ro, t, data = cfg.actor_rollout_ref.rollout, cfg.trainer, cfg.data
    world = t.nnodes * max(t.n_gpus_per_node, t.num_cpu_workers)
    # Colocated over several trainer ranks, each run of tensor_model_parallel_size consecutive ranks is one replica.
    tp = ro.tensor_model_parallel_size
    check(
        world == 1 or ro.placement == "separate" or world % tp == 0,
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        f"a colocated vllm rollout over {world} trainer ranks makes replicas of tensor_model_parallel_size "
        f"consecutive ranks, so it must divide {world}, got {tp}",
    )
    need = data.max_prompt_length + data.max_response_length
    check(
        ro.max_model_len is None or ro.max_model_len >= need,
        "actor_rollout_ref.rollout.max_model_len",
        f"must hold data.max_prompt_length + data.max_response_length = {need} tokens, got {ro.max_model_len}",
    )
    model = cfg.actor_rollout_ref.model
    if model.path is None:
        tiny = model.tiny
        # vLLM's CPU attention kernels reject smaller heads ("Unsupported CPU attention configuration").
        check(
            tiny.hidden_size // tiny.num_heads >= 32,
            "actor_rollout_ref.model.tiny.num_heads",
            f"the vllm rollout needs a head_dim (hidden_size // num_heads) of at least 32, got "
            f"{tiny.hidden_size} // {tiny.num_heads}: e.g. num_heads=2 num_kv_heads=2 (examples/vllm_cpu.yaml)",
        )
