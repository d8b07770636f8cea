"""How many routed experts a model has, read from its config in any of the forms a run meets.

The trainer, the rollout engines and the load-balance metrics all need the number of experts before any
routing is seen: from a Hugging Face config, a dict, an OmegaConf node or a dataclass, and from the places
different frameworks nest it (`hf_config`, `text_config`, `override_config`). This module reads it and
nothing else; what a model's MoE layers are is `conveyor.models.moe_routing`'s.
"""

from __future__ import annotations

from typing import Any

__all__ = ["infer_moe_num_experts"]

# These model types call their routed-expert count `num_local_experts`; in other models that name can mean
# something else (e.g. experts per rank), so it is trusted only here.
_NUM_LOCAL_EXPERTS_MODEL_TYPES = frozenset({"mixtral", "gpt_oss"})
_NUM_EXPERTS_KEYS = ("num_experts", "n_routed_experts")


def _config_get(config: Any, key: str) -> Any:
    """`config.get(key)` for mapping-like configs, else the attribute (None when absent)."""
    if config is None:
        return None
    getter = getattr(config, "get", None)
    if callable(getter):
        return getter(key)
    return getattr(config, key, None)


def _as_expert_count(value: Any, key: str) -> int:
    """An expert count read from a config, as an int; ValueError naming the key otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"model config key {key!r} must be an integer expert count, got {value!r}")
    try:
        as_int = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"model config key {key!r} must be an integer expert count, got {value!r}") from None
    if as_int != value and not isinstance(value, str):
        raise ValueError(f"model config key {key!r} must be an integer expert count, got {value!r}")
    return as_int


def infer_moe_num_experts(model_config: Any) -> int | None:
    """The number of routed experts named by a model config (dict, OmegaConf, dataclass or HF config), or None."""
    if model_config is None:
        return None
    hf_config = _config_get(model_config, "hf_config")
    override_config = _config_get(model_config, "override_config")
    candidates = (
        model_config,
        hf_config,
        _config_get(hf_config, "text_config"),
        _config_get(model_config, "text_config"),
        override_config,
        _config_get(override_config, "model_config"),
        _config_get(override_config, "text_config"),
    )
    for candidate in candidates:
        if candidate is None:
            continue
        for key in _NUM_EXPERTS_KEYS:
            value = _config_get(candidate, key)
            if value is not None:
                return _as_expert_count(value, key)
        if _config_get(candidate, "model_type") in _NUM_LOCAL_EXPERTS_MODEL_TYPES:
            value = _config_get(candidate, "num_local_experts")
            if value is not None:
                return _as_expert_count(value, "num_local_experts")
    return None
