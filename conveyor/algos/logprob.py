"""Token log-probabilities and entropies from logits, without a full-vocabulary copy.

``log_softmax`` over ``(B, T, V)`` logits allocates another ``(B, T, V)``
tensor (and a float32 one when the logits are bf16), and autograd keeps it
for the backward pass. For a large vocabulary that copy is often the biggest
tensor in the actor update. Here the work runs in blocks of rows: each block
is upcast, reduced to ``(rows,)`` results and dropped; only the per-token
log-sum-exp (and the expected logit, for entropy) is kept, and the backward
pass recomputes each block's softmax. Peak extra memory is one block, plus the
gradient itself, which autograd needs anyway.

Results are float32 (float64 logits stay float64, which lets gradcheck run).
A sampling temperature is applied inside each block (``temperature=``), so
bf16 logits are never divided or upcast as a whole: the only full-size tensor
is the model's own output. So is a rollout's top-k / top-p / min-p mask
(``truncation=``, `conveyor.algos.sampling_mask`): each block of rows is
truncated and renormalised before its log-softmax, and the backward recomputes
the same mask; None (the default) leaves the full softmax, bit for bit.

This module deliberately does not shift labels or mask positions: it maps
logits and labels to per-token numbers and nothing else.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from conveyor.algos.sampling_mask import Truncation, truncate

logger = logging.getLogger(__name__)

__all__ = ["logprobs_from_logits", "entropy_from_logits", "logprobs_and_entropy", "sum_pi_squared_from_logits"]

# About 256 MiB of float32 per block: large enough to keep kernels efficient,
# small next to the logits of a real vocabulary.
DEFAULT_CHUNK_ELEMENTS = 1 << 26

Index = tuple[int | slice, ...]


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for float32 and lower precisions; float64 stays float64."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _blocks(batch: int, length: int, vocab: int, chunk_elements: int) -> Iterator[Index]:
    """Indices into a (B, T, V) tensor, each selecting a view of about ``chunk_elements`` values."""
    rows = max(1, chunk_elements // max(vocab, 1))
    if length == 0:
        return
    if length <= rows:
        # Whole sequences fit: take several batch rows at once (a view for any strides).
        per_block = max(1, rows // length)
        for b0 in range(0, batch, per_block):
            yield (slice(b0, b0 + per_block),)
    else:
        for b in range(batch):
            for t0 in range(0, length, rows):
                yield (b, slice(t0, t0 + rows))


def _block_stats(
    z: torch.Tensor, labels: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For upcast logits ``z`` (..., V): (label log-prob, log-sum-exp, expected logit or None)."""
    lse = torch.logsumexp(z, dim=-1)
    label_logit = torch.gather(z, -1, labels.unsqueeze(-1)).squeeze(-1)
    expected = None
    if with_entropy:
        p = torch.exp(z - lse.unsqueeze(-1))
        # p == 0 only where z == -inf (a masked-out vocabulary entry); 0 * -inf would be NaN.
        expected = torch.where(p > 0, p * z, torch.zeros((), dtype=z.dtype, device=z.device)).sum(-1)
    return label_logit - lse, lse, expected


class _LogProbEntropy(torch.autograd.Function):
    """Blockwise label log-prob (and optionally entropy) with a recomputing backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        labels: torch.Tensor,
        with_entropy: bool,
        chunk_elements: int,
        temperature: float,
        truncation: Truncation | None,
    ) -> tuple[torch.Tensor, ...]:
        batch, length, vocab = logits.shape
        dtype = _compute_dtype(logits)
        log_probs = torch.empty(batch, length, dtype=dtype, device=logits.device)
        lse = torch.empty_like(log_probs)
        expected = torch.empty_like(log_probs) if with_entropy else None
        for idx in _blocks(batch, length, vocab, chunk_elements):
            z = truncate(_scaled(logits[idx], dtype, temperature), truncation, labels[idx])
            lp, block_lse, block_expected = _block_stats(z, labels[idx], with_entropy)
            log_probs[idx] = lp
            lse[idx] = block_lse
            if expected is not None:
                expected[idx] = block_expected
        ctx.set_materialize_grads(False)
        ctx.with_entropy = with_entropy
        ctx.chunk_elements = chunk_elements
        ctx.temperature = temperature
        ctx.truncation = truncation
        ctx.save_for_backward(logits, labels, lse, expected)
        if expected is None:
            return (log_probs,)
        return log_probs, lse - expected

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, *grad_outputs: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        logits, labels, lse, expected = ctx.saved_tensors
        grad_lp = grad_outputs[0]
        grad_ent = grad_outputs[1] if ctx.with_entropy else None
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None, None
        batch, length, vocab = logits.shape
        dtype = _compute_dtype(logits)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for idx in _blocks(batch, length, vocab, ctx.chunk_elements):
            # The same mask as the forward's (recomputed from the same logits): dropped tokens get no gradient.
            z = truncate(_scaled(logits[idx], dtype, ctx.temperature), ctx.truncation, labels[idx])
            p = torch.exp(z - lse[idx].unsqueeze(-1))
            g = torch.zeros_like(z)
            if grad_lp is not None:
                # d log p_y / dz = onehot(y) - p
                gl = grad_lp[idx].to(dtype).unsqueeze(-1)
                g = g - p * gl
                g.scatter_add_(-1, labels[idx].unsqueeze(-1), gl)
            if grad_ent is not None:
                # dH / dz = p * (E_p[z] - z)
                term = p * (expected[idx].unsqueeze(-1) - z)
                term = torch.where(p > 0, term, torch.zeros((), dtype=dtype, device=z.device))
                g = g + grad_ent[idx].to(dtype).unsqueeze(-1) * term
            if ctx.temperature != 1.0:
                g = g / ctx.temperature  # the chain rule through z = logits / T
            grad[idx] = g.to(logits.dtype)
        return grad, None, None, None, None, None


def _scaled(block: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """One block of logits upcast to `dtype` and divided by the temperature (in the upcast precision)."""
    z = block.to(dtype)
    return z / temperature if temperature != 1.0 else z


def _run(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    with_entropy: bool,
    chunk_elements: int | None,
    temperature: float = 1.0,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate shapes, add a batch dim to (N, V) input, and call the autograd function."""
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be (B, T, V) or (N, V), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if labels is None:
        labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    elif labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} but logits has shape {tuple(logits.shape)}; "
            "labels must match logits without the vocabulary dim"
        )
    chunk = DEFAULT_CHUNK_ELEMENTS if chunk_elements is None else int(chunk_elements)
    if chunk <= 0:
        raise ValueError(f"chunk_elements must be > 0, got {chunk_elements}")
    temperature = float(temperature)
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    squeeze = logits.dim() == 2
    if squeeze:
        logits, labels = logits.unsqueeze(0), labels.unsqueeze(0)
    outputs = _LogProbEntropy.apply(logits, labels.long(), with_entropy, chunk, temperature, truncation)
    log_probs = outputs[0]
    entropy = outputs[1] if with_entropy else None
    if squeeze:
        log_probs = log_probs.squeeze(0)
        entropy = entropy.squeeze(0) if entropy is not None else None
    return log_probs, entropy


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_elements: int | None = None,
    temperature: float = 1.0,
    truncation: Truncation | None = None,
) -> torch.Tensor:
    """log softmax(truncate(logits / T))[label] per token: logits (B, T, V), labels (B, T) -> (B, T) float32."""
    log_probs, _ = _run(logits, labels, False, chunk_elements, temperature, truncation)
    return log_probs


def entropy_from_logits(
    logits: torch.Tensor, *, chunk_elements: int | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """Entropy of softmax(logits / T) per token: logits (B, T, V) -> (B, T) float32."""
    _, entropy = _run(logits, None, True, chunk_elements, temperature)
    assert entropy is not None
    return entropy


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    with_entropy: bool,
    *,
    chunk_elements: int | None = None,
    temperature: float = 1.0,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Label log-probs (B, T) and, if ``with_entropy``, entropy (B, T) of softmax(truncate(logits / T)), logits
    (B, T, V); `truncation` None: the full softmax."""
    return _run(logits, labels, with_entropy, chunk_elements, temperature, truncation)


@torch.no_grad()
def sum_pi_squared_from_logits(
    logits: torch.Tensor,
    *,
    chunk_elements: int | None = None,
    temperature: float = 1.0,
    truncation: Truncation | None = None,
) -> torch.Tensor:
    """``Σ_v softmax(logits / T)_v²`` per token: logits (B, T, V) -> (B, T) float32, no gradient.

    Computed as ``exp(logsumexp(2z) − 2 logsumexp(z))`` block by block (no
    full-vocabulary probabilities are kept); the optimal token baselines read it.
    """
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point (B, T, V) tensor, got {logits.dtype} {tuple(logits.shape)}")
    chunk = DEFAULT_CHUNK_ELEMENTS if chunk_elements is None else int(chunk_elements)
    if chunk <= 0:
        raise ValueError(f"chunk_elements must be > 0, got {chunk_elements}")
    temperature = float(temperature)
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    batch, length, vocab = logits.shape
    dtype = _compute_dtype(logits)
    out = torch.empty(batch, length, dtype=dtype, device=logits.device)
    for idx in _blocks(batch, length, vocab, chunk):
        z = truncate(_scaled(logits[idx], dtype, temperature), truncation)
        out[idx] = torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1))
    return out
