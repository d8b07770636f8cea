"""The run plan's router decisions: what router_replay.mode=auto picks and why, and where loss-free balancing runs."""

from __future__ import annotations

import pytest

from conveyor.cli import main
from conveyor.config import ConfigError, load_config
from conveyor.trainer.plan import build_run_plan

VLLM = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.model.tiny.num_heads=2",
    "actor_rollout_ref.model.tiny.num_kv_heads=2",
]
AUTO = "actor_rollout_ref.actor.router_replay.mode=auto"
ASYNC = ["trainer.v1.trainer_mode=separate_async"]


def _auto_line(plan) -> str:
    lines = [d for d in plan.decisions if d.startswith("router_replay.mode=auto")]
    assert len(lines) == 1, plan.decisions
    return lines[0]


@pytest.mark.parametrize(
    ("overrides", "mode", "why"),
    [
        ([], "disabled", "on-policy"),  # the default run: one mini-batch, one epoch
        (["actor_rollout_ref.actor.ppo_mini_batch_size=16"], "R2", "2 optimizer step(s)"),
        (["actor_rollout_ref.actor.ppo_epochs=3"], "R2", "ppo_epochs=3"),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=8"], "R3", "4 optimizer step(s)"),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_epochs=2"], "R3", "4 opt"),
        (ASYNC + ["trainer.v1.sampler.max_off_policy_threshold=1"], "R3", "staleness 1"),
        (ASYNC + ["trainer.v1.sampler.max_off_policy_threshold=0"], "disabled", "staleness 0"),
        (["actor_rollout_ref.model.tiny.arch=qwen3", "actor_rollout_ref.actor.ppo_epochs=4"], "disabled", "dense"),
    ],
)
def test_auto_replay_follows_how_off_policy_the_updates_are(overrides, mode, why) -> None:
    cfg = load_config(
        None, ["data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=32", AUTO, *overrides]
    )
    plan = build_run_plan(cfg, "cpu")
    assert plan.replay_mode == mode and plan.replay_requested == "auto"
    line = _auto_line(plan)
    assert f"auto: {mode}" in line and why in line
    assert plan.update_replays_routing == (mode in ("R2", "R3"))


def test_auto_replay_on_an_engine_without_routing_and_with_bypass() -> None:
    many = ["actor_rollout_ref.actor.ppo_epochs=4", AUTO]
    # vLLM on a CPU returns no routing: auto's R3 runs as R2, as a requested R3 does.
    plan = build_run_plan(load_config(None, VLLM + many), "cpu")
    assert plan.replay_mode == "R2" and "R3" in _auto_line(plan) and plan.replay_reason
    # ... which bypass mode rules out: auto then runs none, and says why, where an explicit R3 is refused.
    bypass = VLLM + many + ["algorithm.rollout_correction.bypass_mode=true"]
    plan = build_run_plan(load_config(None, bypass), "cpu")
    assert plan.replay_mode == "disabled" and "bypass_mode=true" in _auto_line(plan)
    # R2 under bypass mode on the hf engine, which returns routing: R3 instead.
    two = ["actor_rollout_ref.actor.ppo_epochs=2", AUTO, "algorithm.rollout_correction.bypass_mode=true"]
    plan = build_run_plan(load_config(None, two), "cpu")
    assert plan.replay_mode == "R3" and "R3 instead" in _auto_line(plan)


def test_loss_free_balancing_is_planned_with_hf_and_refused_with_vllm(capsys) -> None:
    bias = ["actor_rollout_ref.actor.router.bias_update_rate=0.001"]
    plan = build_run_plan(load_config(None, bias), "cpu")
    assert any(d.startswith("loss-free balancing:") for d in plan.decisions)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.router\.bias_update_rate=0\.001: the vllm"):
        build_run_plan(load_config(None, VLLM + bias), "cuda")
    # At the command line: one line, exit status 2.
    assert main(["config", *VLLM, *bias]) == 2
    err = capsys.readouterr().err.strip()
    assert "bias_update_rate" in err and "rollout.name=hf" in err and "Traceback" not in err


@pytest.mark.parametrize("key", ["router.freeze=true", "router.aux_loss_coef=0.01", "router.bias_update_rate=0.01"])
def test_router_controls_on_a_dense_model_are_refused(key) -> None:
    cfg = load_config(None, ["actor_rollout_ref.model.tiny.arch=qwen3", f"actor_rollout_ref.actor.{key}"])
    with pytest.raises(ConfigError, match=f"actor_rollout_ref.actor.{key.split('=')[0]}: the model is dense"):
        build_run_plan(cfg, "cpu")


def test_router_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match="aux_loss_coef: must be >= 0"):
        load_config(None, ["actor_rollout_ref.actor.router.aux_loss_coef=-1"])
    with pytest.raises(ConfigError, match="bias_update_rate: must be >= 0"):
        load_config(None, ["actor_rollout_ref.actor.router.bias_update_rate=-0.1"])
    with pytest.raises(ConfigError, match="bias_dead_band: must be >= 0"):
        load_config(None, ["actor_rollout_ref.actor.router.bias_dead_band=-0.5"])


@pytest.mark.parametrize("key", ["bias_update=proportional", "bias_dead_band=0.5"])
def test_a_bias_update_key_without_loss_free_balancing_is_refused(key: str) -> None:
    router = "actor_rollout_ref.actor.router"
    with pytest.raises(ConfigError, match=rf"^{router}\.{key.split('=')[0]}: .*set bias_update_rate > 0"):
        load_config(None, [f"{router}.{key}"])
    cfg = load_config(None, [f"{router}.{key}", f"{router}.bias_update_rate=0.05"])
    assert cfg.actor_rollout_ref.actor.router.bias_update_rate == 0.05


def test_a_qwen3_moe_checkpoint_saved_by_transformers_is_moe(tmp_path) -> None:
    """transformers 5 writes Qwen3-MoE's expert count as num_local_experts: the plan still sees routed experts."""
    from conveyor.models.tiny import tiny_config
    from conveyor.trainer.plan import model_is_moe

    tiny_config("qwen3_moe", vocab_size=32).save_pretrained(tmp_path)
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tmp_path}"])
    assert model_is_moe(cfg)
    tiny_config("qwen3", vocab_size=32).save_pretrained(tmp_path)
    assert not model_is_moe(cfg)
