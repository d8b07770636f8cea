"""Router load-balance metrics for Mixture-of-Experts rollouts.

The rollout records, for every token it fed through the model, which experts
each MoE layer chose (`routed_experts`: (B, S, L, K) integer ids, `-1` where the
routing is unknown). This module counts those choices over the response
tokens, turns per-layer counts into "violation" figures (how far each expert's
load is from a perfectly even split), accumulates counts across steps between
logging points, and fetches `routed_experts` from the data plane only when a
metric is due, tolerating rollouts that never wrote it.

It deliberately does not capture or replay routing (see
`conveyor.models.moe_routing`), draw plots, or log anywhere: it returns plain
`name -> float` dicts and exposes the raw (L, E) counts for whoever wants them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from conveyor.data_plane.base import FieldNotFoundError

# Reading a model config is the models package's job; the name stays here too, as part of this module's API.
from conveyor.models.moe_config import infer_moe_num_experts

__all__ = [
    "ROUTED_EXPERTS_FIELD",
    "RolloutMoELoadBalanceMetricsAccumulator",
    "compute_moe_lb_metrics",
    "compute_rollout_moe_load_balance_metrics",
    "count_expert_assignments",
    "get_metric_data_with_optional_routed_experts",
    "infer_moe_num_experts",
    "load_balance_metrics_from_counts",
]

logger = logging.getLogger(__name__)

ROUTED_EXPERTS_FIELD = "routed_experts"
DEFAULT_PREFIX = "rollout/moe"


# --------------------------------------------------------------------------- counting


def count_expert_assignments(
    routed_experts: torch.Tensor | None,
    response_mask: torch.Tensor | None,
    num_experts: int | None,
) -> torch.Tensor | None:
    """Expert counts per layer: routed_experts (B, S, L, K), response_mask (B, R) -> (L, E) int64 on CPU, or None.

    A slot counts when its position is a response position with a true mask
    and its id is >= 0. Returns None when an input is missing, `num_experts`
    is not positive, the shapes do not fit (warned), an id is >= `num_experts`
    (warned), or nothing is selected.
    """
    if routed_experts is None or response_mask is None or num_experts is None or num_experts <= 0:
        return None
    if getattr(routed_experts, "is_nested", False) or routed_experts.dim() != 4:
        logger.warning(
            "Skipping MoE load-balance metrics: routed_experts must be a dense (batch, seq_len, num_layers, top_k) "
            "tensor, got shape %s",
            tuple(routed_experts.shape) if not getattr(routed_experts, "is_nested", False) else "nested",
        )
        return None
    if routed_experts.dtype.is_floating_point or routed_experts.dtype.is_complex or routed_experts.dtype == torch.bool:
        logger.warning(
            "Skipping MoE load-balance metrics: routed_experts must hold integer ids, got %s", routed_experts.dtype
        )
        return None
    batch, seq_len, num_layers, top_k = routed_experts.shape
    if response_mask.dim() != 2 or response_mask.shape[0] != batch:
        logger.warning(
            "Skipping MoE load-balance metrics: response_mask of shape %s does not fit routed_experts of shape %s "
            "(expected (batch, response_len) with batch %d)",
            tuple(response_mask.shape),
            tuple(routed_experts.shape),
            batch,
        )
        return None
    response_len = response_mask.shape[1]
    if seq_len < response_len:
        logger.warning(
            "Skipping MoE load-balance metrics: routed_experts seq_len %d is shorter than the response length %d",
            seq_len,
            response_len,
        )
        return None
    if response_len == 0 or num_layers == 0 or top_k == 0:
        return None

    selected = _select_response_rows(routed_experts, response_mask)  # (N, L, K), a fresh tensor we own
    if selected.numel() == 0:
        return None

    lowest, highest = (int(v) for v in torch.aminmax(selected))
    if highest >= num_experts:
        logger.warning(
            "Skipping MoE load-balance metrics: routed_experts holds expert id %d but num_experts is %d",
            highest,
            num_experts,
        )
        return None
    if highest < 0:
        return None  # every selected slot is unknown

    # Layer l owns bins [l * (E + 1), (l + 1) * (E + 1)); its first bin swallows the
    # -1 (unknown) slots, so one bincount over `id + l * (E + 1) + 1` counts every
    # layer at once without filtering -1 out of a large tensor first.
    bins_per_layer = num_experts + 1
    num_bins = num_layers * bins_per_layer
    work_dtype = torch.promote_types(selected.dtype, _smallest_signed_int_dtype(num_bins - 1))
    if selected.dtype != work_dtype:
        selected = selected.to(work_dtype)
    # Ids below -1 would land in the previous layer's bins, and off the CPU only
    # counted ids may cross to the host: both cases drop unknown slots up front.
    drop_unknown = lowest < -1 or (lowest < 0 and selected.device.type != "cpu")
    known = selected >= 0 if drop_unknown else None
    # Offsets laid out per (layer, slot) so the add runs over contiguous rows of
    # L*K values; broadcasting over the middle dim would give it K-long inner loops.
    offsets = torch.arange(1, num_bins, bins_per_layer, dtype=work_dtype, device=selected.device)
    rows = selected.view(selected.shape[0], num_layers * top_k)
    rows.add_(offsets.repeat_interleave(top_k).view(1, num_layers * top_k))
    flat_bins = selected[known] if known is not None else selected.view(-1)
    flat_bins = flat_bins.cpu()
    counts = torch.bincount(flat_bins, minlength=num_bins).view(num_layers, bins_per_layer)
    return counts[:, 1:].contiguous()


def _select_response_rows(routed_experts: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The (N, L, K) routing rows of the masked-in response positions, gathered on routed_experts' device."""
    batch, seq_len, num_layers, top_k = routed_experts.shape
    response_len = response_mask.shape[1]
    mask = response_mask.to(device=routed_experts.device, dtype=torch.bool)
    prompt_len = seq_len - response_len
    if routed_experts.stride(0) == seq_len * routed_experts.stride(1):  # (B, S) merge into one dim as a view
        # Gathering whole (L, K) rows by flat row index copies each row once;
        # it beats boolean indexing of the 4-D view by a wide margin on CPU.
        rows_b, rows_t = mask.nonzero(as_tuple=True)
        rows = rows_b * seq_len + (rows_t + prompt_len)
        return routed_experts.reshape(batch * seq_len, num_layers, top_k).index_select(0, rows)
    return routed_experts[:, prompt_len:][mask]


def _smallest_signed_int_dtype(max_value: int) -> torch.dtype:
    """The narrowest of int16/int32/int64 that holds 0..max_value."""
    for dtype in (torch.int16, torch.int32):
        if max_value <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def load_balance_metrics_from_counts(counts: torch.Tensor | None, prefix: str = DEFAULT_PREFIX) -> dict[str, float]:
    """Violation metrics from per-layer counts: counts (L, E) -> {prefix}/{max,min,avg}_vio/{layer_i,max,avg}.

    Layers with no assignments get no keys and are left out of the cross-layer
    max and mean; no assignments at all gives {}.
    """
    if counts is None or counts.dim() != 2 or counts.numel() == 0:
        return {}
    totals = counts.sum(dim=1)
    layers = torch.nonzero(totals > 0).flatten()
    if layers.numel() == 0:
        return {}
    loads = counts[layers].to(torch.float64)
    mean = (totals[layers].to(torch.float64) / counts.shape[1]).unsqueeze(1)
    vio = (loads - mean) / mean
    per_kind = {
        "max_vio": vio.amax(dim=1),
        "min_vio": vio.amin(dim=1),
        "avg_vio": vio.abs().mean(dim=1),
    }
    metrics: dict[str, float] = {}
    layer_ids = layers.tolist()
    for kind, values in per_kind.items():
        for layer, value in zip(layer_ids, values.tolist()):
            metrics[f"{prefix}/{kind}/layer_{layer}"] = value
        metrics[f"{prefix}/{kind}/max"] = values.max().item()
        metrics[f"{prefix}/{kind}/avg"] = values.mean().item()
    return metrics


def compute_rollout_moe_load_balance_metrics(
    routed_experts: torch.Tensor | None,
    response_mask: torch.Tensor | None,
    num_experts: int | None,
    prefix: str = DEFAULT_PREFIX,
) -> dict[str, float]:
    """Load-balance metrics of one batch: routed_experts (B, S, L, K), response_mask (B, R); {} if nothing counts."""
    counts = count_expert_assignments(routed_experts, response_mask, num_experts)
    return load_balance_metrics_from_counts(counts, prefix)


# --------------------------------------------------------------------------- accumulation


class RolloutMoELoadBalanceMetricsAccumulator:
    """Per-layer expert counts summed over the steps between two metric logs; counts: (L, E) int64 on CPU or None."""

    def __init__(self, model_config: Any | None = None) -> None:
        self.model_config = model_config
        self.counts: torch.Tensor | None = None
        # The counts behind the most recent pop_metrics(), kept for saving per-expert load.
        self.last_counts: torch.Tensor | None = None
        self.num_experts: int | None = None
        self._num_experts_resolved = False
        # First step at which the trainer should ask the data plane for routed_experts again.
        self.routed_experts_retry_step = 0
        self._warned_keys: set[str] = set()

    def warn_skip_once(self, key: str, message: str) -> None:
        """Log `message` as a warning the first time `key` is seen by this accumulator."""
        if key in self._warned_keys:
            return
        self._warned_keys.add(key)
        logger.warning(message)

    def _resolve_num_experts(self) -> int | None:
        """num_experts from model_config, inferred on first use and remembered (also when absent)."""
        if not self._num_experts_resolved:
            self._num_experts_resolved = True
            try:
                self.num_experts = infer_moe_num_experts(self.model_config)
            except ValueError as err:
                self.warn_skip_once("num_experts_invalid", f"Skipping MoE load-balance metrics: {err}")
                self.num_experts = None
            if self.num_experts is None:
                self.warn_skip_once(
                    "num_experts_missing",
                    "Skipping MoE load-balance metrics: the number of experts could not be read from the model "
                    "config (looked for num_experts, n_routed_experts, and num_local_experts for mixtral/gpt_oss)",
                )
        return self.num_experts

    def update(
        self,
        routed_experts: torch.Tensor | None,
        response_mask: torch.Tensor | None,
        num_experts: int | None = None,
    ) -> bool:
        """Add one batch's counts: routed_experts (B, S, L, K), response_mask (B, R); True if anything counted."""
        if routed_experts is None or response_mask is None:
            return False
        if num_experts is None:
            num_experts = self._resolve_num_experts()
        counts = count_expert_assignments(routed_experts, response_mask, num_experts)
        if counts is None:
            return False
        if self.counts is None:
            self.counts = counts
        elif self.counts.shape != counts.shape:
            logger.warning(
                "MoE load-balance counts changed shape from %s to %s (num_layers, num_experts); "
                "dropping the earlier counts and starting again",
                tuple(self.counts.shape),
                tuple(counts.shape),
            )
            self.counts = counts
        else:
            # Not in place: a caller holding an earlier `counts` keeps its snapshot.
            self.counts = self.counts + counts
        return True

    def total_assignments(self) -> int:
        """How many (token, layer, top-k slot) assignments have been counted since the last reset."""
        return 0 if self.counts is None else int(self.counts.sum())

    def compute(self, prefix: str = DEFAULT_PREFIX) -> dict[str, float]:
        """Load-balance metrics of the counts so far ({} when none)."""
        return load_balance_metrics_from_counts(self.counts, prefix)

    def reset(self) -> None:
        """Forget the counts (the warning memory and retry step are kept)."""
        self.counts = None

    def pop_metrics(self, prefix: str = DEFAULT_PREFIX) -> dict[str, float]:
        """compute() then reset()."""
        metrics = self.compute(prefix)
        self.last_counts = self.counts
        self.reset()
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the counts since the last log (L, E) or None, and the routed-experts retry step."""
        return {"counts": self.counts, "retry_step": self.routed_experts_retry_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state_dict()`'s counts and retry step."""
        counts, retry_step = state["counts"], int(state["retry_step"])
        if counts is not None and (not isinstance(counts, torch.Tensor) or counts.dim() != 2):
            raise ValueError(f"MoE load counts must be an (L, E) tensor or None, got {counts!r:.80}")
        self.counts, self.routed_experts_retry_step = counts, retry_step

    def should_request_routed_experts(self, global_steps: int) -> bool:
        """Whether to ask the data plane for routed_experts at this step (False while a retry is deferred)."""
        return global_steps >= self.routed_experts_retry_step

    def defer_routed_experts(self, global_steps: int, interval: int) -> None:
        """Stop asking for routed_experts until step `global_steps + interval`."""
        self.routed_experts_retry_step = global_steps + max(int(interval), 1)


# --------------------------------------------------------------------------- trainer glue


def compute_moe_lb_metrics(
    metrics_batch: Mapping[str, Any] | Any,
    moe_lb_metrics_interval: int,
    global_steps: int,
    accumulator: RolloutMoELoadBalanceMetricsAccumulator,
) -> dict[str, float]:
    """Add this step's counts; every `moe_lb_metrics_interval` steps return the accumulated metrics ({} otherwise)."""
    if moe_lb_metrics_interval <= 0:
        return {}
    getter = getattr(metrics_batch, "get", None)
    if not callable(getter):
        raise ValueError(f"metrics_batch must be a mapping or TensorDict with .get, got {type(metrics_batch).__name__}")
    counted = accumulator.update(
        routed_experts=getter(ROUTED_EXPERTS_FIELD, None),
        response_mask=getter("response_mask", None),
    )
    if global_steps % moe_lb_metrics_interval != 0:
        return {}
    assignments = accumulator.total_assignments()
    metrics = accumulator.pop_metrics()
    metrics[f"{DEFAULT_PREFIX}/routed_experts_found"] = 1.0 if assignments > 0 else 0.0
    metrics[f"{DEFAULT_PREFIX}/routed_expert_assignments"] = float(assignments)
    # One warning per cause: a missing routed_experts field was already reported.
    if not counted and assignments == 0 and "missing_routed_experts" not in accumulator._warned_keys:
        accumulator.warn_skip_once(
            "no_routed_expert_counts",
            "MoE load-balance metrics are enabled but no routed expert assignments were counted "
            "(routed_experts missing, empty, or all -1)",
        )
    return metrics


def _is_missing_routed_experts(err: Exception) -> bool:
    """Whether a data-plane error is about the routed_experts field being absent."""
    if isinstance(err, FieldNotFoundError) and (err.fields or err.keys):
        return ROUTED_EXPERTS_FIELD in err.fields
    # Errors from stores that do not raise FieldNotFoundError only have their text.
    return ROUTED_EXPERTS_FIELD in str(err)


def get_metric_data_with_optional_routed_experts(
    keys: Sequence[str],
    partition_id: str,
    fields: Sequence[str],
    moe_lb_metrics_interval: int,
    global_steps: int,
    accumulator: RolloutMoELoadBalanceMetricsAccumulator,
    kv_batch_get: Callable[..., Any],
) -> Any:
    """kv_batch_get of `fields`, plus routed_experts when MoE metrics are on (if missing: warn once, defer, skip)."""
    fields = list(fields)
    if moe_lb_metrics_interval <= 0 or not accumulator.should_request_routed_experts(global_steps):
        return kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields)
    with_routed = fields if ROUTED_EXPERTS_FIELD in fields else [*fields, ROUTED_EXPERTS_FIELD]
    try:
        return kv_batch_get(keys=keys, partition_id=partition_id, select_fields=with_routed)
    except (LookupError, ValueError) as err:  # FieldNotFoundError is a KeyError
        if not _is_missing_routed_experts(err):
            raise
        missing = err
    # Fetch first: if the plain fields fail too (say the partition is gone), that
    # error propagates and nothing is deferred or blamed on routed_experts.
    fields_alone = [f for f in fields if f != ROUTED_EXPERTS_FIELD]
    data = kv_batch_get(keys=keys, partition_id=partition_id, select_fields=fields_alone)
    accumulator.defer_routed_experts(global_steps, moe_lb_metrics_interval)
    accumulator.warn_skip_once(
        "missing_routed_experts",
        f"Skipping MoE load-balance metrics: {missing}; will ask again at step "
        f"{accumulator.routed_experts_retry_step} (dense models have no routing; for MoE models the rollout "
        "records it when this interval is > 0)",
    )
    return data
