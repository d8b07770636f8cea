"""The `distillation` section: on-policy distillation from one or more frozen teachers, under verl's keys.

`distillation.enabled` turns it on; `teacher_models.<name>` names each
teacher's checkpoint and the value of `teacher_key` (a per-sample field such
as `data_source`) whose samples it scores; `distillation_loss` is the loss
(`loss_mode` from `conveyor.algos.distill.DISTILL_LOSSES`) and how it joins the
policy loss. The keys beyond verl's (`strategy`, `fsdp_config`,
`log_prob_micro_batch_size_per_gpu` of a teacher) are the reference's, since
a teacher is held as the reference is.

It deliberately holds no logic of the loss or of the teacher's forward
(`conveyor.algos.distill`, `conveyor.workers.ranks.teacher`).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config.actor import STRATEGY_CHOICES, FSDPConfig
from conveyor.config.fields import F, S, check, check_tree, registry

__all__ = ["DistillationConfig", "DistillationLossConfig", "TeacherModelConfig", "TEACHER_PLACEMENTS"]

TEACHER_PLACEMENTS = ("colocated", "separate")


@dataclass
class TeacherModelConfig:
    """One teacher: its checkpoint and the samples it scores."""

    key: str | None = F(
        None,
        "the value of distillation.teacher_key whose samples this teacher scores; null = every sample "
        "(a single teacher only)",
    )
    model_path: str | None = F(
        None, "the teacher's checkpoint: a local Hugging Face directory (e.g. what `conveyor export` writes)"
    )
    log_prob_micro_batch_size_per_gpu: int = F(256, "sequences per teacher forward", gt=0, resume_neutral=True)
    strategy: str | None = F(
        None,
        "fsdp2 (sharded parameters, gathered a layer at a time), dp or none; null = fsdp2 with more than one rank",
        choices=STRATEGY_CHOICES,
        resume_neutral=True,
    )
    fsdp_config: FSDPConfig = S(FSDPConfig, "FSDP2 settings (param_offload keeps the shards in host memory)")


@dataclass
class DistillationLossConfig:
    """The distillation loss and how it joins the policy loss (verl's `distillation.distillation_loss`)."""

    loss_mode: str = F(
        "k3",
        "per-token loss: k1/k3/low_var_kl (and verl's kl, abs, k2, mse) estimate the reverse KL from the "
        "sampled token; forward_kl_topk uses the teacher's top-k; full_reverse_kl is exact over the vocabulary",
        choices=registry("conveyor.algos.distill", "DISTILL_LOSSES"),
    )
    topk: int = F(32, "forward_kl_topk: how many of the teacher's most likely tokens it writes per position", gt=0)
    use_task_rewards: bool = F(
        True,
        "keep the policy loss on the task's advantages and add distillation_loss_coef x the distillation loss; "
        "false = the distillation loss alone (pure distillation)",
    )
    distillation_loss_coef: float = F(1.0, "weight of the distillation loss beside the policy loss", ge=0)
    use_policy_gradient: bool = F(
        False,
        "true: a clipped policy-gradient loss whose per-token advantage is minus the distillation loss "
        "(recommended with k1); false: the loss itself, back-propagated (k3, forward_kl_topk, full_reverse_kl)",
    )
    clip_ratio_low: float = F(0.2, "use_policy_gradient: the lower clip range", gt=0)
    clip_ratio_high: float = F(0.2, "use_policy_gradient: the upper clip range", gt=0)


@dataclass
class DistillationConfig:
    """On-policy distillation: the student samples, teachers score each sampled token, the student moves to them."""

    enabled: bool = F(False, "train the actor towards the teachers' distributions")
    teacher_key: str = F(
        "data_source", "the per-sample field whose value picks a sample's teacher (with several teachers)"
    )
    teacher_models: dict[str, TeacherModelConfig] = F(
        {}, "the teachers by name: teacher_models.<name>.{key, model_path, ...}"
    )
    distillation_loss: DistillationLossConfig = S(DistillationLossConfig, "the loss")
    placement: str = F(
        "colocated",
        "colocated: rank i of every teacher in the actor's rank-i process; separate: ranks of their own (Ray), "
        "distillation.num_workers of them",
        choices=TEACHER_PLACEMENTS,
        resume_neutral=True,
    )
    num_workers: int = F(
        1, "placement=separate on Ray: the teachers' ranks (a GPU each on a GPU run)", gt=0, resume_neutral=True
    )

    def validate(self, prefix: str) -> None:
        """Every teacher's own keys; when enabled, at least one teacher with a checkpoint, and distinct keys."""
        base = f"{prefix}.teacher_models" if prefix else "teacher_models"
        for name, teacher in self.teacher_models.items():
            check_tree(teacher, f"{base}.{name}.")
        if not self.enabled:
            return
        check(
            bool(self.teacher_models),
            base,
            "distillation.enabled needs a teacher: set distillation.teacher_models.<name>.model_path",
        )
        for name, teacher in self.teacher_models.items():
            check(
                bool(teacher.model_path),
                f"{base}.{name}.model_path",
                "set it to the teacher's checkpoint directory (e.g. one `conveyor export` wrote)",
            )
        if len(self.teacher_models) > 1:
            keys = [t.key for t in self.teacher_models.values()]
            for name, teacher in self.teacher_models.items():
                check(
                    teacher.key is not None,
                    f"{base}.{name}.key",
                    f"with {len(keys)} teachers each one names the {self.teacher_key} value whose samples it scores",
                )
            dupes = sorted({k for k in keys if keys.count(k) > 1})
            check(
                not dupes, base, f"two teachers score {self.teacher_key}={dupes[0] if dupes else ''}: keys must differ"
            )
