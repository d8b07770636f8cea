"""A vision-language policy trains end to end on the visual task; the paths that carry no images refuse at start."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.models.loading import load_causal_lm
from conveyor.models.tiny_vlm import load_image_processor, save_tiny_vlm
from conveyor.tools import CallFormat, ToolCall, register_call_format
from conveyor.trainer.export import export_hf
from conveyor.trainer.run import run_training


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2.5-VL checkpoint with its processor."""
    return str(save_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("vlm") / "qwen2_5_vl"))


def _run(vlm_path: str, run_dir) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={vlm_path}",
        "data.synthetic.task=visual_sum",
        "data.synthetic.max_operand=9",
        "data.synthetic.num_train=40",
        "data.synthetic.num_val=4",
        "data.max_prompt_length=16",
        "data.max_response_length=4",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=0",
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=false",
        "trainer.dump_freq=0",
        f"trainer.default_local_dir={run_dir}",
    ]


# The random policy never writes a sum: a reward that tells its responses apart gives GRPO a gradient.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 for a response that holds a digit, else 0."""
    return float(any(c.isdigit() for c in solution_str))
'''


def _train(vlm_path: str, tmp_path, extra: list[str]) -> dict[int, dict]:
    """Train `_run`'s run under tmp_path/run, scored by REWARD, with `extra` overrides; its metrics rows by step."""
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    run_training(
        load_config(None, [*_run(vlm_path, tmp_path / "run"), f"reward.custom_reward_function.path={reward}", *extra])
    )
    return {r["step"]: r for r in read_metrics_jsonl(tmp_path / "run" / "metrics.jsonl")}


@pytest.mark.parametrize("packed", [True, False])
def test_grpo_on_the_visual_task_trains_with_the_engines_log_probs(vlm_path, tmp_path, packed: bool) -> None:
    """Two GRPO steps with a KL-loss reference and the old-log-prob forward, packed or padded: the trainer's
    log-probs of the sampled tokens equal the engine's (the text path's bar), validation reads the images too."""
    rows = _train(
        vlm_path,
        tmp_path,
        [
            f"actor_rollout_ref.model.use_remove_padding={str(packed).lower()}",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "algorithm.rollout_correction.bypass_mode=false",
        ],
    )
    assert sorted(rows) == [0, 1, 2]
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[2]
    for step in (1, 2):
        assert 0 <= rows[step]["rollout_corr/log_prob_abs_diff/max"] < 1e-4
        assert rows[step]["actor/grad_norm"] > 0 and rows[step]["timing_s/step"] > 0
    assert 0 < rows[1]["reward/mean"] < 1
    # The trained policy exports as a vision-language checkpoint with its image processor, and loads as a policy.
    out = export_hf(tmp_path / "run", tmp_path / "export")
    model = load_causal_lm(out)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert load_image_processor(out).merge_size == 2


def test_a_verl_format_parquet_with_images_trains_with_a_custom_reward(vlm_path, tmp_path) -> None:
    """verl's multimodal layout on disk (`<image>` in the content, an `images` column of {"bytes", "path"}) loads
    as it is for a vision-language policy and trains, scored by a custom reward function."""
    from conveyor.tasks.parquet import write_parquet_records
    from conveyor.tasks.visual import make_visual_sum_records

    write_parquet_records(make_visual_sum_records(16, seed=0, max_operand=9), tmp_path / "train.parquet")
    write_parquet_records(make_visual_sum_records(4, seed=1, max_operand=9, split="test"), tmp_path / "val.parquet")
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    overrides = _run(vlm_path, tmp_path / "run") + [
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'val.parquet'}]",
        f"reward.custom_reward_function.path={reward}",
        "trainer.total_training_steps=1",
        "trainer.test_freq=0",
    ]
    run_training(load_config(None, overrides))
    rows = {r["step"]: r for r in read_metrics_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert rows[1]["actor/grad_norm"] > 0 and 0 < rows[1]["reward/mean"] < 1


@pytest.mark.parametrize(
    "override, key",
    [
        ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.name=hf"),
        (
            "trainer.num_cpu_workers=2 actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
        ),
    ],
)
def test_paths_without_images_refuse_at_start_naming_the_key(vlm_path, tmp_path, override: str, key: str) -> None:
    """vLLM, sequence parallelism: one line naming the key, exit 2, before any worker is built (a critic trains:
    tests/trainer/test_vlm_critic.py)."""
    done = subprocess.run(
        [sys.executable, "-m", "conveyor.cli", "train", *_run(vlm_path, tmp_path), *override.split()],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "is a vision-language model" in done.stderr and key in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_lora_adapters_train_over_the_vision_tower_and_the_text_model(vlm_path, tmp_path) -> None:
    """LoRA (rank 4, every linear layer, the vision tower's included): the adapters train, the reference is the
    actor with them disabled (a KL loss), and the trainer's log-probs are the engine's."""
    rows = _train(
        vlm_path,
        tmp_path,
        [
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "algorithm.rollout_correction.bypass_mode=false",
            "trainer.test_freq=0",
        ],
    )
    for step in (1, 2):
        assert 0 <= rows[step]["rollout_corr/log_prob_abs_diff/max"] < 1e-4
    assert rows[1]["actor/grad_norm"] > 0 and rows[2]["actor/kl_loss"] > 0


# An untrained policy calls the calculator whenever a turn ends at an odd digit: tool turns without a warm start.
register_call_format(
    CallFormat("test_vlm_digit_calls", stop_texts=tuple("13579"), parser=lambda turn: ToolCall("calc", text=turn)),
    overwrite=True,
)


def test_the_multi_turn_tool_loop_trains_a_vision_language_policy(vlm_path, tmp_path) -> None:
    """multi_turn with images in the prompt: every turn re-prefills the pixels, tool answers are context, and the
    trainer's log-probs of the model's tokens over the stitched trajectories are the engine's (the text bar)."""
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - name: calc\n    path: conveyor.tools.calculator:calculate\n")
    mt = "actor_rollout_ref.rollout.multi_turn"
    rows = _train(
        vlm_path,
        tmp_path,
        [
            "data.max_response_length=16",
            f"{mt}.enable=true",
            f"{mt}.format=test_vlm_digit_calls",
            f"{mt}.tool_config_path={tools}",
            f"{mt}.max_user_turns=3",
            "algorithm.rollout_correction.bypass_mode=false",
            "trainer.test_freq=0",
        ],
    )
    assert sum(rows[s]["rollout/multi_turn/tool_calls"] for s in (1, 2)) > 0
    for step in (1, 2):
        assert 0 < rows[step]["rollout/multi_turn/model_token_frac"] < 1
        assert 0 <= rows[step]["rollout_corr/log_prob_abs_diff/max"] < 1e-4
        assert rows[step]["actor/grad_norm"] > 0


@pytest.mark.parametrize("agent, samples", [("digits", 1), ("second_look", 2)])
def test_agents_through_the_gateway_train_a_vision_language_policy(vlm_path, tmp_path, agent, samples) -> None:
    """Agents on the openai client send the task's image as an image_url part: with tool turns every session is one
    sample; one that shows its image again in a later turn is cut into two, the second sample's prompt holding both
    images. Either way the trainer's log-probs of the model's tokens are the engine's (the text bar)."""
    rows = _train(
        vlm_path,
        tmp_path,
        [
            "data.max_prompt_length=32",
            "data.max_response_length=24",
            "actor_rollout_ref.rollout.multi_turn.format=test_digit_calls",
            "trainer.plugins=[tests/agent/digit_format.py]",
            f"actor_rollout_ref.rollout.agent.callable=tests/agent/gateway_agents.py:{agent}",
            "algorithm.rollout_correction.bypass_mode=false",
            "trainer.test_freq=0",
        ],
    )
    for step in (1, 2):
        r = rows[step]
        assert r["rollout/agent/ok"] == 8 and r["rollout/agent/samples_per_session"] == samples
        assert 0 <= r["rollout_corr/log_prob_abs_diff/max"] < 1e-4
        assert r["actor/grad_norm"] > 0


def test_a_separate_rollout_replica_samples_with_the_updated_weights(vlm_path, tmp_path) -> None:
    """The rollout on a replica of its own (`rollout.placement=separate`): it reads the images from the data plane,
    and after each update samples with the synced weights (step 2's log-probs are still the trainer's)."""
    rows = _train(
        vlm_path,
        tmp_path,
        [
            "actor_rollout_ref.rollout.placement=separate",
            "algorithm.rollout_correction.bypass_mode=false",
            "trainer.test_freq=0",
        ],
    )
    assert rows[1]["actor/grad_norm"] > 0
    for step in (1, 2):
        assert 0 <= rows[step]["rollout_corr/log_prob_abs_diff/max"] < 1e-4


def test_the_asynchronous_trainer_trains_on_images_with_partial_rollouts(vlm_path, tmp_path, monkeypatch) -> None:
    """trainer.v1.trainer_mode=separate_async with partial rollouts: the rollout thread generates a batch ahead with
    the images, and weights that arrive mid-generation load between two tokens, the KV cache recomputed from the
    prompt's pixels and the tokens so far (tests/rollout/test_hf_vision.py); the trainer updates on them."""
    import time

    from test_async import check_token_versions

    from conveyor.rollout.hf import HFEngine

    generate = HFEngine.generate

    def slow(self, *args, interrupt=None, **kwargs):  # a rollout slower than the update: weights arrive mid-way
        hook = None if interrupt is None else (lambda sampled: time.sleep(0.02) or interrupt(sampled))
        return generate(self, *args, interrupt=hook, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", slow)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    overrides = _run(vlm_path, tmp_path / "run") + [
        f"reward.custom_reward_function.path={reward}",
        "actor_rollout_ref.rollout.placement=separate",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.partial_rollout=true",
        "data.max_response_length=12",
        "trainer.total_training_steps=4",
        "trainer.test_freq=0",
    ]
    run_training(load_config(None, overrides))
    metrics = read_metrics_jsonl(tmp_path / "run" / "metrics.jsonl")
    rows = {r["step"]: r for r in metrics}
    assert sorted(rows) == [0, 1, 2, 3, 4] and all(rows[s]["actor/grad_norm"] > 0 for s in (1, 2, 3, 4))
    check_token_versions(metrics, tmp_path / "run")  # samples continued with newer weights, versions per token


def test_a_rollout_process_of_its_own_trains_on_images_what_the_thread_does(vlm_path, tmp_path) -> None:
    """rollout_process=own: the replica in a Ray actor of its own renders its share's prompts with their images,
    generates over the pixels and writes them back; the run equals the rollout thread's bit for bit."""
    import json

    from test_async_process import _strip  # every logged value but the measured ones (wall-clock, CPU)

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)

    def run(process: str) -> list[dict]:
        overrides = _run(vlm_path, tmp_path / process) + [
            f"reward.custom_reward_function.path={reward}",
            "trainer.v1.trainer_mode=separate_async",
            f"trainer.v1.separate_async.rollout_process={process}",
            "trainer.total_training_steps=3",
            "trainer.test_freq=0",
            "ray.num_cpus=4",
        ]
        run_training(load_config(None, overrides))
        return _strip(read_metrics_jsonl(tmp_path / process / "metrics.jsonl"))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the replica has: an op split over another number of threads may sum in another order
    try:
        own, thread = run("own"), run("trainer")
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "own" / "plan.json").read_text())["rollout_process"] == "own"
    assert own == thread and len(own) == 4
    assert all(r["actor/grad_norm"] > 0 for r in own[1:])


def test_qwen3_vl_moe_records_the_rollouts_routing_and_replays_it(tmp_path) -> None:
    """Qwen3-VL-MoE under R3: the engine records every token's experts (image tokens too), the old-log-prob
    forward replays them (its log-probs are the engine's), the MoE metrics see all of them."""
    path = str(save_tiny_vlm("qwen3_vl_moe", tmp_path / "moe"))
    overrides = _run(path, tmp_path / "run") + [
        "algorithm.rollout_correction.bypass_mode=false",
        "actor_rollout_ref.actor.router_replay.mode=R3",
        "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
        # A gradient whatever the rewards, and steps too small to move the router before the agreement is measured.
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.optim.lr=1e-7",
        "trainer.test_freq=0",
    ]
    run_training(load_config(None, overrides))
    rows = {r["step"]: r for r in read_metrics_jsonl(tmp_path / "run" / "metrics.jsonl")}
    for step in (1, 2):
        row = rows[step]
        assert row["rollout/moe/routed_experts_found"] == 1.0
        assert row["rollout/moe/routing_from_trainer_forward"] == 0.0
        assert row["rollout/moe/routed_expert_assignments"] > 0
        assert row["actor/moe/routing_agreement"] > 0.9
        assert 0 <= row["rollout_corr/log_prob_abs_diff/max"] < 1e-4


def test_a_prompt_longer_than_the_limit_with_its_images_stops_at_load(vlm_path, tmp_path) -> None:
    """Measured with each '<image>' as its pad tokens: too long stops at load naming the problem and the key."""
    from conveyor.trainer.setup import load_prompt_records

    cfg = load_config(None, [*_run(vlm_path, tmp_path), "data.max_prompt_length=6", "data.truncation=left"])
    with pytest.raises(ValueError, match=r"synthetic train problem 0: the prompt with its images is 7 tokens.*raise"):
        load_prompt_records(cfg)
    train, _ = load_prompt_records(load_config(None, _run(vlm_path, tmp_path)))
    assert train[0]["images"]


def test_the_visual_task_with_a_text_policy_stops_at_load(tmp_path) -> None:
    """The tiny text model given the visual task: one line naming the key, before any model is built."""
    from conveyor.trainer.setup import load_prompt_records

    overrides = ["data.synthetic.task=visual_sum", "data.synthetic.max_operand=9", "data.synthetic.num_train=40"]
    cfg = load_config(None, [*overrides, "data.synthetic.num_val=4"])
    with pytest.raises(ValueError, match=r"draws images, but the policy is a text model; set actor_rollout_ref"):
        load_prompt_records(cfg)


def test_a_vision_language_teacher_scores_the_students_samples_with_their_pixels(vlm_path, tmp_path) -> None:
    """Distillation with a vision-language student: the teacher's forward reads each sample's pixels and M-RoPE
    positions as the student's does. The student itself as the teacher, one mini-batch: the exact reverse KL of the
    first update (taken before its optimizer step) is zero; the task reward then moves the student off the teacher,
    and the second step's is not."""
    loss = "distillation.distillation_loss"
    rows = _train(
        vlm_path,
        tmp_path,
        [
            "distillation.enabled=true",
            f"distillation.teacher_models.t.model_path={vlm_path}",
            f"{loss}.loss_mode=full_reverse_kl",
            f"{loss}.use_task_rewards=true",
            "trainer.total_training_steps=2",
            "trainer.test_freq=0",
        ],
    )
    assert rows[1]["distill/kl_exact"] < 1e-6, rows[1]["distill/kl_exact"]
    assert rows[2]["distill/kl_exact"] > 1e-6 and rows[1]["actor/grad_norm"] > 0


def test_a_teacher_that_would_read_the_pixels_otherwise_is_refused(vlm_path, tmp_path) -> None:
    """A text teacher for a vision-language student (same tokens), or one with another image processing: refused at
    start naming the teacher's key and what differs."""
    import json

    from conveyor.config import ConfigError
    from conveyor.models.loading import load_model_config, load_tokenizer
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tiny_vlm import build_vlm_tokenizer
    from conveyor.trainer.distillation import check_teachers

    tok = build_vlm_tokenizer()
    text = tmp_path / "text"
    build_tiny_model("qwen3", tok, seed=0).save_pretrained(text)
    tok.save_pretrained(text)
    other = save_tiny_vlm("qwen2_5_vl", tmp_path / "other")
    settings = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(json.dumps({**settings, "image_mean": [0.5, 0.5, 0.5]}))
    same = save_tiny_vlm("qwen2_5_vl", tmp_path / "same", seed=3)
    student_tok, student = load_tokenizer(vlm_path), load_model_config(vlm_path)
    key = "distillation.teacher_models.t.model_path"
    for teacher, why in [
        (text, "the student sees images and the teacher does not"),
        (other, r"its image processor differs from the student's \(image_mean\)"),
    ]:
        cfg = load_config(None, [*_run(vlm_path, tmp_path), "distillation.enabled=true", f"{key}={teacher}"])
        with pytest.raises(ConfigError, match=rf"{key}: {why}"):
            check_teachers(cfg, student_tok, student)
    cfg = load_config(None, [*_run(vlm_path, tmp_path), "distillation.enabled=true", f"{key}={same}"])
    check_teachers(cfg, student_tok, student)  # another seed of the same family: the same pixels
