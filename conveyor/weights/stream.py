"""What the trainer sends: its weights one whole tensor at a time, at the engine's dtype.

`iter_weights` walks a model's state dict, gathering one FSDP2 DTensor at a time (a collective, so every rank
walks the same stream in step); `merged_weights` does the same for a LoRA model with each adapter merged
into its base weight, under the base model's names (the engine serves the base architecture); `cast_weights` casts each
tensor to the dtype the engine holds before it
leaves, so a bf16 engine fed by fp32 masters takes half the bytes on the wire and in its staging.

What it deliberately does not do: apply or train adapters (`conveyor.models.lora`), group tensors into buckets
(`conveyor.weights.buckets`), rename them for an
engine (`conveyor.weights.naming`) or move them anywhere (the transports).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from conveyor.models.lora import ADAPTER, base_key, is_adapter_key

__all__ = ["iter_weights", "merged_weights", "cast_weights"]

# Wrappers that insert a name component into the state dict (activation checkpointing, torch.compile); the
# engine knows the unwrapped names.
_WRAPPER_PARTS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def _full(t: Tensor) -> Tensor:
    """`t` whole: an FSDP2 DTensor gathered (a collective), anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_weights(model: torch.nn.Module, *, device: torch.device | str | None = None) -> Iterator[tuple[str, Tensor]]:
    """(name, whole tensor) of each state-dict entry of `model`, in order, gathering one FSDP2 DTensor at a time.

    Every rank must consume the iterator to the end in step: each DTensor's `full_tensor` is a collective.
    The state dict holds references to the (sharded) parameters, so nothing is gathered before it is
    reached, and a gathered tensor lives only while its consumer holds it. `device` moves each tensor
    there (e.g. "cpu" for a gloo group); names lose wrapper components (`_orig_mod.`, checkpoint wrappers).
    """
    for name, value in model.state_dict(keep_vars=False).items():
        tensor = _full(value).detach()
        if device is not None:
            tensor = tensor.to(device)
        yield _WRAPPER_PARTS.sub(r"\1", name), tensor


def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(base model's name, whole tensor) of each weight with its adapter merged in (W + scale * B @ A), one at a time.

    No adapter tensors. Under fsdp2 each tensor is gathered in turn from the shards (a collective: every rank walks
    the stream to the end, in step) and merged with its adapter at the master weights' precision, so a rank holds
    one whole tensor at a time, never the whole model.
    """
    from peft.tuners.lora import LoraLayer

    adapted = {
        base_key(f"{name}.{getattr(module, 'parameter_name', 'weight')}"): module
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A and not module.disable_adapters
    }
    # The state dict references the (sharded) parameters: nothing is gathered before its turn.
    for key, value in model.state_dict().items():
        if is_adapter_key(key) or "lora_" in key:
            continue
        name = base_key(key)
        with torch.no_grad():
            tensor = _full(value).detach()
            module = adapted.get(name)
            if module is not None:
                tensor = tensor + _full(module.get_delta_weight(ADAPTER)).detach().to(tensor.dtype)
        yield name, tensor


def cast_weights(named: Iterable[tuple[str, Tensor]], dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
    """`named` with every floating-point tensor at `dtype` (None: as they are), one tensor at a time, lazily.

    On the sending side of a sync: an engine that holds bf16 takes fp32 master weights at half the bytes on the
    wire and in its staging, and the full-precision copy of a gathered tensor is dropped as soon as it is cast.
    Integer tensors (counters, indices) keep their dtype; a tensor already at `dtype` is passed as it is (no copy).
    """
    for name, tensor in named:
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor
