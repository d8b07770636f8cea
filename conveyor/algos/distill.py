"""On-policy distillation losses: how far the student's distribution is from a teacher's, per response token.

The student samples; a teacher scores the sampled tokens; the student is
trained to move towards the teacher. Losses are chosen by name
(`distillation.distillation_loss.loss_mode`, verl's names) from
`DISTILL_LOSSES`, each declaring what it needs from the teacher:

- ``log_prob`` (the single-sample estimators ``k1``/``kl``, ``abs``,
  ``k2``/``mse``, ``k3``/``low_var_kl``): the teacher's log-prob of each
  sampled token, (B, T). The estimate is `kl_penalty(student, teacher)` of
  the sampled token, exactly verl's `kl_penalty`.
- ``topk`` (``forward_kl_topk``): the teacher's top-k log-probs and their
  token ids, (B, T, K); the loss is sum_k p_t(k) (log p_t(k) - log q_s(k))
  over the teacher's top k, clamped at 0, as verl's FSDP loss computes it.
- ``full`` (``full_reverse_kl``): the teacher's log-probs over the whole
  vocabulary, (B, T, V); the loss is the exact reverse KL
  sum_v q_s(v) (log q_s(v) - log p_t(v)) of the student's distribution q_s.

The two modes that need the student's logits run over blocks of rows of the
(B, T, V) logits with a backward that recomputes each block's softmax, as
`conveyor.algos.logprob` does: no float32 copy of the whole logits, and
autograd keeps only (B, T) numbers between forward and backward.

`distillation_term` turns per-token losses into the update's loss term,
either directly (a supervised loss, verl's `use_policy_gradient=false`) or
as a policy gradient whose advantage is the negative loss (verl's
`use_policy_gradient=true`, Thinking Machines' on-policy distillation).

This module deliberately reads no config, never calls a model and does no
distributed reduction: the caller passes the global normalisers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from conveyor.algos.kl import kl_penalty
from conveyor.algos.losses import Normaliser, agg_loss, get_policy_loss
from conveyor.registry import lookup, registrar

__all__ = [
    "DISTILL_LOSSES",
    "DISTILL_NEEDS",
    "DistillLoss",
    "register_distill_loss",
    "get_distill_loss",
    "distill_token_losses",
    "forward_kl_topk",
    "full_reverse_kl",
    "teacher_topk",
    "full_log_probs",
    "distillation_term",
]

# What a loss needs from the teacher, which decides what the teacher writes to the data plane.
DISTILL_NEEDS = ("log_prob", "topk", "full")

# About 64 MiB of float32 per block of logits.
DEFAULT_CHUNK_ELEMENTS = 1 << 24


@dataclasses.dataclass(frozen=True)
class DistillLoss:
    """A registered distillation loss: `fn(**inputs) -> (losses (B, T), metrics)` and what it needs of the teacher."""

    fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    needs: str


DISTILL_LOSSES: dict[str, DistillLoss] = {}


def register_distill_loss(name: str, needs: str, *, overwrite: bool = False) -> Callable[[Callable], Callable]:
    """Register a per-token distillation loss under `name`, needing `needs` (one of `DISTILL_NEEDS`) of the teacher."""
    if needs not in DISTILL_NEEDS:
        raise ValueError(f"a distillation loss needs one of {DISTILL_NEEDS}, got {needs!r}")

    def decorator(fn: Callable) -> Callable:
        registrar(DISTILL_LOSSES, name, "distillation loss", overwrite=overwrite)(DistillLoss(fn, needs))
        return fn

    return decorator


def get_distill_loss(name: str) -> DistillLoss:
    """The registered loss `name` (a ValueError naming `distillation.distillation_loss.loss_mode` otherwise)."""
    return lookup(DISTILL_LOSSES, name, "distillation.distillation_loss.loss_mode")


# --------------------------------------------------------------------------- blocks of logits
def _row_blocks(rows: int, vocab: int, chunk_elements: int) -> Iterator[slice]:
    """Slices of about `chunk_elements` values over the rows of a (rows, V) tensor."""
    per = max(1, chunk_elements // max(vocab, 1))
    for r0 in range(0, rows, per):
        yield slice(r0, r0 + per)


def _upcast(block: torch.Tensor, temperature: float) -> torch.Tensor:
    """A block of logits in float32 (float64 stays), divided by the temperature."""
    z = block.to(torch.float64 if block.dtype == torch.float64 else torch.float32)
    return z / temperature if temperature != 1.0 else z


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _ForwardKLTopK(torch.autograd.Function):
    """sum_k p_k (log p_k - log q(i_k)) with q = softmax(z / T), blockwise, recomputing its backward."""

    @staticmethod
    def forward(ctx: Any, logits, t_lp, ids, temperature, chunk):  # type: ignore[override]
        z_all, n = _flat(logits), logits.shape[:-1].numel()
        t_lp, ids = t_lp.reshape(n, -1), ids.reshape(n, -1)
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        loss = torch.empty(n, dtype=dtype, device=logits.device)
        s_mass = torch.empty_like(loss)
        lse = torch.empty_like(loss)
        p = t_lp.to(dtype).exp()
        for sl in _row_blocks(n, z_all.shape[-1], chunk):
            z = _upcast(z_all[sl], temperature)
            block_lse = torch.logsumexp(z, dim=-1)
            s_lp = torch.gather(z, -1, ids[sl]) - block_lse[:, None]
            lse[sl] = block_lse
            loss[sl] = (p[sl] * (t_lp[sl].to(dtype) - s_lp)).sum(-1)
            s_mass[sl] = s_lp.exp().sum(-1)
        ctx.save_for_backward(logits, ids, p, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(s_mass)
        shape = logits.shape[:-1]
        return loss.reshape(shape), s_mass.reshape(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss, _grad_mass):  # type: ignore[override]
        logits, ids, p, lse = ctx.saved_tensors
        z_all = _flat(logits)
        g_out = grad_loss.reshape(-1)
        grad = torch.empty_like(z_all)
        for sl in _row_blocks(z_all.shape[0], z_all.shape[-1], ctx.chunk):
            z = _upcast(z_all[sl], ctx.temperature)
            q = torch.exp(z - lse[sl, None])
            # d/dz of -sum_k p_k (z_{i_k} - lse) = (sum_k p_k) q - scatter(p)
            g = q * p[sl].sum(-1, keepdim=True)
            g.scatter_add_(-1, ids[sl], -p[sl])
            g = g * g_out[sl, None].to(g.dtype)
            if ctx.temperature != 1.0:
                g = g / ctx.temperature
            grad[sl] = g.to(grad.dtype)
        return grad.reshape(logits.shape), None, None, None, None


class _FullReverseKL(torch.autograd.Function):
    """sum_v q_v (log q_v - log p_v) with q = softmax(z / T), blockwise, recomputing its backward."""

    @staticmethod
    def forward(ctx: Any, logits, t_lp, temperature, chunk):  # type: ignore[override]
        z_all, t_all = _flat(logits), _flat(t_lp)
        n = z_all.shape[0]
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        loss = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty_like(loss)
        for sl in _row_blocks(n, z_all.shape[-1], chunk):
            z = _upcast(z_all[sl], temperature)
            block_lse = torch.logsumexp(z, dim=-1)
            s_lp = z - block_lse[:, None]
            q = s_lp.exp()
            # q == 0 where z == -inf: 0 * -inf would be NaN.
            term = torch.where(q > 0, q * (s_lp - t_all[sl].to(dtype)), torch.zeros((), dtype=dtype, device=z.device))
            loss[sl] = term.sum(-1)
            lse[sl] = block_lse
        ctx.save_for_backward(logits, t_lp, lse, loss)
        ctx.temperature, ctx.chunk = temperature, chunk
        return loss.reshape(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss):  # type: ignore[override]
        logits, t_lp, lse, loss = ctx.saved_tensors
        z_all, t_all = _flat(logits), _flat(t_lp)
        g_out = grad_loss.reshape(-1)
        grad = torch.empty_like(z_all)
        for sl in _row_blocks(z_all.shape[0], z_all.shape[-1], ctx.chunk):
            z = _upcast(z_all[sl], ctx.temperature)
            s_lp = z - lse[sl, None]
            q = s_lp.exp()
            # dKL/dz_j = q_j (log q_j - log p_j - KL)
            g = q * (s_lp - t_all[sl].to(z.dtype) - loss[sl, None])
            g = torch.where(q > 0, g, torch.zeros((), dtype=g.dtype, device=g.device))
            g = g * g_out[sl, None].to(g.dtype)
            if ctx.temperature != 1.0:
                g = g / ctx.temperature
            grad[sl] = g.to(grad.dtype)
        return grad.reshape(logits.shape), None, None, None


def _check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return t


def forward_kl_topk(
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward KL over the teacher's top k: logits (B, T, V), top-k log-probs and ids (B, T, K) -> (loss, student mass).

    The loss (B, T) is verl's (not yet clamped at 0); the student mass (B, T) is the student's probability on
    the teacher's top-k tokens.
    """
    if (
        teacher_topk_ids.shape != teacher_topk_log_probs.shape
        or teacher_topk_ids.shape[:-1] != student_logits.shape[:-1]
    ):
        raise ValueError(
            f"teacher top-k shapes {tuple(teacher_topk_log_probs.shape)} / {tuple(teacher_topk_ids.shape)} do not "
            f"match the student's logits {tuple(student_logits.shape)}"
        )
    return _ForwardKLTopK.apply(
        student_logits, teacher_topk_log_probs, teacher_topk_ids.long(), _check_temperature(temperature), chunk_elements
    )


def full_reverse_kl(
    student_logits: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Exact reverse KL(student || teacher) per token (B, T) from logits (B, T, V) and teacher log-probs (B, T, V)."""
    if teacher_log_probs.shape != student_logits.shape:
        raise ValueError(
            f"the teacher's full log-probs {tuple(teacher_log_probs.shape)} do not match the student's logits "
            f"{tuple(student_logits.shape)} (a teacher with another vocabulary size?)"
        )
    return _FullReverseKL.apply(student_logits, teacher_log_probs, _check_temperature(temperature), chunk_elements)


@torch.no_grad()
def teacher_topk(
    logits: torch.Tensor, k: int, *, temperature: float = 1.0, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k log-probs (B, T, K) float32 and their ids (B, T, K) int64, from its logits (B, T, V)."""
    temperature = _check_temperature(temperature)
    z_all, n = _flat(logits), logits.shape[:-1].numel()
    k = min(int(k), z_all.shape[-1])
    lps = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.long, device=logits.device)
    for sl in _row_blocks(n, z_all.shape[-1], chunk_elements):
        z = _upcast(z_all[sl], temperature)
        top = torch.topk(z, k, dim=-1)
        lps[sl] = (top.values - torch.logsumexp(z, dim=-1, keepdim=True)).float()
        ids[sl] = top.indices
    shape = (*logits.shape[:-1], k)
    return lps.reshape(shape), ids.reshape(shape)


@torch.no_grad()
def full_log_probs(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
) -> torch.Tensor:
    """log softmax(logits / T) over the whole vocabulary (B, T, V), float32, computed a block at a time."""
    temperature = _check_temperature(temperature)
    z_all = _flat(logits)
    out = torch.empty(z_all.shape, dtype=torch.float32, device=logits.device)
    for sl in _row_blocks(z_all.shape[0], z_all.shape[-1], chunk_elements):
        z = _upcast(z_all[sl], temperature)
        out[sl] = (z - torch.logsumexp(z, dim=-1, keepdim=True)).float()
    return out.reshape(logits.shape)


# --------------------------------------------------------------------------- the registered losses
def _estimator(kind: str) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    def loss(*, student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, **_: Any):
        return kl_penalty(student_log_prob, teacher_log_prob, kind), {}

    loss.__doc__ = f"verl's single-sample estimator {kind!r} of the sampled token: kl_penalty(student, teacher)."
    return loss


for _kind in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"):
    register_distill_loss(_kind, "log_prob")(_estimator(_kind))


@register_distill_loss("forward_kl_topk", "topk")
def _forward_kl_topk_loss(
    *,
    student_logits: torch.Tensor,
    teacher_topk_log_probs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    temperature: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's forward_kl_topk: the top-k forward KL, clamped at 0 (top-k masses need not sum to one)."""
    loss, s_mass = forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, temperature=temperature)
    return loss.clamp_min(0.0), {"student_mass": s_mass, "teacher_mass": teacher_topk_log_probs.exp().sum(-1)}


@register_distill_loss("full_reverse_kl", "full")
def _full_reverse_kl_loss(
    *, student_logits: torch.Tensor, teacher_full_log_probs: torch.Tensor, temperature: float = 1.0, **_: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The exact reverse KL over the whole vocabulary."""
    return full_reverse_kl(student_logits, teacher_full_log_probs, temperature=temperature), {}


def distill_token_losses(loss_mode: str, **inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses (B, T) of `loss_mode` and its per-token diagnostics (B, T), from the inputs it needs.

    Inputs by name: `student_log_prob`, `teacher_log_prob` (B, T); `student_logits` (B, T, V);
    `teacher_topk_log_probs`, `teacher_topk_ids` (B, T, K); `teacher_full_log_probs` (B, T, V); `temperature`.
    """
    return get_distill_loss(loss_mode).fn(**inputs)


def distillation_term(
    token_losses: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    use_policy_gradient: bool,
    loss_agg_mode: str = "token-mean",
    log_prob: torch.Tensor | None = None,
    old_log_prob: torch.Tensor | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    num_tokens: Normaliser = None,
    num_seqs: Normaliser = None,
    loss_scale_factor: Normaliser = None,
) -> torch.Tensor:
    """The distillation loss of a micro-batch from its per-token losses (B, T), as verl's `distillation_loss`.

    Supervised (`use_policy_gradient=False`): `token_losses` aggregated by `loss_agg_mode`, gradients through
    them. Policy gradient: PPO's clipped loss (`vanilla`) of `log_prob` against `old_log_prob` (B, T) with the
    per-token advantage `-token_losses` (detached).
    """
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    norms: dict[str, Normaliser] = {"num_tokens": num_tokens, "num_seqs": num_seqs}
    if loss_scale_factor is not None:
        norms["loss_scale_factor"] = loss_scale_factor
    if not use_policy_gradient:
        return agg_loss(token_losses, mask, loss_agg_mode, **norms)
    if log_prob is None or old_log_prob is None:
        raise ValueError("use_policy_gradient needs log_prob and old_log_prob")
    loss, _ = get_policy_loss("vanilla")(
        old_log_prob,
        log_prob,
        -token_losses.detach(),
        mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        **norms,
    )
    return loss
