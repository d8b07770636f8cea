"""The memory accounting of a vLLM rollout and the start-up check that refuses a layout that cannot fit a GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conveyor.config import ConfigError, load_config
from conveyor.trainer.plan import build_run_plan
from conveyor.workers.training.memory_budget import (
    GB,
    Engine,
    account,
    check_memory,
    engine_terms,
    kv_bytes_per_token,
    layout_of,
    misfits,
    setup_of,
    total,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpu_moe_gsm8k.yaml"
RO = "actor_rollout_ref.rollout"
H100 = 80 * GB  # the accounting's 80 GB GPU (benchmarks/memory.py --gpu-gb 80)


@pytest.fixture(scope="module")
def moe_config():
    """Qwen3-30B-A3B's config (counted on the meta device, no weights)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def moe(moe_config):
    return layout_of(moe_config)


def _example(*overrides: str):
    cfg = load_config(EXAMPLE, list(overrides))
    return cfg, build_run_plan(cfg, "cuda", is_moe=True)


def test_the_example_fits_eight_80gb_gpus_with_qwen3_30b_a3b(moe, moe_config) -> None:
    cfg, plan = _example()
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == 8 and plan.engine == "vllm"
    s = setup_of(cfg, plan, H100)
    assert misfits(lay := moe, s, H100) == []
    acc = account(lay, s)
    assert all(total(terms) <= H100 for terms in acc.values()), {p: total(t) / GB for p, t in acc.items()}
    # Awake: the actor's float32 shards beside the engine's whole share (0.6 x 80 GB); AdamW waits on the host.
    assert acc["rollout"]["actor parameters"] == pytest.approx(moe.params / 8 * 4)
    assert "optimizer state" not in acc["rollout"] and "reference parameters" not in acc["rollout"]
    assert total(acc["rollout"]) == pytest.approx(moe.params / 8 * 4 + 0.6 * H100)
    check_memory(cfg, plan, moe_config, "cuda", capacity=H100)  # no refusal


def test_engine_terms_follow_dtype_tp_and_utilization(moe) -> None:
    eng = Engine(capacity=H100, gpu_memory_utilization=0.5, tp=4, weight_bytes=2, max_model_len=1536)
    terms = engine_terms(moe, eng)
    assert terms["engine weights"] == pytest.approx(moe.params * 2 / 4)
    assert total(terms) == pytest.approx(0.5 * H100)  # the KV cache is the rest of the engine's share
    # Four key/value heads over tp 4: one per GPU; over tp 8 each GPU still holds one (vLLM replicates).
    one_head = 2 * moe.layers * (moe.kv_dim // 4) * 2
    assert kv_bytes_per_token(moe, eng) == one_head
    assert kv_bytes_per_token(moe, dataclasses.replace(eng, tp=8)) == one_head
    assert kv_bytes_per_token(moe, dataclasses.replace(eng, tp=1)) == 4 * one_head


def test_the_default_engine_is_refused_naming_the_keys(moe_config) -> None:
    # tp 1, utilization 0.5: 61 GB of bfloat16 weights in a 40 GB share.
    cfg, plan = _example(f"{RO}.tensor_model_parallel_size=1", f"{RO}.gpu_memory_utilization=0.5")
    with pytest.raises(ConfigError) as err:
        check_memory(cfg, plan, moe_config, "cuda", capacity=H100)
    msg = str(err.value)
    assert "weights do not fit its share" in msg
    assert f"{RO}.gpu_memory_utilization (at least 0.78 for one sequence)" in msg
    assert f"{RO}.tensor_model_parallel_size (at least 2)" in msg


def test_the_engine_awake_beside_adamw_is_refused_naming_the_offloads(moe, moe_config) -> None:
    # tp 4 fits the engine's share, but the trainer's float32 shards and AdamW (46 GB) stay beside its 40 GB.
    cfg, plan = _example(
        f"{RO}.gpu_memory_utilization=0.5", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false"
    )
    found = misfits(moe, setup_of(cfg, plan, H100), H100)
    assert [m.what for m in found] == ["the vLLM engine awake beside what the trainer keeps on the GPU"]
    assert found[0].need / GB == pytest.approx(85.8, abs=0.05)
    with pytest.raises(ConfigError) as err:
        check_memory(cfg, plan, moe_config, "cuda", capacity=H100)
    msg = str(err.value)
    for key in (
        f"{RO}.gpu_memory_utilization (at most 0.43",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "trainer.n_gpus_per_node",
    ):
        assert key in msg, msg
    assert "ref.fsdp_config.param_offload" not in msg  # the example's reference is on the host already


def test_a_kv_cache_too_small_for_one_sequence_names_the_lengths(moe, moe_config) -> None:
    cfg, plan = _example(
        f"{RO}.gpu_memory_utilization=0.2",
        "data.max_response_length=32000",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    )
    found = misfits(moe, setup_of(cfg, plan, H100), H100)
    assert "cannot hold one sequence of max_model_len=32512" in found[0].what
    assert any("max_model_len" in k for k in found[0].keys)


def test_an_engine_that_does_not_sleep_keeps_its_share_through_training(moe) -> None:
    cfg, plan = _example(f"{RO}.free_cache_engine=false")
    s = setup_of(cfg, plan, H100)
    asleep = account(moe, dataclasses.replace(s, engine=dataclasses.replace(s.engine, sleeps=True)))
    acc = account(moe, s)
    assert total(acc["update_actor"]) == pytest.approx(total(asleep["update_actor"]) + 0.6 * H100)
    found = misfits(moe, s, H100)
    assert any("update_actor" in m.what and f"{RO}.free_cache_engine=true" in m.keys for m in found)


def test_a_separate_engine_holds_nothing_of_the_trainers(moe) -> None:
    cfg, plan = _example(f"{RO}.placement=separate")
    s = setup_of(cfg, plan, H100)
    assert set(account(moe, s)["rollout"]) == {"engine weights", "engine activations", "KV cache"}
    assert misfits(moe, s, H100) == []


def test_the_check_leaves_the_hf_rollout_and_cpu_runs_alone(moe_config) -> None:
    cfg, plan = _example(f"{RO}.name=hf", f"{RO}.gpu_memory_utilization=0.01")
    check_memory(cfg, plan, moe_config, "cuda", capacity=H100)
    cfg, plan = _example(f"{RO}.gpu_memory_utilization=0.01")
    check_memory(cfg, plan, moe_config, "cpu", capacity=H100)
    with pytest.raises(ConfigError):
        check_memory(cfg, plan, moe_config, "cuda", capacity=H100)


def test_the_cli_refuses_a_layout_that_cannot_fit_with_exit_status_2(tiny_run, monkeypatch, capsys) -> None:
    # A GPU run as the trainer makes it, up to the check: the device and its memory are the only things faked.
    import conveyor.trainer.run as run
    import conveyor.workers.training.memory_budget as budget
    from conveyor.cli import main

    monkeypatch.setattr(run, "resolve_device", lambda cfg: "cuda")
    monkeypatch.setattr(budget, "_gpu_capacity", lambda: H100)
    status = main(
        [
            "train",
            "--config",
            str(EXAMPLE.parent / "vllm_cpu.yaml"),
            *tiny_run,
            "actor_rollout_ref.model.tiny.warmstart_steps=0",
            f"{RO}.gpu_memory_utilization=0.0001",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2, err
    assert "the vllm rollout does not fit a GPU of 80.0 GB" in err and f"{RO}.gpu_memory_utilization" in err


def test_the_fused_log_prob_replaces_the_logits_with_one_block(moe) -> None:
    """use_fused_kernels reaches the setup; the (tokens, vocabulary) terms give way to one block, which does not
    grow with the response, plus a float32 sum of the LM head's gradient under bf16 compute."""
    cfg, plan = _example()
    assert not setup_of(cfg, plan, H100).fused_logprob
    cfg, plan = _example("actor_rollout_ref.model.use_fused_kernels=true")
    assert setup_of(cfg, plan, H100).fused_logprob
    from conveyor.algos.fused_logprob import DEFAULT_FUSED_CHUNK_ELEMENTS
    from conveyor.workers.training.memory_budget import Setup

    base = Setup(world=8, rollout_seqs=1, seq_len=8192, micro_seqs=1, compute_bytes=2)
    plain, fused = account(moe, base), account(moe, dataclasses.replace(base, fused_logprob=True))
    assert plain["update_actor"]["logits and their gradient"] == 2 * 8192 * moe.vocab * 2
    block = DEFAULT_FUSED_CHUNK_ELEMENTS // moe.vocab * moe.vocab
    assert "logits and their gradient" not in fused["update_actor"] and "logits" not in fused["old_log_prob"]
    assert fused["update_actor"]["log-prob blocks"] == 4 * block * 4
    assert fused["update_actor"]["LM head gradient (float32 sum)"] == moe.vocab * moe.hidden * 4
    longer = account(moe, dataclasses.replace(base, seq_len=4 * 8192, fused_logprob=True))
    assert longer["update_actor"]["log-prob blocks"] == fused["update_actor"]["log-prob blocks"]
    for phase in ("old_log_prob", "update_actor"):
        assert total(fused[phase]) < total(plain[phase])


def test_sequence_parallelism_divides_the_per_token_terms_only(moe) -> None:
    """ulysses_sequence_parallel_size reaches the setup; a rank's activations and logits are its 1/sp of the tokens,
    plus one attention's all-to-all buffers, while the state and the gathered layers stay what they were."""
    cfg, plan = _example(
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=4",
    )
    assert setup_of(cfg, plan, H100).sp == 4
    from conveyor.workers.training.memory_budget import Setup

    base = Setup(world=8, rollout_seqs=1, seq_len=8192, micro_seqs=1, compute_bytes=2, checkpointing=True)
    one, four = account(moe, base), account(moe, dataclasses.replace(base, sp=4))
    for phase, term in (("update_actor", "activations kept"), ("update_actor", "logits and their gradient")):
        assert four[phase][term] == one[phase][term] / 4
    assert four["old_log_prob"]["activations"] == one["old_log_prob"]["activations"] / 4
    for term in ("actor parameters", "gathered weights", "gradients", "optimizer state"):
        assert four["update_actor"][term] == one["update_actor"][term]
    assert "sequence all-to-all buffers" not in one["update_actor"]
    q_dim = moe.q_dim
    assert q_dim == 32 * 128 != moe.hidden  # Qwen3-30B-A3B's attention is wider than its hidden size
    assert four["update_actor"]["sequence all-to-all buffers"] == 2 * 2048 * (2 * q_dim + 2 * moe.kv_dim) * 2
    assert total(four["update_actor"]) < total(one["update_actor"])
    # The rollout is not split: its KV cache is the same either way.
    assert four["rollout"] == one["rollout"]


def test_colocated_teachers_and_reward_models_count_beside_the_engine(moe, moe_config, tmp_path) -> None:
    """Their shards stay on the actor's GPUs: the check counts them and names the keys that move them off."""
    moe_config.save_pretrained(tmp_path / "teacher")  # config.json is all the accounting reads
    moe_config.save_pretrained(tmp_path / "rm")
    roles = (
        "distillation.enabled=true",
        f"distillation.teacher_models.big.model_path={tmp_path / 'teacher'}",
        "reward_model.enable=true",
        f"reward_model.model.path={tmp_path / 'rm'}",
        "reward_model.model.dtype=bfloat16",
    )
    cfg, plan = _example(*roles)
    s = setup_of(cfg, plan, H100)
    teacher, rm = s.frozen
    # The teacher in the actor's float32, sharded over the 8 ranks; the reward model in bf16 without its LM head.
    assert teacher.resident == pytest.approx(moe.params / 8 * 4)
    assert rm.resident == pytest.approx((moe.params - moe.vocab * moe.hidden + moe.hidden) / 8 * 2)
    state = account(moe, s)["rollout"]
    assert state["teacher big parameters"] == teacher.resident and state["reward model parameters"] == rm.resident
    (found,) = misfits(moe, s, H100)  # the example alone fits (above); beside both it does not
    assert found.what == "the vLLM engine awake beside what the trainer keeps on the GPU"
    alone = total(account(moe, dataclasses.replace(s, frozen=()))["rollout"])  # the example's state + the engine
    assert found.need == pytest.approx(alone + teacher.resident + rm.resident)
    with pytest.raises(ConfigError) as err:
        check_memory(cfg, plan, moe_config, "cuda", capacity=H100)
    msg = str(err.value)
    assert "distillation.teacher_models.big.fsdp_config.param_offload=true" in msg, msg
    assert "reward_model.fsdp_config.param_offload=true" in msg, msg
    # Offloaded (or on ranks of their own) they hold nothing here, and the example fits again.
    for more in (
        (
            "distillation.teacher_models.big.fsdp_config.param_offload=true",
            "reward_model.fsdp_config.param_offload=true",
        ),
        ("distillation.placement=separate", "reward_model.placement=separate", "trainer.v1.trainer_mode=sync"),
    ):
        cfg, plan = _example(*roles, *more)
        assert setup_of(cfg, plan, H100).frozen == ()
        check_memory(cfg, plan, moe_config, "cuda", capacity=H100)


def test_a_teacher_whose_config_cannot_be_read_is_left_to_its_loader(tmp_path, caplog) -> None:
    (tmp_path / "empty").mkdir()
    cfg, plan = _example("distillation.enabled=true", f"distillation.teacher_models.t.model_path={tmp_path / 'empty'}")
    with caplog.at_level("WARNING"):
        assert setup_of(cfg, plan, H100).frozen == ()
    assert f"memory check: distillation.teacher_models.t.model_path={tmp_path / 'empty'} not counted" in caplog.text


def test_the_accounting_sizes_engines_by_their_declared_capability_not_their_name() -> None:
    from types import SimpleNamespace

    from conveyor.rollout.base import ROLLOUT_ENGINES, EngineCapabilities, EngineSpec, register_rollout_engine
    from conveyor.workers.training.memory_budget import _claims_gpu_fraction

    def caps(device: str) -> EngineCapabilities:
        return EngineCapabilities(False, True, False, False, True, claims_gpu_fraction=True)

    assert _claims_gpu_fraction(SimpleNamespace(engine="vllm", device="cuda"))
    assert not _claims_gpu_fraction(SimpleNamespace(engine="hf", device="cuda"))
    register_rollout_engine(EngineSpec("test_claiming_engine", "conveyor.rollout.vllm", caps))
    try:
        assert _claims_gpu_fraction(SimpleNamespace(engine="test_claiming_engine", device="cuda"))
    finally:
        ROLLOUT_ENGINES.pop("test_claiming_engine")
