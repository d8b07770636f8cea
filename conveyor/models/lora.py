"""LoRA adapters on a loaded causal LM, with PEFT: which layers get them, the base model for free.

`apply_lora(model, rank=..., alpha=..., target_modules=...)` injects PEFT's
LoRA layers into `model` in place (the Hugging Face model object stays the
one the strategy wraps, the routing hooks find and the checkpoints name) and
freezes everything but the adapters; it returns the `PeftModel` around it,
whose `disable_adapter()` runs the base model, the reference policy of a
LoRA run, with no second copy of the weights.

Which layers: `all-linear` is PEFT's (every `nn.Linear` but the LM head),
minus the MoE routers: the router stays the base model's, so the routing that
R3 records and replays is the one the rollout's router computed. In
transformers 5 an MoE layer's experts are fused 3-D parameters, not linear
modules, so `all-linear` leaves them out; naming `experts` in a list of
target modules adds a LoRA per expert on each fused tensor (PEFT's
`target_parameters`, its `ParamWrapper`).

The weights with the adapters merged in, streamed to an engine, are
`conveyor.weights.merged_weights` (weight shipping's, like the plain stream).

What it deliberately does not do: load, shard or save models (the workers
and `conveyor.trainer.export` do), stream weights to an engine
(`conveyor.weights`), or decide whether LoRA is on (the config).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["ADAPTER", "apply_lora", "lora_config", "has_lora", "base_key", "is_adapter_key", "expert_parameter_names"]

ADAPTER = "default"  # PEFT's name of the one adapter a run trains


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The fused expert tensors of `model`'s MoE layers, by their names relative to a decoder layer (sorted)."""
    names = set()
    for name, param in model.named_parameters():
        parts = name.split(".")
        if "experts" in parts and param.dim() == 3:
            i = parts.index("experts")
            # `mlp.experts.gate_up_proj`: PEFT matches target_parameters by the end of the full name.
            names.add(".".join(parts[i - 1 :]) if i > 0 else ".".join(parts[i:]))
    return sorted(names)


def _router_names(model: nn.Module) -> list[str]:
    """Full module names of the MoE routers (kept out of the adapters)."""
    from conveyor.models.moe_routing import moe_layers

    routers = {id(layer.router) for layer in moe_layers(model)}
    return [name for name, module in model.named_modules() if id(module) in routers]


def _suffix(name: str) -> str:
    """The name PEFT matches a linear module by: its last part, or its last two when the last is an index (a
    vision merger's `mlp.0`): a bare `0` would also match every block of a list (`blocks.0`), which is no linear."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def lora_config(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    target_modules: str | Sequence[str],
    base_model_path: str | None = None,
) -> Any:
    """PEFT's `LoraConfig` for `model`: `all-linear` or a list of module names (`experts` = the fused experts)."""
    from peft import LoraConfig

    routers = _router_names(model)
    params: list[str] = []
    if target_modules == "all-linear":
        # Spelled out rather than PEFT's own "all-linear", which on transformers 5 MoE models also wraps the
        # fused experts and the router's weight (as parameters): here it means the linear modules only.
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        modules: Any = sorted(
            {
                _suffix(name)
                for name, m in model.named_modules()
                if isinstance(m, nn.Linear) and m is not output and name not in routers
            }
        )
    else:
        names = list(target_modules)
        modules = [n for n in names if n != "experts"]
        if "experts" in names:
            params = expert_parameter_names(model)
            if not params:
                raise ValueError(
                    "actor_rollout_ref.model.target_modules names experts, but the model has no fused "
                    "expert tensors; remove experts from the list"
                )
        if not modules and not params:
            raise ValueError("actor_rollout_ref.model.target_modules names no layer of this model")
    # Exact names (a regex anchored on each router): the routers of a MoE model are never adapted.
    exclude = "|".join(f"^{n.replace('.', chr(92) + '.')}$" for n in routers) or None
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=modules or None,
        target_parameters=params or None,
        exclude_modules=exclude,
    )
    if base_model_path is not None:
        config.base_model_name_or_path = str(base_model_path)
    return config


def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    target_modules: str | Sequence[str],
    seed: int = 0,
    base_model_path: str | None = None,
) -> Any:
    """Inject LoRA adapters into `model` in place (only they stay trainable); returns the `PeftModel` around it.

    The adapters' initialisation draws from its own generator seeded by `seed`, so every rank of a role
    (and a rerun) starts from the same adapters without touching the global RNG.
    """
    from peft import get_peft_model

    config = lora_config(model, rank=rank, alpha=alpha, target_modules=target_modules, base_model_path=base_model_path)
    devices = [p.device for p in model.parameters()][:1]
    with torch.random.fork_rng(devices=[d for d in devices if d.type == "cuda"]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    assert peft_model.base_model.model is model, "PEFT must adapt the model in place"
    return peft_model


def has_lora(model: nn.Module) -> bool:
    """Whether `model` carries PEFT LoRA layers."""
    from peft.tuners.lora import LoraLayer

    return any(isinstance(m, LoraLayer) for m in model.modules())


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key names an adapter tensor (lora_A / lora_B)."""
    return ".lora_A." in key or ".lora_B." in key


def base_key(key: str) -> str:
    """The base model's name of a wrapped model's state-dict key (PEFT inserts `base_layer` levels)."""
    return key.replace(".base_layer", "")
