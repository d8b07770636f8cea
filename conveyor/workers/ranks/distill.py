"""What the ranks need for on-policy distillation: the teachers' settings and the student's loss term.

`TeacherSettings` (built by `teacher_settings(cfg, plan)`) is what each rank
of the teacher role (`conveyor.workers.ranks.teacher.TeacherWorker`) is built
from; `DistillSettings` (`distill_settings(cfg)`) is the actor's part: which
loss, which teacher fields it reads, how the term joins the policy loss.
`student_forward` and `distill_objective` are the two calls the actor's update
makes: the first returns the student's logits as well as its log-probs when
the loss needs them, the second the micro-batch's distillation loss and its
additive metrics (`distill/...`, in the `@sum`/`@count` convention of
`conveyor.metrics.reduce`).

What it deliberately does not do: decide whether distillation runs (the run
plan does) or load a teacher (the teacher worker does).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict

from conveyor.algos.distill import distill_token_losses, distillation_term, get_distill_loss
from conveyor.algos.kl import kl_penalty
from conveyor.algos.logprob import logprobs_and_entropy
from conveyor.algos.sampling_mask import Truncation
from conveyor.metrics.reduce import weighted

if TYPE_CHECKING:
    from conveyor.config import Config
    from conveyor.config.plan import RunPlan
    from conveyor.workers.ranks.forward import PolicyForward

__all__ = [
    "distillation_decision",
    "TEACHER_FIELDS",
    "TeacherModel",
    "TeacherSettings",
    "DistillSettings",
    "teacher_settings",
    "distill_settings",
    "student_forward",
    "distill_objective",
]

# What a teacher writes, by what the loss needs: always its log-prob of each sampled token (the KL metrics use it).
TEACHER_FIELDS: dict[str, tuple[str, ...]] = {
    "log_prob": ("teacher_log_probs",),
    "topk": ("teacher_log_probs", "teacher_topk_log_probs", "teacher_topk_ids"),
    "full": ("teacher_log_probs", "teacher_full_log_probs"),
}


@dataclasses.dataclass(frozen=True)
class TeacherModel:
    """One teacher: its name, the teacher_key value it scores (None: every sample), its checkpoint, how it is held."""

    name: str
    key: str | None
    model_path: str
    micro_batch_size: int
    strategy: str | None
    fsdp_config: Any


@dataclasses.dataclass(frozen=True)
class TeacherSettings:
    """The teacher role's worker: its teachers, what it writes, and whether it measures routing agreement."""

    model: Any  # actor_rollout_ref.model (dtype, forward_impl, use_remove_padding, trust_remote_code)
    teachers: tuple[TeacherModel, ...]
    teacher_key: str  # distillation.teacher_key
    needs: str  # what the loss needs (conveyor.algos.distill.DISTILL_NEEDS)
    topk: int
    # The student's routed_experts are on the data plane every step (the plan's routing source is not "none").
    routing_agreement: bool


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """The actor's distillation term (verl's `distillation.distillation_loss`)."""

    loss_mode: str
    needs: str
    use_task_rewards: bool
    coef: float
    use_policy_gradient: bool
    clip_ratio_low: float
    clip_ratio_high: float

    @property
    def fields(self) -> list[str]:
        """The teacher's fields the update reads."""
        return list(TEACHER_FIELDS[self.needs])

    @property
    def needs_logits(self) -> bool:
        """Whether the loss needs the student's logits, not just its log-probs of the sampled tokens."""
        return self.needs != "log_prob"


def distillation_decision(cfg: Config) -> str:
    """The run plan's line: which teachers score which samples, with which loss and how it joins the policy loss."""
    d = cfg.distillation
    loss = d.distillation_loss
    if len(d.teacher_models) == 1:
        ((name, t),) = d.teacher_models.items()
        who = f"teacher {name} ({t.model_path}) scores every sample"
    else:
        who = f"{len(d.teacher_models)} teachers by {d.teacher_key}: " + ", ".join(
            f"{t.key} -> {name}" for name, t in d.teacher_models.items()
        )
    how = "policy gradient on -loss" if loss.use_policy_gradient else "back-propagated"
    mix = (
        f"added to the task's policy loss x {loss.distillation_loss_coef:g}"
        if loss.use_task_rewards
        else "alone (use_task_rewards=false)"
    )
    needs = get_distill_loss(loss.loss_mode).needs
    extra = f", top-{loss.topk}" if needs == "topk" else ""
    where = (
        f"ranks of their own ({d.num_workers} on Ray; distillation.placement=separate)"
        if d.placement == "separate"
        else "in the actor's processes"
    )
    return f"distillation: {who}, {where}; loss {loss.loss_mode}{extra} ({how}), {mix}"


def teacher_settings(cfg: Config, plan: RunPlan) -> TeacherSettings:
    """The teacher role's settings of a run of `cfg` (the plan says whether there is one)."""
    d = cfg.distillation
    teachers = tuple(
        TeacherModel(
            name=name,
            key=t.key if len(d.teacher_models) > 1 else None,
            model_path=str(t.model_path),
            micro_batch_size=t.log_prob_micro_batch_size_per_gpu,
            strategy=t.strategy,
            fsdp_config=copy.deepcopy(t.fsdp_config),
        )
        for name, t in d.teacher_models.items()
    )
    return TeacherSettings(
        model=copy.deepcopy(cfg.actor_rollout_ref.model),
        teachers=teachers,
        teacher_key=d.teacher_key,
        needs=get_distill_loss(d.distillation_loss.loss_mode).needs,
        topk=d.distillation_loss.topk,
        routing_agreement=plan.is_moe and plan.routing_source != "none",
    )


def distill_settings(cfg: Config) -> DistillSettings | None:
    """The actor's distillation term, or None when distillation is off."""
    d = cfg.distillation
    if not d.enabled:
        return None
    loss = d.distillation_loss
    return DistillSettings(
        loss_mode=loss.loss_mode,
        needs=get_distill_loss(loss.loss_mode).needs,
        use_task_rewards=loss.use_task_rewards,
        coef=loss.distillation_loss_coef,
        use_policy_gradient=loss.use_policy_gradient,
        clip_ratio_low=loss.clip_ratio_low,
        clip_ratio_high=loss.clip_ratio_high,
    )


def student_forward(
    forward: PolicyForward,
    mb: TensorDict,
    temperature: float,
    with_entropy: bool,
    routed: torch.Tensor | None,
    needs_logits: bool,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The update's forward: log-probs (B, R), entropy (B, R) or None, and the logits (B, R, V) when `needs_logits`.

    `truncation`: the rollout's sampling mask, replayed on the log-probs (the logits stay the model's own).
    """
    if not needs_logits:
        log_prob, entropy, _ = forward.log_probs(
            mb, temperature, with_entropy, routed, False, train=True, truncation=truncation
        )
        return log_prob, entropy, None
    logits, _ = forward.response_logits(mb, routed, False, train=True)
    log_prob, entropy = logprobs_and_entropy(
        logits, mb["responses"], with_entropy, temperature=temperature, truncation=truncation
    )
    return log_prob, entropy, logits


def distill_objective(
    st: DistillSettings,
    mb: TensorDict,
    mask: torch.Tensor,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    logits: torch.Tensor | None,
    temperature: float,
    *,
    loss_agg_mode: str,
    norms: dict[str, Any],
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's distillation loss (already weighted by its coefficient) and its additive metrics."""
    losses, diag = distill_token_losses(
        st.loss_mode,
        student_log_prob=log_prob,
        teacher_log_prob=mb["teacher_log_probs"],
        student_logits=logits,
        teacher_topk_log_probs=mb.get("teacher_topk_log_probs", None),
        teacher_topk_ids=mb.get("teacher_topk_ids", None),
        teacher_full_log_probs=mb.get("teacher_full_log_probs", None),
        temperature=temperature,
    )
    term = distillation_term(
        losses,
        mask,
        use_policy_gradient=st.use_policy_gradient,
        loss_agg_mode=loss_agg_mode,
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        clip_ratio_low=st.clip_ratio_low,
        clip_ratio_high=st.clip_ratio_high,
        **norms,
    )
    coef = st.coef if st.use_task_rewards else 1.0
    ntok = float(mask.sum())
    zero = torch.zeros((), dtype=torch.float64)

    def token_sum(x: torch.Tensor) -> float:
        return float(torch.where(mask, x.detach().double().cpu(), zero).sum())

    student, teacher = log_prob.detach(), mb["teacher_log_probs"]
    metrics = {"distill/loss@sum": float(term.detach())}
    metrics.update(weighted("distill/token_loss", token_sum(losses), ntok))
    # The student's KL to the teacher on its own samples: k1 is unbiased, k3 is its low-variance estimate.
    metrics.update(weighted("distill/kl_k1", token_sum(kl_penalty(student, teacher, "k1")), ntok))
    metrics.update(weighted("distill/kl_k3", token_sum(kl_penalty(student, teacher, "k3")), ntok))
    if st.loss_mode == "full_reverse_kl":
        metrics.update(weighted("distill/kl_exact", token_sum(losses), ntok))
    for name, value in diag.items():
        metrics.update(weighted(f"distill/{name}", token_sum(value), ntok))
    return coef * term, metrics
