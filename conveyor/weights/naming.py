"""The names a rollout engine loads weights under: MoE experts fused as transformers 5 holds them, or per expert.

transformers 5 fuses each MoE layer's experts into one 3-D tensor per projection; a checkpoint (and so every
engine's checkpoint loader) names them one 2-D tensor per expert. `engine_names` turns the trainer's stream
into the engine's names lazily, one tensor at a time, splitting fused tensors into views (no copy).

What it deliberately does not do: gather, cast or move tensors (`conveyor.weights.stream`), or decide which
layout an engine takes (the engine adapter passes it).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Literal

from torch import Tensor

__all__ = ["Layout", "ExpertNames", "EXPERT_NAMES", "expert_names_for", "split_experts", "engine_names"]

#: How the engine takes MoE experts: "fused", as transformers 5 holds them (one 3-D tensor per projection and
#: layer), or "per_expert", one 2-D tensor per expert under the checkpoint's names (what every engine's
#: checkpoint loader reads, since transformers saves that way).
Layout = Literal["fused", "per_expert"]


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """The checkpoint names of one model family's per-expert tensors, which transformers 5 fuses on load.

    transformers holds `<block>.experts.gate_up_proj` (E, 2I, H), the gate rows then the up rows, and
    `<block>.experts.down_proj` (E, H, I); a checkpoint holds `<ckpt_block>.experts.{e}.<gate|up|down>.weight`.
    `block` is renamed to `ckpt_block` in every name under it (Mixtral's router too).
    """

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    block: str = "mlp"
    ckpt_block: str = "mlp"


#: Per model_type, where transformers' conversion mapping (transformers/conversion_mapping.py, "mixtral" and
#: "qwen2_moe") says the checkpoint differs from the default; families it maps to qwen2_moe use the default.
EXPERT_NAMES: dict[str, ExpertNames] = {
    "mixtral": ExpertNames(gate="w1", up="w3", down="w2", block="mlp", ckpt_block="block_sparse_moe"),
    "minimax": ExpertNames(gate="w1", up="w3", down="w2", block="mlp", ckpt_block="block_sparse_moe"),
}


def expert_names_for(model_type: str | None) -> ExpertNames:
    """The per-expert checkpoint names of `model_type` (the qwen2_moe family's gate_proj/up_proj/down_proj by
    default)."""
    return EXPERT_NAMES.get(model_type or "", ExpertNames())


def split_experts(name: str, tensor: Tensor, names: ExpertNames) -> Iterator[tuple[str, Tensor]] | None:
    """The per-expert tensors (views) of one fused expert tensor in checkpoint names; None if `name` is not one.

    gate_up_proj (E, 2I, H) gives `experts.{e}.<gate>.weight` = rows [:I] and `<up>` = rows [I:] of expert e;
    down_proj (E, H, I) gives `experts.{e}.<down>.weight` = expert e. Both are already (out, in), the
    orientation of the checkpoint's linear layers, so no transpose is needed.
    """
    for fused, parts in (("gate_up_proj", (names.gate, names.up)), ("down_proj", (names.down,))):
        suffix = f".experts.{fused}"
        if not name.endswith(suffix) or tensor.dim() != 3:
            continue
        prefix = _rename_block(name[: -len(suffix)], names)
        if tensor.shape[1] % len(parts):
            raise ValueError(f"{name}: a fused gate/up tensor of shape {tuple(tensor.shape)} has an odd row count")
        rows = tensor.shape[1] // len(parts)
        return (
            (f"{prefix}.experts.{e}.{part}.weight", tensor[e, i * rows : (i + 1) * rows])
            for e in range(tensor.shape[0])
            for i, part in enumerate(parts)
        )
    return None


def _rename_block(name: str, names: ExpertNames) -> str:
    """`name` with its MoE block's module renamed to the checkpoint's (Mixtral: mlp -> block_sparse_moe)."""
    if names.block == names.ckpt_block:
        return name
    return re.sub(rf"(\.layers\.\d+\.){re.escape(names.block)}(\.|$)", rf"\1{names.ckpt_block}\2", name)


def engine_names(
    named: Iterable[tuple[str, Tensor]], *, layout: Layout = "per_expert", model_type: str | None = None
) -> Iterator[tuple[str, Tensor]]:
    """`named` as the engine loads it: fused experts passed through ("fused") or split per expert in checkpoint names.

    With "per_expert" the MoE block's other tensors are renamed too (Mixtral's `mlp.gate` is the checkpoint's
    `block_sparse_moe.gate`); a dense model's tensors pass through unchanged either way.
    """
    if layout not in ("fused", "per_expert"):
        raise ValueError(f"weight sync layout must be 'fused' or 'per_expert', got {layout!r}")
    names = expert_names_for(model_type)
    for name, tensor in named:
        if layout == "fused":
            yield name, tensor
            continue
        split = split_experts(name, tensor, names)
        if split is not None:
            yield from split
        else:
            yield _rename_block(name, names), tensor
