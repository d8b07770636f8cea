"""Packed (padding-free) forwards: the real tokens of several sequences in one row, attention kept within each.

With `actor_rollout_ref.model.use_remove_padding` on, the trainer's Hugging
Face forwards (the update, old and reference log-probs, the critic's values)
do not run on padded rows. A micro-batch's real tokens (each row's prompt and
its response span) are concatenated into one row of T tokens, positions
restarting at 0 for each sequence, and every attention layer attends only
within a sequence. Padding costs nothing then: no projection, MLP, expert or
LM-head work is done for it, and attention costs each sequence's own
length squared, not the batch's longest.

The attention runs through transformers' attention interface under the name
`PACKED_ATTENTION`, registered here. A forward that carries the packed
sequences' boundaries (transformers' own `cu_seq_lens_q` keyword, which the
model's layers hand to their attention function) runs:

- on CUDA in half precision, PyTorch's own flash-attention varlen kernel
  (`torch.nn.attention.varlen.varlen_attn`): one call over all sequences,
  causal, no mask tensor, nothing computed across sequences, its keywords
  built from the installed torch's signature (`VarlenCall`). Chosen over the
  `flash-attn` package (which transformers' `flash_attention_2` needs) because
  it ships with torch, so nothing has to be built for the GPU, and over flex
  attention because it needs no compilation and no block mask;
- elsewhere (the CPU, float32), transformers' SDPA attention per sequence,
  causal and unmasked, sequences of one length batched into one call: the
  same kernels the padded path uses, without the padded columns.

Any other forward (the hf rollout's generation, a forward with a padding
mask) goes to transformers' SDPA attention and mask unchanged, so setting the
implementation on a model changes nothing but packed forwards.

`PackedRows` maps a padded micro-batch to its packed row and back: which
padded positions are real, where each response token's predicting position
lies in the packed row, and how recorded or replayed routing (B, S, L, K)
follows the tokens, so that each packed token is replayed the experts
recorded for it.

What it deliberately does not do: choose micro-batches (`conveyor.workers.
batching`) or compute losses; pack models with sliding-window or
non-standard attention (`packing_unsupported_reason` says why).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "PACKED_ATTENTION",
    "PackedRows",
    "packing_unsupported_reason",
    "resolve_remove_padding",
    "enable_packing",
    "setup_packing",
    "sdpa_compatible",
    "REMOVE_PADDING_KEY",
    "SEQUENCE_EXCHANGE",
    "VarlenCall",
    "varlen_call",
]

#: The setting that turns packed forwards on (verl's name), for messages.
REMOVE_PADDING_KEY = "actor_rollout_ref.model.use_remove_padding"

logger = logging.getLogger(__name__)

#: The attention implementation name packed forwards run under (registered with transformers on import).
PACKED_ATTENTION = "conveyor_packed"

# The per-call plan of a packed forward, kept on its `cu_seq_lens_q` tensor so that each layer reuses it
# (one host read of the boundaries per forward, not per layer).
_PLAN_ATTR = "_conveyor_packed_groups"

#: The attribute of a packed forward's `cu_seq_lens_q` that holds a sequence-parallel head exchange (an object
#: with `to_heads(x)` and `to_tokens(out)`): the attention then runs between the two. It rides on the bounds,
#: not on a context, so that activation checkpointing's recomputation in the backward exchanges too.
SEQUENCE_EXCHANGE = "_conveyor_sequence_exchange"


@dataclass(frozen=True)
class VarlenCall:
    """One torch release's causal `varlen_attn` call over packed sequences, its keywords read from its signature.

    The call moved between releases: torch 2.10 is made causal by `is_causal`, 2.11 and later by
    `window_size=(-1, 0)`; only some releases take `enable_gqa` (2.13 refuses grouped key/value heads without
    it, 2.11 has no such keyword and its flash kernel takes grouped heads as they are). A keyword the installed
    release lacks is a TypeError at the first packed forward on a GPU, so nothing here is assumed from the
    release this was written against.
    """

    fn: Callable[..., Tensor]
    causal: tuple[tuple[str, Any], ...]
    takes_gqa: bool

    @classmethod
    def of(cls, fn: Callable[..., Tensor], signature: inspect.Signature | None = None) -> VarlenCall | None:
        """The call `signature` (by default `fn`'s own) allows; None when it cannot be made causal and scaled."""
        params = (signature if signature is not None else inspect.signature(fn)).parameters
        if "scale" not in params:  # torch 2.9: transformers' scaling could not be passed on
            return None
        if "window_size" in params:
            causal: tuple[tuple[str, Any], ...] = (("window_size", (-1, 0)),)
        elif "is_causal" in params:
            causal = (("is_causal", True),)
        else:
            return None
        return cls(fn, causal, "enable_gqa" in params)

    def arguments(
        self, query: Tensor, key: Tensor, value: Tensor, cu: Tensor, max_len: int, scale: float | None
    ) -> tuple[tuple, dict[str, Any]]:
        """The (args, kwargs) over `query` (T, H, D), `key`/`value` (T, Hkv, D) and the boundaries `cu` (N+1,)."""
        kwargs: dict[str, Any] = {"scale": scale, **dict(self.causal)}
        if self.takes_gqa:
            kwargs["enable_gqa"] = key.shape[1] != query.shape[1]
        # Keys share the queries' boundaries (self-attention). Passing them, not None, is required: the flash
        # forward takes both boundaries or neither, and the backward's schema has a Tensor for the key side.
        return (query, key, value, cu, cu, max_len, max_len), kwargs

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scale: float | None) -> Tensor:
        """Causal attention within each sequence of `cu` over (1, H, T, D) query/key/value; (1, T, H, D) out."""
        longest = max(length for length, _ in _length_groups(cu))
        args, kwargs = self.arguments(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            cu.to(device=query.device, dtype=torch.int32),
            longest,
            scale,
        )
        return self.fn(*args, **kwargs)[None]


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.9
        return None
    return varlen_attn


@functools.cache
def varlen_call() -> VarlenCall | None:
    """The installed torch's causal `VarlenCall`, read once; None where it has no usable `varlen_attn`."""
    varlen_attn = _varlen_attn()
    if varlen_attn is None:
        return None
    call = VarlenCall.of(varlen_attn)
    if call is None:
        logger.info(
            "torch %s's varlen_attn takes no scale or causal keyword; packed forwards run SDPA per sequence",
            torch.__version__,
        )
    return call


def _length_groups(cu: Tensor) -> list[tuple[int, list[int]]]:
    """(length, start offsets) of the sequences delimited by `cu` (N+1,), grouped by length."""
    plan = getattr(cu, _PLAN_ATTR, None)
    if plan is None:
        bounds = cu.tolist()
        groups: dict[int, list[int]] = {}
        for start, stop in zip(bounds[:-1], bounds[1:]):
            groups.setdefault(stop - start, []).append(start)
        plan = sorted(groups.items())
        setattr(cu, _PLAN_ATTR, plan)
    return plan


def packed_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """Attention within each packed sequence when `cu_seq_lens_q` is given; transformers' SDPA attention otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if cu is None or attention_mask is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"a packed forward takes one row of packed tokens, got a batch of {query.shape[0]} rows")
    exchange = getattr(cu, SEQUENCE_EXCHANGE, None)
    if exchange is None:
        return _packed_attention(module, query, key, value, cu, dropout, scaling, kwargs), None
    # Sequence parallel: this rank's tokens with every head in, the whole row with this rank's heads attended.
    query, key, value = exchange.to_heads(query), exchange.to_heads(key), exchange.to_heads(value)
    return exchange.to_tokens(_packed_attention(module, query, key, value, cu, dropout, scaling, kwargs)), None


def _packed_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu: Tensor,
    dropout: float,
    scaling: float | None,
    kwargs: dict,
) -> Tensor:
    """Causal attention within each sequence of `cu` over (1, H, T, D) query/key/value; (1, T, H, D) out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    varlen = varlen_call()
    if (
        varlen is not None
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and not (module.training and dropout)
    ):
        return varlen(query, key, value, cu, scaling)
    # (1, H, T, D) -> per length l: (n, H, l, D) for the n sequences of that length, one causal SDPA call each.
    total = query.shape[2]
    out = query.new_empty(1, total, query.shape[1], value.shape[-1])
    for length, starts in _length_groups(cu):
        index = (
            torch.tensor(starts, device=query.device)[:, None] + torch.arange(length, device=query.device)[None, :]
        )  # (n, l)
        flat = index.reshape(-1)

        def gather(x: Tensor, n: int = len(starts)) -> Tensor:
            return x[0][:, flat].reshape(x.shape[1], n, length, x.shape[-1]).transpose(0, 1)

        part, _ = sdpa_attention_forward(
            module,
            gather(query),
            gather(key),
            gather(value),
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
            **kwargs,
        )  # (n, l, H, D)
        out[0, flat] = part.reshape(-1, *part.shape[2:])
    return out


def packed_attention_mask(*args, attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """No mask for a forward without a padding mask (packed: the attention keeps to each sequence); SDPA's otherwise."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_attention_mask)


_register()


def sdpa_compatible(config) -> bool:
    """Whether `config`'s attention runs as transformers' SDPA does for padded forwards (sdpa or the packed one)."""
    return getattr(config, "_attn_implementation", None) in ("sdpa", PACKED_ATTENTION)


def _configs(model: nn.Module) -> list:
    config = getattr(model, "config", None)
    if config is None:
        return []
    subs = [getattr(config, name, None) for name in getattr(config, "sub_configs", {}) or {}]
    return [config, *[c for c in subs if c is not None]]


def packing_unsupported_reason(model: nn.Module) -> str | None:
    """Why `model`'s forwards cannot run packed, or None when they can."""
    configs = _configs(model)
    if not configs:
        return f"{type(model).__name__} has no Hugging Face config"
    config = configs[0]
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager", None, PACKED_ATTENTION):
        return f"it runs attention implementation {impl!r}, not sdpa"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "the model uses sliding-window attention"
    if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or [])):
        return "the model has layers without full attention"
    attn = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if not attn:
        return "no self_attn modules were found"
    if any(not getattr(m, "is_causal", True) for m in attn):
        return "the model has non-causal attention layers"
    return None


def resolve_remove_padding(choice: bool | None, model: nn.Module, key: str) -> bool:
    """Whether `model`'s forwards run packed: `choice` None = where the model supports it, True = required."""
    if choice is False:
        return False
    reason = packing_unsupported_reason(model)
    if reason is None:
        return True
    if choice:
        raise ValueError(f"{key}=true cannot pack this model's forwards: {reason}; set {key}=false")
    logger.info("%s=null runs padded forwards: %s", key, reason)
    return False


def enable_packing(model: nn.Module) -> None:
    """Run `model`'s attention under `PACKED_ATTENTION` (packed forwards; every other forward as SDPA runs it)."""
    for config in _configs(model):
        config._attn_implementation = PACKED_ATTENTION


def setup_packing(model: nn.Module, choice: bool | None) -> bool:
    """Set `model` up for packed forwards when `choice` (use_remove_padding) asks and it can; whether it did."""
    on = resolve_remove_padding(choice, model, REMOVE_PADDING_KEY)
    if on:
        enable_packing(model)
    return on


@dataclass
class PackedRows:
    """One padded micro-batch's packed layout: (B, S) rows of which `real` tokens are packed into a (1, T) row.

    `flat` (T,): the packed tokens' positions in the flattened (B*S) padded layout, row by row;
    `cu_seq_lens` (B+1,): each sequence's start in the packed row; `predict` (N,): the packed positions whose
    outputs predict response tokens, and `rows`, `cols` (N,): those tokens' places in the (B, R) responses.
    """

    batch: int
    seq: int
    flat: Tensor
    cu_seq_lens: Tensor
    max_len: int
    predict: Tensor
    rows: Tensor
    cols: Tensor

    @classmethod
    def from_masks(cls, attention_mask: Tensor, response_span: Tensor) -> PackedRows:
        """The layout of rows whose `attention_mask` (B, P+R) marks real tokens and `response_span` (B, R) responses.

        Prompts are left-padded and responses right-padded (`conveyor.workers.ranks.forward.sequence_inputs`), so a
        row's real tokens are contiguous and response token j is predicted at padded column P - 1 + j.
        """
        batch, seq = attention_mask.shape
        resp = response_span.shape[1]
        fed = attention_mask.bool()
        lengths = fed.sum(-1)
        if bool((lengths == 0).any()):
            raise ValueError("a packed micro-batch has a row without tokens")
        flat = fed.reshape(-1).nonzero().squeeze(-1)
        cu = torch.zeros(batch + 1, dtype=torch.int32, device=attention_mask.device)
        cu[1:] = lengths.cumsum(0)
        packed_at = torch.full((batch * seq,), -1, dtype=torch.long, device=attention_mask.device)
        packed_at[flat] = torch.arange(flat.numel(), device=attention_mask.device)
        rows, cols = response_span.bool().nonzero(as_tuple=True)
        predict = packed_at[rows * seq + (seq - resp - 1) + cols]
        return cls(batch, seq, flat, cu, int(lengths.max()), predict, rows, cols)

    def pack(self, x: Tensor) -> Tensor:
        """(B, S, ...) padded values -> (1, T, ...) of the packed tokens."""
        return x.reshape(self.batch * self.seq, *x.shape[2:])[self.flat][None]

    def unpack(self, x: Tensor, fill: float | int) -> Tensor:
        """(1, T, ...) packed values -> (B, S, ...), `fill` at the padding."""
        out = x.new_full((self.batch * self.seq, *x.shape[2:]), fill)
        out[self.flat] = x[0]
        return out.reshape(self.batch, self.seq, *x.shape[2:])

    def responses(self, x: Tensor, width: int, fill: float = 0.0) -> Tensor:
        """(N, ...) values of the response tokens -> (B, width, ...), `fill` where a row has no response token."""
        out = x.new_full((self.batch, width, *x.shape[1:]), fill)
        out[self.rows, self.cols] = x
        return out

    def bounds(self) -> dict:
        """The sequences' bounds as the keywords transformers hands each attention layer (its varlen names)."""
        cu = self.cu_seq_lens
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": self.max_len, "max_length_k": self.max_len}

    def model_kwargs(self, input_ids: Tensor, position_ids: Tensor) -> dict:
        """The keywords of a Hugging Face forward over the packed row (no padding mask; the sequences' bounds)."""
        return {
            "input_ids": self.pack(input_ids),
            "position_ids": self.pack(position_ids),
            "attention_mask": None,
            **self.bounds(),
        }
