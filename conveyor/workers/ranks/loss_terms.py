"""The actor's loss, assembled from registered terms: what each reads, and what it adds to one micro-batch's loss.

A term is built once per actor worker from its settings (`LOSS_TERMS`, in
registration order: `policy`, `distillation`, `router_aux`; a builder returns
None where its term is off in this run) and called on every micro-batch of
an update with a `MicroBatch`: the rows, the update forward's log-probs (and
entropy, and logits where a term asks for them), the proximal log-probs and
the mini-batch's normalisers. It returns its loss (None: it reports metrics
only) and its additive metrics. The micro-batch's loss is the terms' losses
summed in registration order; a term that `replaces` drops the loss summed
before it (pure distillation drops the policy loss, as verl does).

A new term is one builder and one `register_loss_term` call (from a
`trainer.plugins` file too): `PolicyWorker.update_actor` does not change.
The math stays in `conveyor.algos`; this module only wires settings to it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from conveyor.algos.objective import compute_policy_objective
from conveyor.registry import registrar
from conveyor.workers.ranks.distill import distill_objective

__all__ = ["MicroBatch", "LossTerm", "LOSS_TERMS", "register_loss_term", "build_loss_terms", "micro_batch_loss"]


@dataclass
class MicroBatch:
    """What a loss term reads of one micro-batch of an update."""

    rows: TensorDict  # the micro-batch's fields (the terms' `fields`, and the forward's)
    loss_mask: torch.Tensor  # (B, R) bool: the tokens in the loss
    log_prob: torch.Tensor  # (B, R) the update forward's, with grad
    old_log_prob: torch.Tensor  # (B, R) the proximal policy's
    entropy: torch.Tensor | None
    logits: torch.Tensor | None  # (B, R, V), where a term needs them
    temperature: float
    num_tokens: float  # the mini-batch's, over every rank
    num_seqs: float
    loss_scale_factor: float | None
    real: bool  # False: a pass made only to pair collectives (its metrics are not kept)
    sums: dict[str, float] = field(default_factory=dict)  # the update's running metric sums


class LossTerm(abc.ABC):
    """One term of the actor's loss."""

    name: str = ""
    fields: tuple[str, ...] = ()  # data-plane fields it reads
    needs_logits: bool = False  # it reads the whole-vocabulary logits
    replaces: bool = False  # its loss replaces the terms' before it instead of adding to them

    @abc.abstractmethod
    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The term's loss on `mb` (None: metrics only) and its additive metrics."""


class PolicyTerm(LossTerm):
    """The PPO-family policy loss with its KL loss and entropy bonus (`conveyor.algos.objective`)."""

    name = "policy"

    def __init__(self, settings: Any, *, counts: bool) -> None:
        a = settings.actor
        self.counts = counts  # False: pure distillation logs it, and trains without it
        self.rollout_is = settings.rollout_is
        self.fields = (
            ("advantages",)
            + (("ref_log_prob",) if a.use_kl_loss else ())
            + (("rollout_log_probs",) if settings.rollout_is is not None else ())
        )
        self.kwargs = dict(
            loss_mode=a.policy_loss.loss_mode,
            clip_ratio_low=a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio,
            clip_ratio_high=a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio,
            clip_ratio_c=a.clip_ratio_c,
            loss_agg_mode=a.loss_agg_mode,
            entropy_coeff=a.entropy_coeff,
            kl_loss_type=a.kl_loss_type,
            kl_loss_coef=a.kl_loss_coef,
            rollout_is=settings.rollout_is,
            rollout_is_threshold=settings.is_threshold,
            rollout_is_threshold_lower=settings.is_threshold_lower,
            policy_loss_kwargs={**a.policy_loss.loss_kwargs(), "tau_pos": a.tau_pos, "tau_neg": a.tau_neg},
        )
        self.use_kl_loss = a.use_kl_loss

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor | None, dict[str, float]]:
        loss, metrics = compute_policy_objective(
            mb.old_log_prob,
            mb.log_prob,
            mb.rows["advantages"],
            mb.loss_mask,
            entropy=mb.entropy,
            ref_log_prob=mb.rows["ref_log_prob"] if self.use_kl_loss else None,
            rollout_log_probs=mb.rows["rollout_log_probs"] if self.rollout_is is not None else None,
            num_tokens=mb.num_tokens,
            num_seqs=mb.num_seqs,
            loss_scale_factor=mb.loss_scale_factor,
            **self.kwargs,
        )
        return (loss if self.counts else None), metrics


class DistillationTerm(LossTerm):
    """On-policy distillation towards the teachers (`conveyor.workers.ranks.distill`)."""

    name = "distillation"

    def __init__(self, settings: Any) -> None:
        self.distill = settings.distill
        self.fields = tuple(self.distill.fields)
        self.needs_logits = bool(self.distill.needs_logits)
        # Pure distillation (use_task_rewards=false) drops the policy loss, as verl does.
        self.replaces = not self.distill.use_task_rewards
        self.loss_agg_mode = settings.actor.loss_agg_mode

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor | None, dict[str, float]]:
        return distill_objective(
            self.distill,
            mb.rows,
            mb.loss_mask,
            mb.log_prob,
            mb.old_log_prob,
            mb.logits,
            mb.temperature,
            loss_agg_mode=self.loss_agg_mode,
            norms={"num_tokens": mb.num_tokens, "num_seqs": mb.num_seqs, "loss_scale_factor": mb.loss_scale_factor},
        )


class RouterAuxTerm(LossTerm):
    """The router's load-balancing auxiliary loss (`conveyor.workers.ranks.router.RouterControls`)."""

    name = "router_aux"

    def __init__(self, controls: Any) -> None:
        self.controls = controls

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor | None, dict[str, float]]:
        # Weighted by the micro-batch's share of the mini-batch's tokens, as the policy loss is; its metrics go
        # straight into the update's sums (kept for real passes only).
        tokens = float(mb.loss_mask.sum())
        return self.controls.aux_loss(tokens, mb.num_tokens, mb.sums if mb.real else None), {}


# A builder: (the actor's settings, the worker) -> its term, or None where the term is off in this run.
TermBuilder = Callable[[Any, Any], "LossTerm | None"]
LOSS_TERMS: dict[str, TermBuilder] = {}
"""Term name -> its builder, in the order the terms' losses are summed."""


def register_loss_term(name: str, builder: TermBuilder, *, overwrite: bool = False) -> TermBuilder:
    """Add a term to every actor's loss from now on (after those registered before it)."""
    return registrar(LOSS_TERMS, name, "loss term", overwrite=overwrite)(builder)


register_loss_term(
    "policy", lambda st, worker: PolicyTerm(st, counts=st.distill is None or st.distill.use_task_rewards)
)
register_loss_term("distillation", lambda st, worker: DistillationTerm(st) if st.distill is not None else None)
register_loss_term(
    "router_aux",
    lambda st, worker: (
        RouterAuxTerm(worker.router_controls)
        if worker.router_controls is not None and worker.router_controls.aux_on
        else None
    ),
)


def build_loss_terms(settings: Any, worker: Any) -> list[LossTerm]:
    """The terms of this run's actor loss, in summing order."""
    terms = [build(settings, worker) for build in LOSS_TERMS.values()]
    return [t for t in terms if t is not None]


def micro_batch_loss(terms: list[LossTerm], mb: MicroBatch) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The terms' summed loss on `mb` (in order; a replacing term drops what came before) and their metrics."""
    loss: torch.Tensor | None = None
    metrics: dict[str, float] = {}
    for term in terms:
        part, m = term(mb)
        metrics.update(m)
        if part is None:
            continue
        loss = part if loss is None or term.replaces else loss + part
    return loss, metrics
