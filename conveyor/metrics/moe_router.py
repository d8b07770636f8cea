"""Router health metrics for Mixture-of-Experts training: the quantities that say a routing problem is coming.

The load-balance metrics (`conveyor.metrics.moe_load_balance`) say how the router spreads its load. These say how
fragile its choices are and what the trainer sees of them:

- routing margin: per (token, layer), the gap between the k-th and the (k+1)-th router logit
  (`conveyor.models.moe_routing.router_margin`). A pair within `eps` is a near tie: a rounding difference between
  the rollout's numerics and the trainer's may swap an expert there. Logged as the per-layer near-tie share and a
  histogram of margins over all layers;
- flip rate: per layer, the share of tokens whose top-k set differs between the rollout and the trainer;
- router entropy: per layer, the mean entropy (nats) of the router's softmax (log E is uniform, 0 one-hot);
- dead experts: per layer, experts that got no token over the interval;
- gate mass against assigned load: per layer, the total-variation distance between the router's mean softmax
  (what it would send, softly) and the share of top-k slots each expert received (what it sent);
- per-expert gradient norm: per layer, the largest and smallest over experts of the norm of each expert's
  parameters' gradient.

Everything here is counts and sums over (token, layer) pairs, so it accumulates over steps and ranks exactly. The
functions take tensors and return plain `name -> float` dicts; what runs them (the trainer's metrics stage, the
actor's routing pass) and when (every `moe_load_balance_metrics_interval` steps) is the caller's business.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.data_plane.base import FieldNotFoundError
from conveyor.models.moe_routing import moe_layers

__all__ = [
    "ACTOR_LAYER_FAMILIES",
    "MARGIN_EDGES",
    "ROUTER_MARGINS_FIELD",
    "RouterMarginAccumulator",
    "dead_expert_metrics",
    "expert_grad_norm_metrics",
    "expert_grad_norms",
    "expert_load",
    "flip_counts",
    "gate_load_tv",
    "margin_counts",
    "near_tie_metrics",
    "response_margins",
    "rollout_router_metrics",
    "summarise_layers",
]

ROUTER_MARGINS_FIELD = "router_margins"

# Histogram bin edges of the router margin in logits: [0, 1e-4), [1e-4, 1e-3), ..., [1, inf).
MARGIN_EDGES: tuple[float, ...] = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, math.inf)


def _edge_name(value: float) -> str:
    return "inf" if math.isinf(value) else ("0" if value == 0 else f"{value:.0e}")


def margin_counts(
    margins: torch.Tensor, eps: float, edges: tuple[float, ...] = MARGIN_EDGES
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-layer counts of margins (N, L) (NaN = unknown): (known (L,), near ties < eps (L,), histogram (L, bins)).

    All three are int64 on the CPU. A margin equal to an edge falls in the bin above it.
    """
    margins = margins.float()
    known = ~torch.isnan(margins)
    near = known & (margins < eps)
    inner = torch.tensor(edges[1:-1], dtype=margins.dtype, device=margins.device)
    # bucketize(right=True): the index of the first edge strictly above the value, so [lo, hi) bins.
    bins = torch.bucketize(margins.nan_to_num(0.0), inner, right=True)
    num_bins = len(edges) - 1
    layers = margins.shape[1]
    flat = (bins + torch.arange(layers, device=bins.device) * num_bins)[known]
    hist = torch.bincount(flat.cpu(), minlength=layers * num_bins).view(layers, num_bins)
    return known.sum(dim=0).cpu(), near.sum(dim=0).cpu(), hist


def near_tie_metrics(
    known: torch.Tensor,
    near: torch.Tensor,
    hist: torch.Tensor,
    prefix: str,
    edges: tuple[float, ...] = MARGIN_EDGES,
) -> dict[str, float]:
    """`{prefix}/near_tie/layer_i` (share of pairs within eps), its `/max` and `/avg` over layers, and the
    histogram's shares over all layers as `{prefix}/margin_hist/{lo}_{hi}`; {} when no pair is known."""
    layers = torch.nonzero(known > 0).flatten().tolist()
    if not layers:
        return {}
    shares = [float(near[i]) / float(known[i]) for i in layers]
    out = {f"{prefix}/near_tie/layer_{i}": v for i, v in zip(layers, shares)}
    out[f"{prefix}/near_tie/max"] = max(shares)
    out[f"{prefix}/near_tie/avg"] = sum(shares) / len(shares)
    totals = hist.sum(dim=0).double()
    totals = totals / totals.sum()
    for b, share in enumerate(totals.tolist()):
        out[f"{prefix}/margin_hist/{_edge_name(edges[b])}_{_edge_name(edges[b + 1])}"] = share
    return out


def response_margins(router_margins: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The margins (N, L) of the masked-in response positions: router_margins (B, S, L), response_mask (B, R)."""
    if router_margins.dim() != 3 or response_mask.dim() != 2 or router_margins.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"router_margins {tuple(router_margins.shape)} and response_mask {tuple(response_mask.shape)} do not "
            "fit: expected (B, S, L) and (B, R) with R <= S"
        )
    width = response_mask.shape[1]
    if router_margins.shape[1] < width:
        raise ValueError(f"router_margins has {router_margins.shape[1]} positions, fewer than the response ({width})")
    mask = response_mask.to(device=router_margins.device, dtype=torch.bool)
    return router_margins[:, router_margins.shape[1] - width :][mask]


class RouterMarginAccumulator:
    """Near-tie and histogram counts of the rollout's router margins, summed over the steps between two logs."""

    def __init__(self, eps: float, edges: tuple[float, ...] = MARGIN_EDGES) -> None:
        if not eps > 0:
            raise ValueError(f"the near-tie eps must be > 0, got {eps}")
        self.eps, self.edges = float(eps), edges
        self.known: torch.Tensor | None = None
        self.near: torch.Tensor | None = None
        self.hist: torch.Tensor | None = None

    def update(self, router_margins: torch.Tensor | None, response_mask: torch.Tensor | None) -> bool:
        """Add one batch: router_margins (B, S, L), NaN unknown; response_mask (B, R). True if anything counted."""
        if router_margins is None or response_mask is None:
            return False
        known, near, hist = margin_counts(response_margins(router_margins, response_mask), self.eps, self.edges)
        if int(known.sum()) == 0:
            return False
        if self.known is None or self.known.shape != known.shape:
            self.known, self.near, self.hist = known, near, hist
        else:
            self.known, self.near, self.hist = self.known + known, self.near + near, self.hist + hist
        return True

    def pop_metrics(self, prefix: str) -> dict[str, float]:
        """The metrics of the counts so far ({} when none), then forget them."""
        if self.known is None:
            return {}
        out = near_tie_metrics(self.known, self.near, self.hist, prefix, self.edges)
        self.known = self.near = self.hist = None
        return out

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        """What a checkpoint keeps: the counts since the last log (None each when there are none)."""
        return {"known": self.known, "near": self.near, "hist": self.hist}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Continue from `state_dict()`'s counts (None: none, as a checkpoint written before they were saved)."""
        if state is None or state["known"] is None:
            self.known = self.near = self.hist = None
            return
        known, near, hist = state["known"], state["near"], state["hist"]
        layers, bins = known.shape[0], len(self.edges) - 1
        # A wrong shape would only surface at the next log, steps after the resume: refused now.
        if known.dim() != 1 or tuple(near.shape) != (layers,) or tuple(hist.shape) != (layers, bins):
            raise ValueError(
                f"router margin counts of shapes {tuple(known.shape)}, {tuple(near.shape)}, {tuple(hist.shape)} do "
                f"not fit: expected (L,), (L,) and (L, {bins})"
            )
        self.known, self.near, self.hist = known.long(), near.long(), hist.long()


def dead_expert_metrics(counts: torch.Tensor | None, prefix: str) -> dict[str, float]:
    """From per-layer load counts (L, E): `{prefix}/dead_experts/layer_i` (experts with no token), `/max`, `/sum`."""
    if counts is None or counts.dim() != 2 or counts.numel() == 0:
        return {}
    dead = (counts == 0).sum(dim=1).tolist()
    out = {f"{prefix}/dead_experts/layer_{i}": float(v) for i, v in enumerate(dead)}
    out[f"{prefix}/dead_experts/max"] = float(max(dead))
    out[f"{prefix}/dead_experts/sum"] = float(sum(dead))
    return out


def flip_counts(
    train_ids: torch.Tensor, rollout_ids: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, (flipped, counted) int64 (L,): pairs whose top-k sets differ, over pairs both sides know.

    `*_ids` (B, S, L, K) (-1 unknown), `valid` (B, S) bool. Order within a top-k does not matter.
    """
    if train_ids.shape != rollout_ids.shape or train_ids.dim() != 4 or valid.shape != train_ids.shape[:2]:
        raise ValueError(
            f"flip_counts: train_ids {tuple(train_ids.shape)}, rollout_ids {tuple(rollout_ids.shape)} and valid "
            f"{tuple(valid.shape)} must be (B, S, L, K), (B, S, L, K) and (B, S)"
        )
    train = train_ids.long()
    rollout = rollout_ids.to(device=train.device, dtype=torch.long)
    counted = (train >= 0).all(-1) & (rollout >= 0).all(-1) & valid.to(train.device, torch.bool)[..., None]
    # Ids within one top-k are distinct, so sorted equality is set equality.
    differ = (train.sort(dim=-1).values != rollout.sort(dim=-1).values).any(dim=-1)
    return (differ & counted).sum(dim=(0, 1)).cpu(), counted.sum(dim=(0, 1)).cpu()


def expert_load(ids: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Top-k slots each expert received per layer: ids (N, L, K) (-1 unknown), valid (N,) bool -> (L, E) float64."""
    layers = ids.shape[1]
    ids = ids.long()
    keep = (ids >= 0) & valid.to(ids.device, torch.bool)[:, None, None]
    flat = (ids + torch.arange(layers, device=ids.device)[None, :, None] * num_experts)[keep]
    return torch.bincount(flat, minlength=layers * num_experts).view(layers, num_experts).double()


def gate_load_tv(gate_mass: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
    """Per layer, the total-variation distance between the normalised gate mass and assigned load, both (L, E) -> (L,).

    0: the top-k choice sends each expert the share its softmax gives it; 1: disjoint. NaN for a layer with no token.
    """
    mass = gate_mass.double() / gate_mass.double().sum(dim=1, keepdim=True)
    share = load.double() / load.double().sum(dim=1, keepdim=True)
    return 0.5 * (mass - share).abs().sum(dim=1)


def expert_grad_norms(model: nn.Module) -> torch.Tensor | None:
    """Per MoE layer and expert, the L2 norm of the gradient of that expert's parameters: (L, E) float64 on the CPU.

    An expert's parameters are the block's `experts` tensors whose first dimension is the expert (the fused layout
    of Hugging Face v5). Sharded gradients (FSDP2, expert parallel: DTensors) are reduced to their full per-expert
    sums, a collective of E values per tensor. None when no expert tensor holds a gradient (a frozen or LoRA-adapted
    model whose experts are not trained).
    """
    rows = []
    for layer in moe_layers(model):
        num_experts = int(layer.router.num_experts)
        sq = None
        for param in layer.block.experts.parameters():
            grad = param.grad
            if grad is None or grad.dim() == 0 or grad.shape[0] != num_experts:
                continue
            part = grad.detach().float().pow(2).sum(dim=tuple(range(1, grad.dim())))
            full = getattr(part, "full_tensor", None)
            part = (full() if callable(full) else part).double().cpu()
            sq = part if sq is None else sq + part
        if sq is None:
            return None
        rows.append(sq.sqrt())
    return torch.stack(rows) if rows else None


def expert_grad_norm_metrics(norms: torch.Tensor | None, prefix: str) -> dict[str, float]:
    """From (L, E) norms: `{prefix}/expert_grad_norm_{max,min}/layer_i` over experts, and over all layers `/max`,
    `/min`."""
    if norms is None or norms.numel() == 0:
        return {}
    out: dict[str, float] = {}
    for kind, per_layer in (("max", norms.amax(dim=1)), ("min", norms.amin(dim=1))):
        for i, v in enumerate(per_layer.tolist()):
            out[f"{prefix}/expert_grad_norm_{kind}/layer_{i}"] = v
    out[f"{prefix}/expert_grad_norm_max/max"] = float(norms.max())
    out[f"{prefix}/expert_grad_norm_min/min"] = float(norms.min())
    return out


def summarise_layers(metrics: Mapping[str, float], prefix: str, names: Iterable[str]) -> dict[str, float]:
    """For each `{prefix}/{name}/layer_i` family in `metrics`: `{prefix}/{name}/max` and `/avg` over its layers."""
    out = {}
    for name in names:
        head = f"{prefix}/{name}/layer_"
        values = [v for k, v in metrics.items() if k.startswith(head) and not math.isnan(v)]
        if values:
            out[f"{prefix}/{name}/max"] = max(values)
            out[f"{prefix}/{name}/avg"] = sum(values) / len(values)
    return out


ACTOR_LAYER_FAMILIES: tuple[str, ...] = ("flip_rate", "near_tie", "router_entropy", "gate_load_tv")


def rollout_router_metrics(
    accumulator: RouterMarginAccumulator,
    kv_batch_get: Callable[..., Any],
    keys: Sequence[str],
    partition_id: str,
    response_mask: torch.Tensor,
    due: bool,
    last_counts: torch.Tensor | None,
) -> dict[str, float]:
    """Add this step's `router_margins` (when the rollout wrote them) to `accumulator`; when `due`, the rollout's
    near-tie and histogram metrics and the dead experts of the interval's load `last_counts` (L, E)."""
    try:
        td = kv_batch_get(keys=keys, partition_id=partition_id, select_fields=[ROUTER_MARGINS_FIELD])
        accumulator.update(td[ROUTER_MARGINS_FIELD], response_mask)
    except FieldNotFoundError:
        pass  # an engine that cannot return router logits (vLLM), or a step whose routing came from the trainer
    if not due:
        return {}
    return {**accumulator.pop_metrics("rollout/moe"), **dead_expert_metrics(last_counts, "rollout/moe")}
