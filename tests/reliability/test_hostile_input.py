"""Hostile files and hostile environments end in one `error:` line and exit status 2: never a prompt, a hang,
a traceback, an OOM kill or a write outside the run directory.

Numbers that are not numbers, names that are paths, checkpoints that are
broken or ship code, data rows with holes in them, reward functions that exit,
overflow or hang: each is run through the command's entry point
(`conveyor.cli.main`) in one child process with stdin closed, as
`test_bad_input.py` does. A checkpoint that ships code gets a `conveyor train`
process of its own, stdin closed and a deadline, since the failure it guards
against is a question on stdin. Also here: `conveyor show` escaping terminal
control characters, and the transferqueue backend listening on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conveyor.metrics.dumps import write_generations
from conveyor.tasks.parquet import write_parquet_records
from conveyor.tasks.synthetic import make_arithmetic_records

# --------------------------------------------------------------------------- numbers, names and lists in the config
_NAN_YAML = "algorithm:\n  gamma: .nan\n"

CONFIG_CASES = {
    # Today a NaN entropy coefficient makes every loss NaN: every optimizer step is skipped and the run exits 0.
    "entropy_coeff_nan": (
        ["actor_rollout_ref.actor.entropy_coeff=.nan"],
        ("actor_rollout_ref.actor.entropy_coeff", "finite", "nan"),
    ),
    "entropy_coeff_nan_text": (
        ["actor_rollout_ref.actor.entropy_coeff=nan"],
        ("actor_rollout_ref.actor.entropy_coeff", "finite"),
    ),
    "lr_inf": (["actor_rollout_ref.actor.optim.lr=.inf"], ("actor_rollout_ref.actor.optim.lr", "finite", "inf")),
    "lr_overflows_a_double": (
        ["actor_rollout_ref.actor.optim.lr=1e400"],
        ("actor_rollout_ref.actor.optim.lr", "finite"),
    ),
    "float_overflows_float32": (
        ["actor_rollout_ref.actor.clip_ratio_c=1e39"],
        ("actor_rollout_ref.actor.clip_ratio_c", "overflows float32"),
    ),
    "int_beyond_a_double_for_a_float": (["critic.optim.lr=1" + "0" * 400], ("critic.optim.lr", "too large")),
    "int_beyond_int64": (["trainer.seed=" + "9" * 30], ("trainer.seed", "too large")),
    "nan_in_a_list": (
        ["actor_rollout_ref.actor.optim.betas=[0.9,.nan]"],
        ("actor_rollout_ref.actor.optim.betas", "finite"),
    ),
    "nan_in_a_config_file": (["--config", "{tmp}/nan.yaml"], ("algorithm.gamma", "finite")),
    "nan_through_interpolation": (
        ["actor_rollout_ref.actor.kl_loss_coef=${algorithm.kl_ctrl.kl_coef}", "algorithm.kl_ctrl.kl_coef=.nan"],
        ("finite",),
    ),
    "zero_count": (["actor_rollout_ref.rollout.n=0"], ("actor_rollout_ref.rollout.n", "> 0")),
    "negative_size": (["data.max_response_length=-1"], ("data.max_response_length", "> 0")),
    "zero_micro_batch": (["critic.ppo_micro_batch_size_per_gpu=0"], ("critic.ppo_micro_batch_size_per_gpu",)),
    "probability_above_one": (["actor_rollout_ref.rollout.top_p=1.5"], ("actor_rollout_ref.rollout.top_p", "(0, 1]")),
    "discount_above_one": (["algorithm.gamma=2"], ("algorithm.gamma", "[0, 1]")),
    "unknown_estimator": (["algorithm.adv_estimator=grpoo"], ("algorithm.adv_estimator", "did you mean 'grpo'")),
    "unknown_dtype": (["actor_rollout_ref.model.dtype=float64"], ("actor_rollout_ref.model.dtype",)),
    "betas_of_the_wrong_length": (
        ["actor_rollout_ref.actor.optim.betas=[0.9]"],
        ("actor_rollout_ref.actor.optim.betas", "two numbers"),
    ),
    "betas_not_numbers": (["actor_rollout_ref.actor.optim.betas=[a,b]"], ("actor_rollout_ref.actor.optim.betas",)),
    "zero_target_kl": (["algorithm.kl_ctrl.target_kl=0"], ("algorithm.kl_ctrl.target_kl", "> 0")),
    "zero_critic_grad_clip": (["critic.grad_clip=0"], ("critic.grad_clip", "> 0")),
    "zero_warmstart_lr": (
        ["actor_rollout_ref.model.tiny.warmstart_lr=0"],
        ("actor_rollout_ref.model.tiny.warmstart_lr",),
    ),
    "heads_do_not_divide": (
        ["actor_rollout_ref.model.tiny.num_kv_heads=3"],
        ("actor_rollout_ref.model.tiny.num_kv_heads",),
    ),
    "zero_ray_cpus": (["ray.num_cpus=0"], ("ray.num_cpus", "> 0")),
    "negative_reward_timeout": (["reward.timeout_s=-1"], ("reward.timeout_s", ">= 0")),
    "train_files_null": (["data.train_files=[null]"], ("data.train_files", "None", "not a file path")),
    "train_files_empty": (["data.train_files=[]"], ("data.train_files", "empty list")),
    # The run directory is runs/<experiment_name>: none of these may leave runs/.
    "experiment_name_parent": (
        ["trainer.experiment_name=../escaped"],
        ("trainer.experiment_name", "'../escaped'", "trainer.default_local_dir"),
    ),
    "experiment_name_absolute": (["trainer.experiment_name={tmp}/escaped"], ("trainer.experiment_name",)),
    "experiment_name_nested": (["trainer.experiment_name=a/b"], ("trainer.experiment_name", "no '/'")),
    "experiment_name_dotdot": (["trainer.experiment_name=.."], ("trainer.experiment_name",)),
}


@pytest.fixture(scope="module")
def config_results(rel, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every config case, run in one child process whose working directory is an empty folder."""
    tmp = tmp_path_factory.mktemp("hostile-config")
    (tmp / "nan.yaml").write_text(_NAN_YAML)
    cases = {case: ["train", *(a.replace("{tmp}", str(tmp)) for a in args)] for case, (args, _) in CONFIG_CASES.items()}
    before = sorted(p.name for p in tmp.iterdir())
    results = rel.run_cases_in_one_process(cases, tmp, timeout=300)
    # Nothing was started or written: no runs/, no escaped run directory, in the folder or above it.
    after = sorted(p.name for p in tmp.iterdir())
    assert after == sorted(before + ["cases.json", "driver.py", "results.json"]), after
    assert not (tmp / "escaped").exists() and not (tmp.parent / "escaped").exists()
    return results


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_number_name_or_list_mistake_is_one_line(rel, config_results: dict, case: str) -> None:
    result = config_results[case]
    rel.assert_usage_error(result["status"], result["stderr"], CONFIG_CASES[case][1])
    assert len(result["stderr"].strip().splitlines()) == 1 and result["stdout"] == ""


# --------------------------------------------------------------------------- checkpoints, data, reward functions
_REWARDS = {
    "calls_exit.py": "import sys\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    sys.exit(0)\n",
    "huge_int.py": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return 10 ** 400\n",
    "hangs.py": "import time\n\ndef slow_grader(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    time.sleep(3600)\n",
}


def _model_copy(base_model: str, target: Path, *, drop: tuple[str, ...] = (), config: dict | None = None) -> Path:
    """A copy of the tiny checkpoint without the files in `drop`, its config.json updated with `config`."""
    shutil.copytree(base_model, target)
    for name in drop:
        (target / name).unlink()
    if config:
        data = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**data, **config}))
    return target


def _hostile_files(base_model: str, tmp: Path) -> None:
    """Broken checkpoints, prompt files with holes, and misbehaving reward functions under `tmp`."""
    bad_json = _model_copy(base_model, tmp / "bad_json")
    (bad_json / "config.json").write_text('{"model_type": "qwen3_moe",\n  "hidden_size": 64,,\n}')
    _model_copy(base_model, tmp / "no_weights", drop=("model.safetensors",))
    cut = _model_copy(base_model, tmp / "cut_weights")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    tokenizer_files = [p.name for p in Path(base_model).iterdir() if p.name.startswith(("tokenizer", "special_tokens"))]
    _model_copy(base_model, tmp / "no_tokenizer", drop=tuple(tokenizer_files))
    # Positions for a 100k-token prompt, so that what stops it is the memory it needs.
    _model_copy(base_model, tmp / "long_context", config={"max_position_embeddings": 400_000})

    records = make_arithmetic_records(16, seed=3, max_operand=9, split="train")
    write_parquet_records(records, tmp / "good.parquet")
    table = pa.Table.from_pylist(records)

    def with_column(name: str, values: list, path: str) -> None:
        pq.write_table(table.set_column(table.schema.get_field_index(name), name, values), tmp / path)

    truth = [r["reward_model"]["ground_truth"] for r in records]
    with_column(
        "reward_model",
        pa.array([{"style": "rule", "ground_truth": None if i == 3 else t} for i, t in enumerate(truth)]),
        "null_truth.parquet",
    )
    with_column(
        "reward_model",
        pa.array(
            [{"style": "rule", "ground_truth": float("nan") if i == 5 else float(t)} for i, t in enumerate(truth)]
        ),
        "nan_truth.parquet",
    )
    prompts = [r["prompt"] for r in records]
    with_column("prompt", pa.array([[] if i == 2 else p for i, p in enumerate(prompts)]), "empty_prompt.parquet")
    with_column("prompt", pa.array([None if i == 4 else p for i, p in enumerate(prompts)]), "null_prompt.parquet")
    with_column(
        "prompt",
        pa.array([[{"role": "user", "content": [{"type": "image", "url": "x.png"}]}]] * 16),
        "image_prompt.parquet",
    )
    with_column(
        "data_source",
        pa.array([None if i == 6 else r["data_source"] for i, r in enumerate(records)]),
        "null_source.parquet",
    )
    # Row 15 is too long; with no shuffling, the one step run here never draws it, so only a check at load finds it.
    long_last = [*records[:15], {**records[15], "prompt": [{"role": "user", "content": "1+" * 40 + "1="}]}]
    write_parquet_records(long_last, tmp / "long_last_row.parquet")
    huge = [{**records[0], "prompt": [{"role": "user", "content": "1+" * 50_000 + "1="}]}, *records[1:]]
    write_parquet_records(huge, tmp / "huge_prompt.parquet")
    for name, text in _REWARDS.items():
        (tmp / name).write_text(text)


def _runtime_cases(base_model: str, tmp: Path) -> dict[str, list[str]]:
    _hostile_files(base_model, tmp)

    def run(case: str, *extra: str, model: str | Path | None = base_model) -> list[str]:
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
            "data.shuffle=false",
            f"actor_rollout_ref.model.path={'null' if model is None else model}",
            f"trainer.default_local_dir={tmp / 'runs' / case}",
            *extra,
        ]

    def files(name: str) -> str:
        return f"data.train_files=[{tmp / name}]"

    custom = "reward.custom_reward_function.path={}".format
    return {
        "config_json_not_json": run("config_json_not_json", model=tmp / "bad_json"),
        "no_weights": run("no_weights", model=tmp / "no_weights"),
        "weights_cut_in_half": run("weights_cut_in_half", model=tmp / "cut_weights"),
        "no_tokenizer": run("no_tokenizer", model=tmp / "no_tokenizer"),
        "lengths_beyond_the_model_positions": run("lengths_beyond_the_model_positions", "data.max_prompt_length=100"),
        "huge_prompt_on_a_checkpoint": run(
            "huge_prompt_on_a_checkpoint",
            files("huge_prompt.parquet"),
            "data.max_prompt_length=200000",
            model=tmp / "long_context",
        ),
        # The tiny model built from config takes its positions from these lengths: only memory can stop it.
        "huge_prompt_on_the_tiny_model": run(
            "huge_prompt_on_the_tiny_model",
            files("huge_prompt.parquet"),
            "data.max_prompt_length=200000",
            "actor_rollout_ref.model.tiny.warmstart_steps=0",
            model=None,
        ),
        "ground_truth_null": run("ground_truth_null", files("null_truth.parquet")),
        "ground_truth_nan": run("ground_truth_nan", files("nan_truth.parquet")),
        "prompt_empty_list": run("prompt_empty_list", files("empty_prompt.parquet")),
        "prompt_null": run("prompt_null", files("null_prompt.parquet")),
        "prompt_not_text": run("prompt_not_text", files("image_prompt.parquet")),
        "data_source_null": run("data_source_null", files("null_source.parquet"), custom(tmp / "huge_int.py")),
        "prompt_too_long_found_at_load": run(
            "prompt_too_long_found_at_load", files("long_last_row.parquet"), "data.max_prompt_length=20"
        ),
        "reward_calls_sys_exit": run("reward_calls_sys_exit", custom(tmp / "calls_exit.py")),
        "reward_beyond_a_float": run("reward_beyond_a_float", custom(tmp / "huge_int.py")),
        "reward_hangs": run(
            "reward_hangs",
            custom(tmp / "hangs.py"),
            "reward.custom_reward_function.name=slow_grader",
            "reward.timeout_s=1",
        ),
    }


RUNTIME_ERRORS = {
    "config_json_not_json": ("bad_json/config.json", "not valid JSON", "line 2", "actor_rollout_ref.model.path"),
    "no_weights": ("no_weights", "no weights", "model.safetensors", "actor_rollout_ref.model.path"),
    "weights_cut_in_half": ("cut_weights/model.safetensors", "cut short", "actor_rollout_ref.model.path"),
    "no_tokenizer": ("no_tokenizer", "no tokenizer", "actor_rollout_ref.model.tokenizer_path"),
    "lengths_beyond_the_model_positions": ("100 + 6 = 106", "max_position_embeddings=78", "data.max_prompt_length"),
    "huge_prompt_on_a_checkpoint": ("huge_prompt.parquet', row 0", "100008 tokens", "GiB", "data.max_prompt_length"),
    "huge_prompt_on_the_tiny_model": ("huge_prompt.parquet', row 0", "GiB", "data.truncation=left"),
    "ground_truth_null": ("null_truth.parquet', row 3", "reward_model.ground_truth is null"),
    "ground_truth_nan": ("nan_truth.parquet', row 5", "reward_model.ground_truth is nan"),
    "prompt_empty_list": ("empty_prompt.parquet', row 2", "empty list"),
    "prompt_null": ("null_prompt.parquet', row 4", "list of chat messages", "None"),
    "prompt_not_text": ("image_prompt.parquet', row 0", "not text"),
    "data_source_null": ("null_source.parquet', row 6", "'data_source' is None"),
    "prompt_too_long_found_at_load": (
        "long_last_row.parquet', row 15",
        "data.max_prompt_length=20",
        "data.truncation=left",
    ),
    "reward_calls_sys_exit": ("calls_exit.py", "called sys.exit(0)", "sample 'train-1/p0/s0'"),
    "reward_beyond_a_float": ("huge_int.py", "an int of 401 digits, too large for a float", "not a finite number"),
    "reward_hangs": ("slow_grader", "hangs.py", "reward.timeout_s=1s", "sample 'train-1/p0/s0'"),
}


@pytest.fixture(scope="module")
def runtime(rel, base_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every run-time case, through the command's entry point in one child process with stdin closed."""
    tmp = tmp_path_factory.mktemp("hostile-runtime")
    return {"dir": tmp, "results": rel.run_cases_in_one_process(_runtime_cases(base_model, tmp), tmp, timeout=900)}


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.parametrize("case", sorted(RUNTIME_ERRORS))
def test_hostile_file_or_function_is_a_usage_error_naming_the_culprit(rel, runtime: dict, case: str) -> None:
    if case.startswith("huge_prompt") and _memory_bytes() > 100_007**2 * 17:
        pytest.skip("this machine could hold the attention of a 100k-token prompt")
    result = runtime["results"][case]
    rel.assert_usage_error(result["status"], result["stderr"], RUNTIME_ERRORS[case])
    run_dir = runtime["dir"] / "runs" / case
    assert not (run_dir / "checkpoints").exists()
    if not case.startswith("reward"):  # found before the first step
        assert not (run_dir / "metrics.jsonl").exists()


def test_a_checkpoint_that_ships_code_is_refused_without_asking(rel, tmp_path: Path) -> None:
    """config.json's auto_map names code of its own and its model type is unknown: one line naming the key, no
    prompt."""
    model = tmp_path / "custom_model"
    model.mkdir()
    marker = tmp_path / "custom code ran"
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "conveyor_test_custom_lm",
                "architectures": ["CustomLM"],
                "auto_map": {"AutoConfig": "custom_lm.CustomConfig", "AutoModelForCausalLM": "custom_lm.CustomLM"},
            }
        )
    )
    (model / "custom_lm.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    run_dir = tmp_path / "run"
    # The child's stdin is closed (rel.run_cli), as under a scheduler: a prompt would find no answer.
    proc = rel.run_cli(
        "train",
        f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=false",
        timeout=120,
    )
    rel.assert_usage_error(
        proc.returncode, proc.stderr, ("custom_model", "auto_map", "actor_rollout_ref.model.trust_remote_code=true")
    )
    assert "[y/N]" not in proc.stdout + proc.stderr
    assert not marker.exists()


# --------------------------------------------------------------------------- `conveyor show` and terminal controls
def test_show_escapes_terminal_control_characters(rel, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    response = "clear\x1b[2J bell\x07 back\x08 return\r over\x1b]0;title\x07 c1\x9b rtl\u202eevil"
    write_generations(
        run_dir,
        3,
        [
            {
                "prompt": "1+2=\x1b[31m",
                "response": response,
                "ground_truth": "3\r",
                "data_source": "src\x1b[1m",
                "reward": 1.0,
                "advantage": 0.5,
                "note": "del\x7f",
            }
        ],
    )
    proc = rel.run_cli("show", str(run_dir), timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    # Nothing a terminal would act on: only newlines are left of the control characters.
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]", out), repr(out)
    for shown in (
        r"clear\x1b[2J",
        r"bell\x07",
        r"back\x08",
        r"return\r",
        r"\x1b]0;title\x07",
        r"c1\x9b",
        r"rtl\u202eevil",
        r"1+2=\x1b[31m",
        r"ground truth: 3\r",
        r"source src\x1b[1m",
    ):
        assert shown in out, (shown, out)


# --------------------------------------------------------------------------- the transferqueue backend's listeners
def test_transferqueue_listens_on_127_0_0_1_only() -> None:
    """Its wire protocol is unauthenticated pickle: no TransferQueue listener may be reachable from another machine."""
    pytest.importorskip("transfer_queue")
    psutil = pytest.importorskip("psutil")
    import ray
    import torch

    from conveyor.data_plane import make_data_plane

    plane = make_data_plane(
        "transferqueue",
        tq_config={"backend": {"SimpleStorage": {"num_data_storage_units": 2}}, "metrics": {"enabled": True}},
    )
    try:
        keys = ["a", "b", "c"]
        plane.kv_batch_put(keys, "p", {"x": torch.arange(3)})
        assert plane.kv_batch_get(keys, "p", ["x"])["x"].tolist() == [0, 1, 2]  # it works on loopback
        actors = [plane._controller, *plane._storage["SimpleStorage"].values()]
        pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors])
        # Ray's own worker port (token-authenticated, not TransferQueue's) is the one listener Ray opens per worker.
        ray_ports = {ray._private.state.actors(a._actor_id.hex())["Address"]["Port"] for a in actors}
        announced = set(plane._connection[0].ports.values())
        listeners = [
            c.laddr
            for pid in pids
            for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert announced <= {addr.port for addr in listeners}
        assert int(plane.tq_metrics_endpoint.rsplit(":", 1)[1]) in {addr.port for addr in listeners}
        exposed = [addr for addr in listeners if addr.ip != "127.0.0.1" and addr.port not in ray_ports]
        assert not exposed, exposed
        assert plane._connection[0].ip == "127.0.0.1"
    finally:
        plane.close()


def test_a_hung_reward_function_stops_the_step_after_reward_timeout_s(tmp_path: Path) -> None:
    """The reward worker gives up on a call after timeout_s (the call itself is abandoned in its daemon thread)."""
    import time

    import torch

    from conveyor.data_plane import make_data_plane
    from conveyor.models.tokenizer import build_char_tokenizer
    from conveyor.workers.ranks.reward import RewardWorker, SampleRewardError

    (tmp_path / "hangs.py").write_text(_REWARDS["hangs.py"])
    (tmp_path / "slowish.py").write_text(
        "import time\n\ndef compute_score(data_source, solution_str, ground_truth, "
        "extra_info=None):\n    time.sleep(0.05)\n    return 0.5\n"
    )
    plane = make_data_plane("memory")
    fields = {
        "responses": torch.tensor([[5, 6], [7, 0]]),
        "response_mask": torch.tensor([[1, 1], [1, 0]]).bool(),
        "data_source": ["s", "s"],
        "ground_truth": ["1", "2"],
    }
    meta = plane.kv_batch_put(["k0", "k1"], "part", fields)
    tok = build_char_tokenizer()
    slowish = RewardWorker(
        tokenizer=tok, data_plane=plane, custom_reward_path=str(tmp_path / "slowish.py"), timeout_s=5
    )
    slowish.compute_reward(meta)  # slower than nothing, well within the limit: scored
    assert plane.kv_batch_get(["k0", "k1"], "part", ["acc"])["acc"].tolist() == [0.5, 0.5]
    hung = RewardWorker(
        tokenizer=tok,
        data_plane=plane,
        custom_reward_path=str(tmp_path / "hangs.py"),
        custom_reward_name="slow_grader",
        timeout_s=0.5,
    )
    start = time.monotonic()
    with pytest.raises(
        SampleRewardError,
        match=r"^sample 'k0': custom reward function slow_grader from .*hangs\.py "
        r"did not return within reward\.timeout_s=0\.5s",
    ):
        hung.compute_reward(meta)
    assert time.monotonic() - start < 5
    plane.close()
