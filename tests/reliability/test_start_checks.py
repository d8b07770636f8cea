"""Every key of the newer features is checked when a run starts: a bad value stops it before any step is trained,
with exit status 2 and one line naming the key and what to change.

The cases cover the reward model's, the judge's and the teachers' paths and tokenizers, the judge's budgets,
sequence-parallel sizes against ranks and heads, dump and replay settings and folders, router control and
replica fault tolerance. They run one after another through the command's entry point in one child process.
"""

from __future__ import annotations

import pytest

A = "actor_rollout_ref.actor."
FT = "actor_rollout_ref.rollout.fault_tolerance."

# Case -> (overrides, what the error line must hold). "{tmp}" is the module's folder of saved checkpoints.
CASES: dict[str, tuple[list[str], tuple[str, ...]]] = {
    # A tokenizer with ids past its model's embedding table loaded, and failed in step 1's reward stage.
    "reward_model_tokenizer_past_its_embeddings": (
        ["reward_model.enable=true", "reward_model.model.path={tmp}/rm_short_embeddings"],
        ("reward_model.model.path", "token ids up to 56", "vocab_size 49"),
    ),
    "reward_model_tokenizer_path_past_its_embeddings": (
        [
            "reward_model.enable=true",
            "reward_model.model.path={tmp}/rm_short_embeddings",
            "reward_model.model.tokenizer_path={tmp}/rm_short_embeddings",
        ],
        ("reward_model.model.tokenizer_path", "vocab_size 49"),
    ),
    "judge_tokenizer_past_its_embeddings": (
        [
            "reward_model.judge.enable=true",
            "reward_model.judge.model.path={tmp}/judge_short_embeddings",
            "reward_model.judge.prompt_template={tmp}/template.txt",
            "reward_model.judge.parser=yes_no",
            "reward_model.judge.max_new_tokens=8",
        ],
        ("reward_model.judge.model.path", "vocab_size 49"),
    ),
    "reward_model_path_missing": (
        ["reward_model.enable=true", "reward_model.model.path={tmp}/nowhere"],
        ("reward_model.model.path", "nowhere"),
    ),
    "judge_max_new_tokens_zero": (
        [
            "reward_model.judge.enable=true",
            "reward_model.judge.model.path={tmp}/judge",
            "reward_model.judge.prompt_template={tmp}/template.txt",
            "reward_model.judge.max_new_tokens=0",
        ],
        ("reward_model.judge.max_new_tokens", "must be > 0"),
    ),
    "judge_template_missing": (
        [
            "reward_model.judge.enable=true",
            "reward_model.judge.model.path={tmp}/judge",
            "reward_model.judge.prompt_template={tmp}/nowhere.txt",
        ],
        ("reward_model.judge.prompt_template", "nowhere.txt"),
    ),
    "teacher_path_missing": (
        ["distillation.enabled=true", "distillation.teacher_models.a.model_path={tmp}/nowhere"],
        ("distillation.teacher_models.a.model_path", "does not exist"),
    ),
    "sp_size_beyond_the_ranks": (
        [A + "ulysses_sequence_parallel_size=2"],
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "must divide the 1 ranks"),
    ),
    "sp_size_not_dividing_the_kv_heads": (
        [
            "trainer.num_cpu_workers=2",
            A + "ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.model.tiny.num_kv_heads=1",
        ],
        ("ulysses_sequence_parallel_size", "num_kv_heads=1"),
    ),
    "ref_sp_size_beyond_the_ranks": (
        ["actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", "algorithm.use_kl_in_reward=true"],
        ("actor_rollout_ref.ref.ulysses_sequence_parallel_size",),
    ),
    "dump_rollouts_window_zero": (
        ["trainer.dump_rollouts.freq=1", "trainer.dump_rollouts.window=0"],
        ("trainer.dump_rollouts.window", "must be > 0"),
    ),
    "replay_from_a_missing_folder": (
        ["trainer.replay_rollouts_from={tmp}/nowhere"],
        ("trainer.replay_rollouts_from", "neither a rollout bundle"),
    ),
    "replay_from_a_file": (
        ["trainer.replay_rollouts_from={tmp}/template.txt"],
        ("trainer.replay_rollouts_from", "neither a rollout bundle"),
    ),
    "router_bias_rate_nan": ([A + "router.bias_update_rate=nan"], ("router.bias_update_rate", "finite")),
    "router_bias_update_unknown": ([A + "router.bias_update=bogus"], ("router.bias_update", "sign")),
    "router_bias_on_a_dense_model": (
        ["actor_rollout_ref.model.tiny.arch=qwen3", A + "router.bias_update_rate=0.01"],
        ("router.bias_update_rate", "dense"),
    ),
    "router_dead_band_negative": ([A + "router.bias_dead_band=-1"], ("router.bias_dead_band", ">= 0")),
    "fault_tolerance_timeout_nan": ([FT + "timeout_s=nan"], ("fault_tolerance.timeout_s", "finite")),
    "fault_tolerance_restarts_negative": ([FT + "max_restarts=-1"], ("fault_tolerance.max_restarts", "[0, 1000]")),
    "fault_tolerance_health_interval_zero": (
        [FT + "health_check_interval_s=0"],
        ("fault_tolerance.health_check_interval_s",),
    ),
}


@pytest.fixture(scope="module")
def refused(rel, base_model, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each case's result (its own run directory under the module's folder), all run in one child process."""
    from conveyor.models.reward_model import build_tiny_reward_model
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer

    tmp = tmp_path_factory.mktemp("start-checks")
    tok = build_char_tokenizer()
    assert len(tok) == 57  # the ids the needles name
    # Saved together, but the model's embedding table is 8 rows short of the tokenizer's ids.
    build_tiny_reward_model(tok, seed=5, vocab_size=len(tok) - 8).save_pretrained(str(tmp / "rm_short_embeddings"))
    tok.save_pretrained(str(tmp / "rm_short_embeddings"))
    judge = build_tiny_model("qwen3", tok, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2)
    judge.save_pretrained(str(tmp / "judge"))  # a judge whose tokens fit, for the cases about its other keys
    tok.save_pretrained(str(tmp / "judge"))
    judge.resize_token_embeddings(len(tok) - 8)
    judge.save_pretrained(str(tmp / "judge_short_embeddings"))
    tok.save_pretrained(str(tmp / "judge_short_embeddings"))
    (tmp / "template.txt").write_text("is {response} the answer to {question} ({ground_truth})? verdict:")
    cases = {
        case: rel.train_args(tmp / case / "run", *(o.replace("{tmp}", str(tmp)) for o in overrides))
        for case, (overrides, _) in CASES.items()
    }
    results = rel.run_cases_in_one_process(cases, tmp)
    return {case: (results[case], tmp / case / "run") for case in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_key_stops_the_run_before_any_step_naming_it(rel, refused: dict, case: str) -> None:
    result, run_dir = refused[case]
    rel.assert_usage_error(result["status"], result["stderr"], CASES[case][1])
    assert rel.logged_steps(run_dir) == []
    assert not (run_dir / "checkpoints").exists()
