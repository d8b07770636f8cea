"""Token log-probabilities and entropies straight from hidden states: the LM head fused in, no (N, V) tensor.

`conveyor.algos.logprob` reduces given logits block by block, but the logits
themselves, (N, V) in the model's dtype, and their gradient of the same size
are still whole tensors. For a long response and a large vocabulary they are
the largest tensors of an update (16k tokens x 151,936 vocabulary is 10 GB in
float32, and as much again for the gradient). Here the LM head's matmul runs
inside the blocks: each block of tokens (and, when asked, of the vocabulary)
computes its logits, reduces them to per-token numbers and drops them. The
forward keeps only the hidden states, the weight and two numbers per token
(the log-sum-exp and, for entropy, the expected logit); the backward
recomputes each block's logits and turns them straight into the gradients of
the hidden states and the weight. Peak extra memory is one block of logits
plus, for low-precision weights, one float32 accumulator of the weight's
gradient.

The arithmetic per token is the current path's: logits = hidden @ weight.T
(+ bias) in the weight's dtype, upcast to float32 (float64 stays float64),
divided by the temperature, then log-softmax and entropy; results match
`logprobs_and_entropy(F.linear(hidden, weight, bias), ...)` within float
rounding, gradients included. Splitting the vocabulary merges per-block
log-sum-exps online (the same numbers, summed in another order).

When asked, the forward also gives Σ_v π_v² of each token's distribution (the
optimal token baselines read it), summed block by block like the entropy's
expected logit: over a split vocabulary a running sum of exp(2(z - lse)),
rescaled by exp(2(old lse - new lse)) as the normaliser moves. It is data for
the estimator, written by a no-grad forward, so it carries no gradient.

A rollout's top-k / top-p / min-p mask (`truncation`, `conveyor.algos.sampling_mask`) is applied to
each block after the temperature; the blocks then span the whole vocabulary (a row's mask needs all
of its logits), so one block is (rows, V), never (N, V).

It deliberately does not shift labels, mask positions or know which module
holds the weight: hidden states, a weight and labels in, per-token numbers
out (`conveyor.models.fused_head` puts it in place of a model's LM head).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from conveyor.algos.sampling_mask import Truncation, truncate

__all__ = ["fused_linear_logprobs", "DEFAULT_FUSED_CHUNK_ELEMENTS", "fused_chunk_shape"]

# Logit elements per block: about 64 MiB of float32, large enough for an efficient matmul,
# small next to the (N, V) logits of a long response.
DEFAULT_FUSED_CHUNK_ELEMENTS = 1 << 24


def fused_chunk_shape(tokens: int, vocab: int, chunk_elements: int, vocab_chunk: int | None) -> tuple[int, int]:
    """(token rows, vocabulary columns) of one block: the columns `vocab_chunk` (None: all), rows to fill the budget."""
    cols = vocab if vocab_chunk is None else max(1, min(int(vocab_chunk), vocab))
    rows = max(1, min(tokens, chunk_elements // cols)) if tokens else 1
    return rows, cols


def _spans(total: int, step: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, step):
        yield start, min(start + step, total)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _block_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, temperature: float
) -> torch.Tensor:
    """One block's logits (rows, cols): the LM head in the weight's dtype, then upcast and divided by T."""
    z = F.linear(h, weight, bias).to(dtype)
    return z / temperature if temperature != 1.0 else z


class _FusedLinearLogProb(torch.autograd.Function):
    """Blockwise LM head + label log-prob (+ entropy), recomputing each block's logits in the backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        with_entropy: bool,
        with_sum_pi_squared: bool,
        rows: int,
        cols: int,
        temperature: float,
        truncation: Truncation | None,
    ) -> tuple[torch.Tensor, ...]:
        tokens, vocab = hidden.shape[0], weight.shape[0]
        dtype = _compute_dtype(weight)
        log_probs = torch.empty(tokens, dtype=dtype, device=hidden.device)
        lse = torch.empty_like(log_probs)
        expected = torch.empty_like(log_probs) if with_entropy else None
        spp = torch.empty_like(log_probs) if with_sum_pi_squared else None
        for t0, t1 in _spans(tokens, rows):
            h, y = hidden[t0:t1], labels[t0:t1]
            if cols >= vocab:  # the whole vocabulary in one block: exactly the unfused arithmetic
                z = truncate(_block_logits(h, weight, bias, dtype, temperature), truncation, y)
                block_lse = torch.logsumexp(z, dim=-1)
                label_logit = torch.gather(z, -1, y[:, None]).squeeze(-1)
                if expected is not None:
                    p = torch.exp(z - block_lse[:, None])
                    # p == 0 only where z == -inf; 0 * -inf would be NaN.
                    expected[t0:t1] = torch.where(p > 0, p * z, torch.zeros((), dtype=dtype, device=z.device)).sum(-1)
                if spp is not None:
                    spp[t0:t1] = torch.exp(2.0 * (z - block_lse[:, None])).sum(-1)
                lse[t0:t1] = block_lse
                log_probs[t0:t1] = label_logit - block_lse
                continue
            assert truncation is None, "a sampling mask needs each row's whole vocabulary in one block"
            run_lse = torch.full((t1 - t0,), -math.inf, dtype=dtype, device=hidden.device)
            run_mean = torch.zeros_like(run_lse)  # sum of p * z under the running normaliser
            run_spp = torch.zeros_like(run_lse)  # sum of p² under the running normaliser
            label_logit = torch.zeros_like(run_lse)
            for v0, v1 in _spans(vocab, cols):
                z = _block_logits(h, weight[v0:v1], None if bias is None else bias[v0:v1], dtype, temperature)
                new_lse = torch.logaddexp(run_lse, torch.logsumexp(z, dim=-1))
                inside = (y >= v0) & (y < v1)
                picked = torch.gather(z, -1, (y - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(-1)
                label_logit = torch.where(inside, picked, label_logit)
                if expected is not None:
                    p = torch.exp(z - new_lse[:, None])
                    block_sum = torch.where(p > 0, p * z, torch.zeros((), dtype=dtype, device=z.device)).sum(-1)
                    # Rescale what was summed under the old normaliser; exp(-inf) = 0 before the first block, and
                    # 0, not NaN, while every logit so far is -inf (both normalisers -inf).
                    run_mean = run_mean * torch.exp(run_lse - new_lse).nan_to_num(0.0) + block_sum
                if spp is not None:
                    # p² scales with the square of the normaliser's change (NaN while both are -inf: nothing summed).
                    carry = torch.exp(2.0 * (run_lse - new_lse)).nan_to_num(0.0)
                    run_spp = run_spp * carry + torch.exp(2.0 * (z - new_lse[:, None])).nan_to_num(0.0).sum(-1)
                run_lse = new_lse
            lse[t0:t1] = run_lse
            log_probs[t0:t1] = label_logit - run_lse
            if expected is not None:
                expected[t0:t1] = run_mean
            if spp is not None:
                spp[t0:t1] = run_spp
        ctx.set_materialize_grads(False)
        ctx.with_entropy, ctx.rows, ctx.cols, ctx.temperature = with_entropy, rows, cols, temperature
        ctx.truncation = truncation
        ctx.has_bias = bias is not None
        ctx.save_for_backward(hidden, weight, bias, labels, lse, expected)
        outputs = (log_probs,) if expected is None else (log_probs, lse - expected)
        if spp is None:
            return outputs
        # Data for the estimator, written by a no-grad forward: no gradient flows back through it.
        ctx.mark_non_differentiable(spp)
        return *outputs, spp

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, *grad_outputs: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, lse, expected = ctx.saved_tensors
        grad_lp = grad_outputs[0]
        grad_ent = grad_outputs[1] if ctx.with_entropy else None
        none = (None,) * 7
        if grad_lp is None and grad_ent is None:
            return None, None, None, *none
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        tokens, vocab = hidden.shape[0], weight.shape[0]
        dtype = _compute_dtype(weight)
        zero = torch.zeros((), dtype=dtype, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        # The weight's gradient sums over every token block: in float32 for a low-precision weight, so that
        # the sum over many blocks does not lose what one (N, V) matmul would have kept.
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(vocab, dtype=dtype, device=weight.device) if need_b else None
        for t0, t1 in _spans(tokens, ctx.rows):
            h, y = hidden[t0:t1], labels[t0:t1]
            block_lse = lse[t0:t1, None]
            gl = grad_lp[t0:t1].to(dtype)[:, None] if grad_lp is not None else None
            ge = grad_ent[t0:t1].to(dtype)[:, None] if grad_ent is not None else None
            gh = None
            for v0, v1 in _spans(vocab, ctx.cols):
                w = weight[v0:v1]
                z = _block_logits(h, w, None if bias is None else bias[v0:v1], dtype, ctx.temperature)
                # The forward's mask, recomputed from the same logits (one whole-vocabulary block): no gradient
                # reaches a dropped token.
                z = truncate(z, ctx.truncation, y)
                p = torch.exp(z - block_lse)
                g = torch.zeros_like(z)
                if gl is not None:
                    # d log p_y / dz = onehot(y) - p
                    g = g - p * gl
                    inside = ((y >= v0) & (y < v1))[:, None]
                    g.scatter_add_(-1, (y - v0).clamp(0, v1 - v0 - 1)[:, None], torch.where(inside, gl, zero))
                if ge is not None:
                    # dH / dz = p * (E_p[z] - z)
                    term = torch.where(p > 0, p * (expected[t0:t1, None] - z), zero)
                    g = g + ge * term
                if ctx.temperature != 1.0:
                    g = g / ctx.temperature  # the chain rule through z = logits / T
                g = g.to(weight.dtype)  # the unfused path hands the LM head a gradient in its own dtype
                if grad_h is not None:
                    part = g @ w
                    # One vocabulary block: the unfused product as it is; several: summed in the compute dtype.
                    part = part if ctx.cols >= vocab else part.to(dtype)
                    gh = part if gh is None else gh + part
                if grad_w is not None:
                    grad_w[v0:v1] += (g.t() @ h.to(weight.dtype)).to(dtype)
                if grad_b is not None:
                    grad_b[v0:v1] += g.sum(0).to(dtype)
            if grad_h is not None:
                grad_h[t0:t1] = gh.to(hidden.dtype)
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None and ctx.has_bias else None,
            *none,
        )


@overload
def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = ...,
    with_entropy: bool = ...,
    with_sum_pi_squared: Literal[False] = ...,
    temperature: float = ...,
    truncation: Truncation | None = ...,
    chunk_elements: int | None = ...,
    vocab_chunk: int | None = ...,
) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@overload
def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = ...,
    with_entropy: bool = ...,
    with_sum_pi_squared: Literal[True],
    temperature: float = ...,
    truncation: Truncation | None = ...,
    chunk_elements: int | None = ...,
    vocab_chunk: int | None = ...,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]: ...


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    temperature: float = 1.0,
    truncation: Truncation | None = None,
    chunk_elements: int | None = None,
    vocab_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """log softmax(hidden @ weight.T / T)[label] and entropy, hidden (..., H), weight (V, H) -> (...) float32 each.

    `with_sum_pi_squared`: a third output, Σ_v softmax(hidden @ weight.T / T)_v² per token (what
    `conveyor.algos.logprob.sum_pi_squared_from_logits` gives on the logits), carrying no gradient.
    `chunk_elements`: logit elements per block (default `DEFAULT_FUSED_CHUNK_ELEMENTS`); `vocab_chunk`:
    vocabulary columns per block (None: the whole vocabulary; the token rows then fill the budget).
    `truncation`: the rollout's top-k / top-p / min-p (`conveyor.algos.sampling_mask`), applied to each block of
    rows after the temperature; each block then holds whole rows of the vocabulary (`vocab_chunk` is ignored).
    """
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden (..., H) and weight (V, H) must agree in H, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} but hidden has shape {tuple(hidden.shape)}; "
            "labels must match hidden without the hidden dim"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    temperature = float(temperature)
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    chunk = DEFAULT_FUSED_CHUNK_ELEMENTS if chunk_elements is None else int(chunk_elements)
    if chunk <= 0:
        raise ValueError(f"chunk_elements must be > 0, got {chunk_elements}")
    if vocab_chunk is not None and int(vocab_chunk) <= 0:
        raise ValueError(f"vocab_chunk must be > 0 or None, got {vocab_chunk}")
    lead = hidden.shape[:-1]
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1).long()
    if truncation is not None and not truncation.active:
        truncation = None
    if truncation is not None:
        vocab_chunk = None  # a row's mask needs all of its logits: blocks of rows, never of the vocabulary
    rows, cols = fused_chunk_shape(flat_h.shape[0], weight.shape[0], chunk, vocab_chunk)
    outputs = _FusedLinearLogProb.apply(
        flat_h, weight, bias, flat_y, with_entropy, with_sum_pi_squared, rows, cols, temperature, truncation
    )
    log_probs = outputs[0].reshape(lead)
    entropy = outputs[1].reshape(lead) if with_entropy else None
    if with_sum_pi_squared:
        return log_probs, entropy, outputs[-1].reshape(lead)
    return log_probs, entropy
