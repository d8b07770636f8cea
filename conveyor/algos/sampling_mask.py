"""The rollout's sampling mask: which tokens top-k, top-p and min-p keep, by vLLM's rule, on one block of logits.

A rollout that samples with top-k, top-p or min-p draws from a truncated, renormalised
distribution; scoring its tokens under the full softmax puts the kept mass into every importance
ratio. `Truncation` describes the truncation and `truncate` applies it to one block of
temperature-scaled logits (rows, V): what it drops becomes -inf, so any log-softmax, entropy or
Σπ² computed on the result is that of the distribution the rollout sampled from. The log-prob
functions (`conveyor.algos.logprob`, `conveyor.algos.fused_logprob`) call it per block of rows,
with the whole vocabulary in each block (a row's mask needs all of its logits), so no (T, V)
tensor is made for it.

The rule is vLLM's sampler's (`vllm/v1/sample/sampler.py`, `ops/topk_topp_sampler.py`, the min-p
logits processor), in its order: temperature (the caller's), then min-p (drop a token whose
probability is below `min_p` times the row's largest), then top-k (drop a logit below the k-th
largest: ties with the k-th are kept), then top-p over what is left (sort ascending, drop a token
while the cumulative probability up to and including it is at most 1 - top_p; the largest is
always kept, so the token that crosses the boundary stays). Ties inside the top-p boundary follow
the order of the same `sort` call vLLM makes.

`labels`, when given, are always kept: a token the engine sampled was in its mask by definition,
and a mask recomputed under moved weights (a later mini-batch of the update) may have dropped it;
keeping it leaves every log-prob finite. On-policy the label is kept anyway (up to float rounding
at the boundary), so this changes nothing there.

It deliberately does not sample, scale by the temperature, or know which engine sampled.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = ["Truncation", "rollout_truncation", "truncate", "truncated_log_softmax"]


@dataclasses.dataclass(frozen=True)
class Truncation:
    """Top-k (0 or -1: off), top-p (1: off) and min-p (0: off) of a rollout's sampler."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 0 (or -1 for off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0 or not math.isfinite(self.min_p):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def active(self) -> bool:
        """Whether it drops anything at all (for some vocabulary size)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @classmethod
    def of(cls, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Truncation | None:
        """A `Truncation`, or None when nothing would be dropped (the no-op every caller skips)."""
        t = cls(int(top_k), float(top_p), float(min_p))
        return t if t.active else None


def rollout_truncation(rollout: Any) -> Truncation | None:
    """What a rollout config (`actor_rollout_ref.rollout`) samples under: its top-k / top-p / min-p, or None for
    greedy decoding or no truncation."""
    if not rollout.do_sample:
        return None
    return Truncation.of(rollout.top_k, rollout.top_p, getattr(rollout, "min_p", 0.0))


def truncate(z: torch.Tensor, truncation: Truncation | None, labels: torch.Tensor | None = None) -> torch.Tensor:
    """Temperature-scaled logits z (..., V) with the tokens the sampler drops set to -inf; `labels` (...) kept.

    Returns `z` itself when `truncation` is None or drops nothing.
    """
    if truncation is None or not truncation.active:
        return z
    shape = z.shape
    vocab = shape[-1]
    top_k = truncation.top_k if 0 < truncation.top_k < vocab else 0
    if top_k == 0 and truncation.top_p >= 1.0 and truncation.min_p <= 0.0:
        return z
    x = z.reshape(-1, vocab)  # every step below is out of place: the caller's logits are never written
    neg_inf = torch.tensor(-math.inf, dtype=x.dtype, device=x.device)
    if truncation.min_p > 0.0:
        # In probabilities, as vLLM's min-p processor compares them (not in logits).
        probs = torch.softmax(x, dim=-1)
        x = torch.where(probs < probs.amax(dim=-1, keepdim=True) * truncation.min_p, neg_inf, x)
    if truncation.top_p >= 1.0:
        if top_k:  # vLLM's top-k-only path: no sort, ties with the k-th kept
            kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
            x = torch.where(x < kth, neg_inf, x)
    else:
        x_sort, idx = x.sort(dim=-1, descending=False)
        if top_k:
            kth = x_sort[:, vocab - top_k : vocab - top_k + 1]
            x_sort = torch.where(x_sort < kth, neg_inf, x_sort)
        cum = x_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - truncation.top_p
        drop[:, -1] = False  # at least one: the largest
        x_sort = x_sort.masked_fill(drop, -math.inf)
        x = x.scatter(-1, idx, x_sort)
    if labels is not None:
        rows = labels.reshape(-1, 1).long()
        x = x.scatter(-1, rows, z.reshape(-1, vocab).gather(-1, rows))
    return x.view(shape)


def truncated_log_softmax(
    logits: torch.Tensor, truncation: Truncation | None, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax of the truncated distribution the sampler draws from: logits (..., V) -> float32 (..., V).

    A whole-vocabulary reference (tests, the hf rollout's one decode step); the trainer's log-prob
    functions apply `truncate` block by block instead.
    """
    z = logits.float() if logits.dtype != torch.float64 else logits
    if temperature != 1.0:
        z = z / temperature
    return torch.log_softmax(truncate(z, truncation), dim=-1)
