"""Bad input ends with one clear `error:` line and exit status 2, never a traceback; near-misses still train.

Each mistake runs through the command-line entry point (`conveyor.cli.main`,
which `conveyor` calls) with its own captured output and exit status; to pay
the import of the stack once (a `conveyor` process spends ~4 s importing
torch before it even reads its config), the cases run one after another inside
a single child process per group: config mistakes, then mistakes found later
(files, tokenizers, data, reward functions). One config mistake also runs as a
whole `conveyor train` process of its own, so that the process as a user sees
it (nothing printed while importing, exit status 2) is checked too.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conveyor.data_plane import make_data_plane
from conveyor.metrics.moe_load_balance import (
    RolloutMoELoadBalanceMetricsAccumulator,
    compute_moe_lb_metrics,
    compute_rollout_moe_load_balance_metrics,
    get_metric_data_with_optional_routed_experts,
)
from conveyor.models.loading import load_tokenizer
from conveyor.tasks.parquet import write_parquet_records
from conveyor.tasks.synthetic import make_arithmetic_records

# --------------------------------------------------------------------------- config mistakes: one process
_BAD_YAML = "trainer:\n  total_training_steps: [3\n"
_REMOVED_IN_YAML = "actor_rollout_ref:\n  rollout:\n    moe_load_balance_monitor_interval: 5\n"

CONFIG_CASES = {
    "misspelled_key": (
        ["trainer.total_trainig_steps=3"],
        ("trainer.total_trainig_steps", "did you mean trainer.total_training_steps"),
    ),
    "misspelled_nested_key": (
        ["actor_rollout_ref.rollout.temprature=0.7"],
        ("did you mean actor_rollout_ref.rollout.temperature",),
    ),
    "unknown_section": (["trainr.seed=1"], ("trainr", "did you mean trainer")),
    "wrong_type_int": (["data.train_batch_size=abc"], ("data.train_batch_size", "expected int", "'abc'")),
    "wrong_type_bool": (["data.shuffle=maybe"], ("data.shuffle", "expected bool")),
    "section_given_a_value": (["--config", "{tmp}/scalar_section.yaml"], ("data", "expected a mapping")),
    "negative_learning_rate": (
        ["actor_rollout_ref.actor.optim.lr=-1e-3"],
        ("actor_rollout_ref.actor.optim.lr", "must be > 0", "-0.001"),
    ),
    "zero_critic_learning_rate": (["critic.optim.lr=0"], ("critic.optim.lr", "must be > 0")),
    "clip_ratio_zero": (["actor_rollout_ref.actor.clip_ratio=0"], ("actor_rollout_ref.actor.clip_ratio", "> 0")),
    "clip_ratio_negative": (["actor_rollout_ref.actor.clip_ratio=-0.2"], ("actor_rollout_ref.actor.clip_ratio",)),
    "batch_not_divisible": (
        ["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
        ("actor_rollout_ref.actor.ppo_mini_batch_size", "data.train_batch_size=6", "divisible"),
    ),
    "removed_key": (
        ["actor_rollout_ref.rollout.moe_load_balance_monitor_interval=5"],
        ("moe_load_balance_monitor_interval", "actor_rollout_ref.rollout.moe_load_balance_metrics_interval"),
    ),
    "negative_moe_interval": (
        ["actor_rollout_ref.rollout.moe_load_balance_metrics_interval=-1"],
        ("actor_rollout_ref.rollout.moe_load_balance_metrics_interval", ">= 0"),
    ),
    "unknown_truncation": (["data.truncation=middle"], ("data.truncation", "'error', 'left', 'right'")),
    "unknown_logger": (["trainer.logger=[foo]"], ("trainer.logger", "'foo'")),
    "misspelled_logger": (["trainer.logger=[consol]"], ("trainer.logger", "did you mean 'console'")),
    "override_without_equals": (["trainer.total_training_steps"], ("key=value",)),
    "resume_path_without_path": (["trainer.resume_mode=resume_path"], ("trainer.resume_from_path",)),
    "bad_custom_reward_name": (["reward.custom_reward_function.name=1x"], ("reward.custom_reward_function.name",)),
    "config_file_missing": (["--config", "{tmp}/nope.yaml"], ("--config", "nope.yaml", "no such file")),
    "config_file_invalid_yaml": (["--config", "{tmp}/bad.yaml"], ("bad.yaml", "not valid YAML at line 3, column 1")),
    "config_file_not_a_mapping": (["--config", "{tmp}/list.yaml"], ("list.yaml", "must be a mapping")),
    "config_file_removed_key": (
        ["--config", "{tmp}/removed.yaml"],
        ("actor_rollout_ref.rollout.moe_load_balance_metrics_interval",),
    ),
}


@pytest.fixture(scope="module")
def config_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with broken YAML config files."""
    tmp = tmp_path_factory.mktemp("configs")
    (tmp / "bad.yaml").write_text(_BAD_YAML)
    (tmp / "list.yaml").write_text("- trainer\n- data\n")
    (tmp / "scalar_section.yaml").write_text("data: 5\n")
    (tmp / "removed.yaml").write_text(_REMOVED_IN_YAML)
    return tmp


@pytest.fixture(scope="module")
def config_mistakes(rel, config_files: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every config case, run once through the command's entry point in one child process."""
    tmp = tmp_path_factory.mktemp("config-mistakes")
    cases = {
        case: [
            "train",
            *[a.replace("{tmp}", str(config_files)) for a in args],
            f"trainer.default_local_dir={tmp / case / 'run'}",
        ]
        for case, (args, _) in CONFIG_CASES.items()
    }
    return {"dir": tmp, "results": rel.run_cases_in_one_process(cases, tmp, timeout=300)}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_mistake_is_a_one_line_usage_error(rel, case: str, config_mistakes: dict) -> None:
    result = config_mistakes["results"][case]
    rel.assert_usage_error(result["status"], result["stderr"], CONFIG_CASES[case][1])
    assert len(result["stderr"].strip().splitlines()) == 1 and result["stdout"] == ""
    assert not (config_mistakes["dir"] / case / "run").exists()  # nothing was started


def test_config_mistake_in_a_process_of_its_own_is_one_line_and_status_2(rel, tmp_path: Path) -> None:
    args, needles = CONFIG_CASES["misspelled_key"]
    proc = rel.run_cli("train", *args, f"trainer.default_local_dir={tmp_path / 'run'}", timeout=60)
    rel.assert_usage_error(proc.returncode, proc.stderr, needles)
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    assert not (tmp_path / "run").exists()  # nothing was started


# --------------------------------------------------------------------------- mistakes found at run time: one process
_REWARD_PLUGINS = {
    "raises.py": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    raise RuntimeError('grader crashed on ' + repr(solution_str))\n",
    "nan.py": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n",
    # Finite as a Python float, infinite once stored as a float32 score.
    "overflow.py": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1e39\n",
    # Finite in float32, but a group mean of two of them overflows: the advantages become NaN.
    "huge.py": "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 3e38\n",
    "partial.py": "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return 1.0 if solution_str.strip() == str(ground_truth) else 0.25\n",
}


def _make_model_dir(base_model: str, target: Path, *, pad: bool, eos: bool) -> Path:
    """A copy of the tiny model whose tokenizer lacks a pad and/or an EOS token."""
    shutil.copytree(base_model, target)
    tok = load_tokenizer(base_model)
    if not pad:
        tok.pad_token = None
    if not eos:
        tok.eos_token = None
    tok.save_pretrained(target)
    return target


def _runtime_cases(base_model: str, tmp: Path) -> dict[str, list[str]]:
    records = make_arithmetic_records(16, seed=3, max_operand=9, split="train")
    write_parquet_records(records, tmp / "good.parquet")
    write_parquet_records([{**r, "data_source": "my/unknown_task"} for r in records], tmp / "unknown_source.parquet")
    table = pa.Table.from_pylist(records)
    pq.write_table(table.drop_columns(["reward_model"]), tmp / "no_reward_model.parquet")
    pq.write_table(table.slice(0, 0), tmp / "empty.parquet")
    pq.write_table(
        table.set_column(
            table.schema.get_field_index("prompt"),
            "prompt",
            pa.array([str(r["prompt"][0]["content"]) for r in records]),
        ),
        tmp / "string_prompt.parquet",
    )
    # verl's multimodal layout (as its geometry3k preprocessing writes): `<image>` in the prompt, an `images`
    # column of {"bytes", "path"} structs; the second row is text-only, and the first carries an image.
    pq.write_table(
        pa.Table.from_pylist(
            [
                {**records[0], "prompt": [{"role": "user", "content": "<image>What is the sum?"}]},
                *records[1:],
            ]
        ).append_column(
            "images",
            pa.array(
                [[{"bytes": b"\x89PNG\r\n\x1a\n", "path": "a.png"}]] + [[] for _ in records[1:]],
                pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            ),
        ),
        tmp / "with_images.parquet",
    )
    (tmp / "no_config").mkdir()
    no_pad_no_eos = _make_model_dir(base_model, tmp / "no_pad_no_eos", pad=False, eos=False)
    eos_only = _make_model_dir(base_model, tmp / "eos_only", pad=False, eos=True)
    for name, text in _REWARD_PLUGINS.items():
        (tmp / name).write_text(text)

    def run(case: str, *extra: str, model: str | Path = base_model) -> list[str]:
        return [
            "train",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "data.synthetic.num_train=64",
            "data.synthetic.num_val=4",
            "data.synthetic.max_operand=9",
            "trainer.total_training_steps=1",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.logger=[jsonl]",
            "trainer.progress_bar=false",
            "trainer.dump_freq=0",
            f"actor_rollout_ref.model.path={model}",
            f"trainer.default_local_dir={tmp / 'runs' / case}",
            *extra,
        ]

    files = {
        name: f"data.train_files=[{tmp / name}]"
        for name in (
            "good.parquet",
            "unknown_source.parquet",
            "no_reward_model.parquet",
            "empty.parquet",
            "string_prompt.parquet",
            "with_images.parquet",
        )
    }
    custom = "reward.custom_reward_function.path={}".format
    cases = {
        "model_path_missing": run("model_path_missing", model=tmp / "no_such_model"),
        "model_dir_without_config": run("model_dir_without_config", model=tmp / "no_config"),
        "tokenizer_without_pad_and_eos": run("tokenizer_without_pad_and_eos", model=no_pad_no_eos),
        "tokenizer_with_eos_but_no_pad": run("tokenizer_with_eos_but_no_pad", model=eos_only),
        "parquet_missing_column": run("parquet_missing_column", files["no_reward_model.parquet"]),
        "parquet_empty": run("parquet_empty", files["empty.parquet"]),
        "parquet_missing_file": run("parquet_missing_file", f"data.train_files=[{tmp / 'nowhere.parquet'}]"),
        "parquet_prompt_not_messages": run("parquet_prompt_not_messages", files["string_prompt.parquet"]),
        "unknown_data_source": run("unknown_data_source", files["unknown_source.parquet"]),
        "parquet_images_for_a_text_policy": run("parquet_images_for_a_text_policy", files["with_images.parquet"]),
        "prompt_too_long_error": run("prompt_too_long_error", "data.max_prompt_length=3"),
        "prompt_too_long_left": run("prompt_too_long_left", "data.max_prompt_length=3", "data.truncation=left"),
        "prompt_too_long_right": run("prompt_too_long_right", "data.max_prompt_length=3", "data.truncation=right"),
        "reward_function_raises": run("reward_function_raises", custom(tmp / "raises.py")),
        "reward_function_returns_nan": run("reward_function_returns_nan", custom(tmp / "nan.py")),
        "reward_overflows_float32": run("reward_overflows_float32", custom(tmp / "overflow.py")),
        "huge_equal_rewards": run(
            "huge_equal_rewards", custom(tmp / "huge.py"), "reward.custom_reward_function.name=my_score"
        ),
        "custom_reward_file_missing": run("custom_reward_file_missing", custom(tmp / "missing.py")),
        "custom_reward_name_missing": run(
            "custom_reward_name_missing", custom(tmp / "nan.py"), "reward.custom_reward_function.name=grade"
        ),
        "custom_reward_works": run(
            "custom_reward_works",
            files["good.parquet"],
            custom(tmp / "partial.py"),
            "reward.custom_reward_function.name=my_score",
        ),
        "resume_path_not_a_checkpoint": run(
            "resume_path_not_a_checkpoint",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={tmp / 'no_checkpoint_here'}",
        ),
    }
    if not torch.cuda.is_available():
        cases["cuda_without_cuda"] = run("cuda_without_cuda", "trainer.device=cuda")
    return cases


@pytest.fixture(scope="module")
def runtime(rel, base_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every run-time case, run once through the command's entry point in one child process."""
    tmp = tmp_path_factory.mktemp("runtime")
    return {"dir": tmp, "results": rel.run_cases_in_one_process(_runtime_cases(base_model, tmp), tmp)}


RUNTIME_ERRORS = {
    "model_path_missing": ("no_such_model", "does not exist", "actor_rollout_ref.model.path"),
    "model_dir_without_config": ("no_config", "no config.json", "actor_rollout_ref.model.path"),
    "tokenizer_without_pad_and_eos": ("no_pad_no_eos", "neither a pad token nor an EOS token"),
    "parquet_missing_column": ("no_reward_model.parquet", "['reward_model']"),
    "parquet_empty": ("empty.parquet", "hold no rows"),
    "parquet_missing_file": ("nowhere.parquet", "does not exist"),
    "parquet_prompt_not_messages": ("string_prompt.parquet", "row 0", "'prompt' must be a list of chat messages"),
    "unknown_data_source": ("'my/unknown_task'", "no reward function"),
    "parquet_images_for_a_text_policy": ("with_images.parquet", "row 0", "column 'images'", "drop the 'images'"),
    "prompt_too_long_error": ("data.max_prompt_length=3", "data.truncation=left"),
    "reward_function_raises": ("sample 'train-1/p", "raises.py", "RuntimeError: grader crashed"),
    "reward_function_returns_nan": ("sample 'train-1/p", "nan.py", "returned nan (float), not a finite number"),
    "reward_overflows_float32": ("sample 'train-1/p", "1e+39", "overflows a float32 'rm_scores' value"),
    "custom_reward_file_missing": ("reward.custom_reward_function.path", "missing.py"),
    "custom_reward_name_missing": ("reward.custom_reward_function.name", "'grade'"),
    "resume_path_not_a_checkpoint": ("no_checkpoint_here", "trainer.resume_from_path"),
    "cuda_without_cuda": ("trainer.device", "no CUDA device"),
}


@pytest.mark.parametrize("case", sorted(RUNTIME_ERRORS))
def test_runtime_mistake_is_a_usage_error_naming_the_culprit(rel, runtime: dict, case: str) -> None:
    if case == "cuda_without_cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = runtime["results"][case]
    rel.assert_usage_error(result["status"], result["stderr"], RUNTIME_ERRORS[case])
    run_dir = runtime["dir"] / "runs" / case
    # Nothing half-trained is left behind as if it were a result.
    assert not (run_dir / "checkpoints").exists()


def test_a_tokenizer_with_eos_but_no_pad_trains_with_a_warning(rel, runtime: dict) -> None:
    result = runtime["results"]["tokenizer_with_eos_but_no_pad"]
    assert result["status"] == 0, result["stderr"][-3000:]
    assert "has no pad token; using its EOS token '<eos>' as pad" in result["stderr"]
    assert sorted(rel.read_steps(runtime["dir"] / "runs" / "tokenizer_with_eos_but_no_pad")) == [1]


@pytest.mark.parametrize("mode", ["left", "right"])
def test_too_long_prompts_are_cut_when_truncation_allows(rel, runtime: dict, mode: str) -> None:
    result = runtime["results"][f"prompt_too_long_{mode}"]
    assert result["status"] == 0, result["stderr"][-3000:]
    steps = rel.read_steps(runtime["dir"] / "runs" / f"prompt_too_long_{mode}")
    # Every synthetic prompt ("a+b=") is longer than 3 tokens, so every one was cut to exactly 3.
    assert steps[1]["prompt_length/max"] == 3.0 and steps[1]["prompt_length/min"] == 3.0


def test_huge_equal_rewards_give_zero_advantages_not_nan(rel, runtime: dict) -> None:
    """3e38 for every sample: group statistics in float64 neither overflow nor turn an equal group into noise."""
    result = runtime["results"]["huge_equal_rewards"]
    assert result["status"] == 0, result["stderr"][-3000:]
    step = rel.read_steps(runtime["dir"] / "runs" / "huge_equal_rewards")[1]
    assert step["advantages/max"] == 0.0 and step["advantages/min"] == 0.0


def test_a_custom_reward_function_from_a_file_scores_every_sample(rel, runtime: dict) -> None:
    result = runtime["results"]["custom_reward_works"]
    assert result["status"] == 0, result["stderr"][-3000:]
    step = rel.read_steps(runtime["dir"] / "runs" / "custom_reward_works")[1]
    # partial.py gives 1.0 or 0.25: no score in between, and never the built-in partial credit.
    assert step["reward/min"] in (0.25, 1.0) and step["reward/max"] in (0.25, 1.0)


# --------------------------------------------------------------------------- routed-expert ids out of range
def _worked_example() -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC section 4's example: E=4, 1 x 6 positions, 2 layers, top-2, the last 4 positions are the response."""
    routed = torch.full((1, 6, 2, 2), -1, dtype=torch.int16)
    routed[0, 2:, 0] = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]], dtype=torch.int16)
    routed[0, 2:, 1] = 2
    return routed, torch.ones(1, 4, dtype=torch.bool)


def test_out_of_range_expert_id_is_skipped_with_a_warning_and_does_not_poison_the_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    good, mask = _worked_example()
    bad = good.clone()
    bad[0, 3, 1, 0] = 4  # == num_experts
    caplog.set_level(logging.WARNING)
    assert compute_rollout_moe_load_balance_metrics(bad, mask, 4) == {}
    assert "expert id 4" in caplog.text and "num_experts is 4" in caplog.text

    # Through the trainer's path: data plane -> fetch with routed_experts -> per-interval metrics.
    plane = make_data_plane("memory")
    acc = RolloutMoELoadBalanceMetricsAccumulator({"num_experts": 4})
    for step, routed in ((1, good), (2, bad)):
        plane.kv_batch_put(["s0"], f"train-{step}", {"routed_experts": routed, "response_mask": mask})
        td = get_metric_data_with_optional_routed_experts(
            ["s0"], f"train-{step}", ["response_mask"], 2, step, acc, plane.kv_batch_get
        )
        metrics = compute_moe_lb_metrics(td, 2, step, acc)
        plane.kv_clear(f"train-{step}")
    plane.close()
    # Step 2's batch was refused whole; step 1's counts are reported, exactly as the worked example says.
    assert metrics["rollout/moe/routed_expert_assignments"] == 16.0
    assert metrics["rollout/moe/max_vio/layer_1"] == 3.0 and metrics["rollout/moe/min_vio/layer_1"] == -1.0
    assert metrics["rollout/moe/avg_vio/layer_1"] == 1.5 and metrics["rollout/moe/max_vio/layer_0"] == 0.0
    assert metrics["rollout/moe/max_vio/max"] == 3.0 and metrics["rollout/moe/avg_vio/avg"] == 0.75


def test_replay_refuses_an_out_of_range_expert_id() -> None:
    from conveyor.models.moe_routing import replay_routing
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer

    model = build_tiny_model(
        "qwen3_moe",
        build_char_tokenizer(),
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=16,
        num_experts=4,
        top_k=2,
    )
    routed, _ = _worked_example()
    ids = torch.randint(0, 5, (1, 6), dtype=torch.long)
    with replay_routing(model, routed):  # in range (with -1 slots): accepted
        model(input_ids=ids)
    routed[0, 5, 0, 1] = 4
    with pytest.raises(ValueError, match=r"routed_experts ids must lie in \[-1, 3\]"):
        with replay_routing(model, routed):
            pass


# --------------------------------------------------------------------------- non-finite values inside the step
def test_non_finite_rewards_reaching_the_trainer_name_the_step_and_field(rel, base_model: str, tmp_path: Path) -> None:
    """The trainer's own check, behind the reward worker's: whatever wrote rm_scores, inf/NaN stops the step."""
    from conveyor.config import load_config
    from conveyor.trainer.plan import build_run_plan
    from conveyor.trainer.ppo import NonFiniteError, PPOTrainer
    from conveyor.trainer.setup import load_prompt_records
    from conveyor.workers.placement.roles import build_worker_groups

    cfg = load_config(
        None, rel.BASE_RUN + [f"actor_rollout_ref.model.path={base_model}", f"trainer.default_local_dir={tmp_path}"]
    )
    tok = load_tokenizer(base_model)
    train, val = load_prompt_records(cfg)
    plane = make_data_plane("memory")
    plan = build_run_plan(cfg, "cpu")
    trainer = PPOTrainer(
        cfg,
        plan=plan,
        data_plane=plane,
        workers=build_worker_groups(cfg, plan, base_model, plane, tok),
        tokenizer=tok,
        train_records=train,
        val_records=val,
        tracking=None,
        run_dir=tmp_path,
    )
    trainer.global_step = 7
    keys = ["a/s0", "a/s1", "b/s0", "b/s1"]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    scores = torch.zeros(4, 3)
    scores[:, 0] = torch.tensor([1.0, 0.0, 0.5, 0.25])
    scores[1, 2] = float("inf")  # outside the response: ignored
    meta = plane.kv_batch_put(
        keys, "train-7", {"rm_scores": scores, "response_mask": mask, "uid": ["a", "a", "b", "b"]}
    )
    trainer.compute_advantage(meta)  # fine: the inf is masked out
    scores[2, 2] = float("nan")
    plane.kv_batch_put(keys, "train-7", {"rm_scores": scores})
    with pytest.raises(NonFiniteError, match=r"^step 7: field 'rm_scores' has 1 NaN or infinite value\(s\)$"):
        trainer.compute_advantage(meta)
    assert isinstance(NonFiniteError("x"), ValueError)  # so the command reports it with exit status 2
    trainer.workers.shutdown()
    plane.close()
