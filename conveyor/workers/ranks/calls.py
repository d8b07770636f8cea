"""The per-call parameters of the workers' endpoints, typed: one small frozen dataclass per kind of call.

The trainer builds a call (`GenerateCall(...)`), puts it into the handle with
`meta.with_extra_info(**call.to_extra_info())`, and the worker reads it back
with `GenerateCall.from_extra_info(meta.extra_info)`. What stays the same for
the whole run is not a call parameter: it is in the role's settings
(`conveyor.workers.ranks.settings`), decided once by the run plan.

How call parameters and results share `extra_info`: a call parameter's key is
a plain identifier (`temperature`, `calculate_entropy`, `compute_loss`, the
names the seed protocol uses); a result that a worker sends back, such as a
per-rank metric, is a `section/name` key (`perf/max_memory_allocated_gb`,
`actor/entropy@sum`) and always holds a "/". The parser reads every key
without a "/" as a parameter of its call: a missing one, or one the call does
not have (a misspelt key), is a ValueError naming it. Keys with a "/" are left
alone, so a handle that carries earlier results can be called again.

What it deliberately does not do: carry tensors or anything per sample (those
are fields in the data plane).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["GenerateCall", "LogProbCall", "UpdateCall", "is_call_parameter"]

C = TypeVar("C", bound="_Call")


def is_call_parameter(key: str) -> bool:
    """Whether an extra_info key is a call parameter (a plain name) rather than a result (`section/name`)."""
    return "/" not in key


@dataclasses.dataclass(frozen=True)
class _Call:
    """The parameters of one endpoint call, as extra_info entries."""

    def to_extra_info(self) -> dict[str, Any]:
        """The call's parameters as extra_info entries (pass them to `KVBatchMeta.with_extra_info`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_extra_info(cls: type[C], info: Mapping[str, Any]) -> C:
        """The call in `info`; a ValueError naming the key when a parameter is missing or unknown."""
        names = [f.name for f in dataclasses.fields(cls)]
        given = {k: v for k, v in info.items() if is_call_parameter(k)}
        for key in given:
            if key not in names:
                near = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ValueError(f"{cls.__name__}: unknown call parameter {key!r} in extra_info{hint}; valid: {names}")
        missing = [n for n in names if n not in given]
        if missing:
            raise ValueError(f"{cls.__name__}: extra_info lacks the call parameter(s) {missing}")
        return cls(**given)


@dataclasses.dataclass(frozen=True)
class GenerateCall(_Call):
    """`generate_sequences`: how to sample this batch."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    do_sample: bool
    seed: int | None  # None: the engine's own randomness
    capture_routing: bool  # ask the engine for routed_experts (training batches under the plan's routing)
    pad_to_max_new_tokens: bool  # pad the responses to max_new_tokens columns (batches sharing a partition)
    capture_router_margins: bool = False  # with capture_routing: router_margins too, for the router-health metrics
    min_p: float | None = (
        None  # min-p truncation (training: rollout.min_p; validation: val_kwargs.min_p); None: the rollout's
    )


@dataclasses.dataclass(frozen=True)
class LogProbCall(_Call):
    """`compute_log_prob` (the actor's old log-probs, the reference's ref_log_prob)."""

    temperature: float
    calculate_entropy: bool  # also write `entropy` (the actor only)
    compute_loss: bool = False
    calculate_sum_pi_squared: bool = False  # also write `sum_pi_squared` (the actor only; verl's name)


@dataclasses.dataclass(frozen=True)
class UpdateCall(_Call):
    """`update_actor`: one optimizer step over the handle's samples."""

    temperature: float
    calculate_entropy: bool  # report the entropy of the update's forward (no old-log-prob forward ran)
    compute_loss: bool = True
    moe_metrics: bool = False  # a step with MoE metrics: report each expert's gradient norm
