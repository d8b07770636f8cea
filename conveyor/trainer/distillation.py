"""On-policy distillation in the run: the plan's decision, the start-up checks of the teachers, and the teacher stage.

`distillation_decision(cfg)` is the run plan's line about it (the teacher role's, defined beside
the teachers' settings in `conveyor.workers.ranks.distill`); `check_teachers` runs at start, before any
worker is built, and refuses a teacher whose checkpoint is missing or whose tokenizer or vocabulary
differs from the student's (the losses compare log-probs token id by token id, so a teacher
must read the student's token ids as the same text). `teacher_stage` is the
step's stage between the reference and the advantages: each sample's teacher
writes its log-probs (`conveyor.workers.ranks.teacher`), and the stage returns
the teachers' metrics (`distill/moe/routing_agreement`, their peak memory).

What it deliberately does not do: compute a loss (the actor's update does,
`conveyor.workers.ranks.distill`) or re-tokenize text for a teacher with
another tokenizer (such a teacher is refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.config import ConfigError
from conveyor.metrics.reduce import reduce_rank_metrics
from conveyor.models.loading import check_checkpoint_dir, load_model_config, load_tokenizer
from conveyor.protocol import KVBatchMeta
from conveyor.workers.ranks.calls import LogProbCall
from conveyor.workers.ranks.distill import distillation_decision

if TYPE_CHECKING:
    from conveyor.config import Config
    from conveyor.workers.placement.roles import TeacherGroup

__all__ = ["distillation_decision", "check_teachers", "teacher_stage"]


def _vocab_difference(student: Any, teacher: Any) -> str | None:
    """How two tokenizers differ in words, or None when they map every token and special token alike."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        only_s = len(set(s_vocab.items()) - set(t_vocab.items()))
        only_t = len(set(t_vocab.items()) - set(s_vocab.items()))
        return (
            f"vocabularies differ ({len(s_vocab)} vs {len(t_vocab)} tokens; {only_s} (token, id) pairs only in the "
            f"student's, {only_t} only in the teacher's)"
        )
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        s_id, t_id = getattr(student, name, None), getattr(teacher, name, None)
        if s_id != t_id:
            return f"{name} is {s_id} for the student, {t_id} for the teacher"
    return None


def check_teachers(cfg: Config, student_tokenizer: Any, student_config: Any) -> None:
    """Refuse, on one line naming the keys, a teacher that is missing or does not share the student's tokens."""
    trust = cfg.actor_rollout_ref.model.trust_remote_code
    student_key = (
        "actor_rollout_ref.model.tokenizer_path"
        if cfg.actor_rollout_ref.model.tokenizer_path
        else "actor_rollout_ref.model.path"
        if cfg.actor_rollout_ref.model.path
        else "the tiny model's tokenizer"
    )
    for name, teacher in cfg.distillation.teacher_models.items():
        key = f"distillation.teacher_models.{name}.model_path"
        if not Path(str(teacher.model_path)).expanduser().exists():
            raise ConfigError(
                f"{key}: {teacher.model_path} does not exist; point it at a Hugging Face checkpoint directory "
                "(`conveyor export RUN_DIR --out DIR` writes one from a run; `make distill-teacher` builds the one "
                "examples/distill_tiny.yaml names)"
            )
        try:
            path = check_checkpoint_dir(str(teacher.model_path), trust_remote_code=trust)
            tokenizer = load_tokenizer(path, trust_remote_code=trust)
            t_config = load_model_config(path, trust_remote_code=trust)
        except (ValueError, OSError) as err:
            raise ConfigError(f"{key}: {err}") from err
        diff = _vocab_difference(student_tokenizer, tokenizer)
        if diff is None:
            s_size, t_size = getattr(student_config, "vocab_size", None), getattr(t_config, "vocab_size", None)
            if s_size != t_size:
                diff = f"vocab_size is {s_size} for the student's model, {t_size} for the teacher's"
        if diff is not None:
            raise ConfigError(
                f"{key}: the teacher's tokenizer differs from the student's ({student_key}): {diff}; distillation "
                "compares log-probs token id by token id, so use a teacher that shares the student's tokenizer"
            )


def teacher_stage(teacher: TeacherGroup, meta: KVBatchMeta, temperature: float) -> tuple[KVBatchMeta, dict[str, float]]:
    """Each sample's teacher writes its fields; returns the handle and the teachers' metrics."""
    call = LogProbCall(temperature=temperature, calculate_entropy=False, compute_loss=False)
    out = teacher.compute_teacher_log_prob(meta.with_extra_info(**call.to_extra_info()))
    reduced = reduce_rank_metrics(out.extra_info)
    metrics = {k: v for k, v in reduced.items() if k.startswith("distill/")}
    metrics.update(
        {f"teacher/{k}": v for k, v in reduced.items() if k.startswith("perf/") and k.endswith("/max_memory_gb")}
    )
    return out, metrics
