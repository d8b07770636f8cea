"""`conveyor train` with the vllm rollout refuses, before any engine starts, a model vLLM's CPU build cannot serve.

Both refusals run through the command's entry point in one child process, with stdin closed; neither starts vLLM.
"""

from __future__ import annotations

from pathlib import Path

VLLM = [
    "actor_rollout_ref.rollout.name=vllm",
    "trainer.total_training_steps=1",
    "trainer.logger=[jsonl]",
    "trainer.val_before_train=false",
    "trainer.progress_bar=false",
]
TINY = [
    "actor_rollout_ref.model.tiny.num_heads=2",
    "actor_rollout_ref.model.tiny.num_kv_heads=2",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
]


def _checkpoint(path: Path) -> Path:
    """A tiny MoE checkpoint whose experts are 40 wide (vLLM's CPU build pads them and fails at the first sync)."""
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_tiny_model("qwen3_moe", tok, hidden_size=64, num_heads=2, num_kv_heads=2, moe_intermediate_size=40)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_model_vllm_cannot_serve_is_refused_at_start_naming_what_to_change(
    rel, _conveyor_cache, tmp_path: Path
) -> None:
    ckpt = _checkpoint(tmp_path / "experts40")
    cases = {
        "context": [
            "train",
            *VLLM,
            *TINY,
            "actor_rollout_ref.rollout.max_model_len=100000",
            f"trainer.default_local_dir={tmp_path / 'a'}",
        ],
        "expert_width": [
            "train",
            *VLLM,
            f"actor_rollout_ref.model.path={ckpt}",
            f"trainer.default_local_dir={tmp_path / 'b'}",
        ],
    }
    results = rel.run_cases_in_one_process(cases, tmp_path)
    context = results["context"]
    rel.assert_usage_error(
        context["status"],
        context["stderr"],
        ("actor_rollout_ref.rollout.max_model_len = 100000 tokens", "the tiny model", "set it to at most"),
    )
    width = results["expert_width"]
    rel.assert_usage_error(
        width["status"],
        width["stderr"],
        (str(ckpt), "actor_rollout_ref.model.path", "moe_intermediate_size) 40", "actor_rollout_ref.rollout.name=hf"),
    )
    for result in results.values():
        assert "vLLM engine started" not in result["stderr"]
