"""On-policy distillation in the run: the plan's decision, the start-up checks of the teachers, and the teacher stage.

`distillation_decision(cfg)` is the run plan's line about it (the teacher role's, defined beside
the teachers' settings in `conveyor.workers.ranks.distill`); `check_teachers` runs at start, before any
worker is built, and refuses a teacher whose checkpoint is missing or whose tokenizer or vocabulary
differs from the student's (the losses compare log-probs token id by token id, so a teacher
must read the student's token ids as the same text), and, for a vision-language student, a
teacher that would not read its samples' pixels alike (a text teacher, other vision tokens,
patching or image processing). `teacher_stage` is the
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
            s_size, t_size = _vocab_size(student_config), _vocab_size(t_config)
            if s_size != t_size:
                diff = f"vocab_size is {s_size} for the student's model, {t_size} for the teacher's"
        if diff is not None:
            raise ConfigError(
                f"{key}: the teacher's tokenizer differs from the student's ({student_key}): {diff}; distillation "
                "compares log-probs token id by token id, so use a teacher that shares the student's tokenizer"
            )
        seeing = _vision_difference(cfg.actor_rollout_ref.model.path, student_config, path, t_config)
        if seeing is not None:
            raise ConfigError(f"{key}: {seeing}")


def _vocab_size(config: Any) -> int | None:
    """A model's vocabulary size: its config's, or its text model's for a vision-language config (which keeps it
    in text_config)."""
    size = getattr(config, "vocab_size", None)
    return size if size is not None else getattr(getattr(config, "text_config", None), "vocab_size", None)


# What makes two vision-language checkpoints read one sample's pixels alike: the vision tokens and the patching.
_VISION_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_PATCHING = ("patch_size", "spatial_merge_size", "temporal_patch_size")


def _vision_difference(student_path: Any, student: Any, teacher_path: str, teacher: Any) -> str | None:
    """Why a teacher cannot score a student's samples with their images, or None: each must see images if the other
    does, with the same vision tokens, patching and image processing (the teacher reads the student's pixels)."""
    from conveyor.models.tiny_vlm import is_vlm_config

    s_vlm, t_vlm = is_vlm_config(student), is_vlm_config(teacher)
    if not s_vlm and not t_vlm:
        return None
    if s_vlm != t_vlm:
        who = (
            "the student sees images and the teacher does not" if s_vlm else "the teacher sees images, the student not"
        )
        return (
            f"{who}; a teacher scores the student's samples as they are (their image-pad tokens and pixels), so use a "
            "vision-language teacher for a vision-language student, a text one for a text one (docs/vlm.md)"
        )
    for name in _VISION_IDS:
        s_id, t_id = getattr(student, name, None), getattr(teacher, name, None)
        if s_id != t_id:
            return f"{name} is {s_id} for the student, {t_id} for the teacher"
    for name in _PATCHING:
        s_v, t_v = getattr(student.vision_config, name, None), getattr(teacher.vision_config, name, None)
        if s_v != t_v:
            return f"vision_config.{name} is {s_v} for the student, {t_v} for the teacher: it would read other patches"
    s_proc, t_proc = _processor_settings(student_path), _processor_settings(teacher_path)
    if s_proc != t_proc:
        keys = sorted(k for k in set(s_proc) | set(t_proc) if s_proc.get(k) != t_proc.get(k))
        return (
            f"its image processor differs from the student's ({', '.join(keys)}); the teacher reads the pixels the "
            "student's processor made, so give it the student's preprocessor_config.json"
        )
    return None


def _processor_settings(path: Any) -> dict[str, Any]:
    """The image processor's settings saved in a checkpoint (preprocessor_config.json), its class name left out."""
    import json

    file = Path(str(path)).expanduser() / "preprocessor_config.json"
    if not path or not file.is_file():
        return {}
    settings = json.loads(file.read_text())
    return {k: v for k, v in settings.items() if k not in ("image_processor_type", "processor_class")}


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
