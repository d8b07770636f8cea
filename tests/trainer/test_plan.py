"""The run plan: every combination of engine, device, replay, bypass, staleness, correction and roles, decided once.

`expected` below states the decisions from the documented rules (docs and the
config's help), written separately from `conveyor.trainer.plan`; the truth
table compares every field of the plan with it. A combination the config
refuses is checked to be refused; R3 with bypass mode on an engine that
cannot return routing is refused by the plan, naming the keys to change, and
by the command line before any model is built.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.config import ConfigError, load_config
from conveyor.trainer.plan import build_run_plan

ENGINES = ("hf", "vllm")
DEVICES = ("cpu", "cuda")
REPLAYS = ("disabled", "R2", "R3")
BYPASS = (None, True, False)
MODES = ("sync", "async_k0", "async_k1")
CORRECTIONS = ("none", "rollout_is", "rollout_rs")
ROLES = ("plain", "kl_loss", "kl_reward", "critic")
INTERVALS = (0, 5)

# Heads vLLM's CPU attention accepts, so that the vllm engine is valid wherever the rest is.
_BASE = load_config(None, ["actor_rollout_ref.model.tiny.num_heads=2", "actor_rollout_ref.model.tiny.num_kv_heads=2"])


def make_config(engine, replay, bypass, mode, correction, role, interval, mini_batch=None):
    """The base config with one combination set, checked again as a whole (ConfigError when refused)."""
    cfg = copy.deepcopy(_BASE)
    arr, algo, v1 = cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer.v1
    arr.rollout.name = engine
    arr.rollout.moe_load_balance_metrics_interval = interval
    arr.actor.router_replay.mode = replay
    algo.rollout_correction.bypass_mode = bypass
    if mode != "sync":
        v1.trainer_mode = "separate_async"
        v1.sampler.max_off_policy_threshold = 0 if mode == "async_k0" else 1
    if correction == "rollout_is":
        algo.rollout_correction.rollout_is = "token"
    elif correction == "rollout_rs":
        algo.rollout_correction.rollout_rs = "token_k1"
        algo.rollout_correction.rollout_rs_threshold = "0.5_2.0"
    arr.actor.use_kl_loss = role == "kl_loss"
    algo.use_kl_in_reward = role == "kl_reward"
    if role == "critic":
        algo.adv_estimator = "gae"
    if mini_batch is not None:
        arr.actor.ppo_mini_batch_size = mini_batch
    cfg.__post_init__()  # the cross-section checks, as loading runs them
    return cfg


def config_refuses(engine, replay, bypass, mode) -> bool:
    """What the config itself refuses among these combinations (docs/async.md, docs/rollout.md)."""
    if mode == "async_k1" and bypass is True:
        return True  # an older policy's log-probs cannot be the proximal policy's
    return replay == "R2" and bypass is True  # R2 records in the forward that bypass skips


def expected(engine, device, replay, bypass, mode, correction, role, interval, *, one_step=True) -> dict:
    """Every field of the plan, from the rules as documented."""
    engine_routing = engine == "hf" or device == "cuda"  # vLLM returns routing from CUDA only
    runs = "R2" if replay == "R3" and not engine_routing else replay
    off_policy = mode == "async_k1"
    # The update's forward is the proximal policy when it is the batch's only optimizer step and nothing
    # before the update needs old log-probs (KL in the reward, rejection) or the forward's routing (R2).
    proximal = off_policy and one_step and role != "kl_reward" and correction != "rollout_rs" and runs != "R2"
    if bypass is True:
        old = "rollout"
    elif bypass is None and not off_policy and runs != "R2" and correction == "none" and engine == "hf":
        old = "rollout"  # the hf rollout samples from the trainer's own modules: nothing needs a forward
    else:
        old = "update" if proximal else "forward"
    metrics = interval > 0
    if runs == "R3":
        capture, record_for_metrics = True, False
    elif runs == "R2":
        capture, record_for_metrics = False, False
    else:
        capture, record_for_metrics = metrics and engine_routing, metrics and not engine_routing
    record = runs == "R2" or record_for_metrics  # the tiny model is MoE
    return {
        "device": device,
        "engine": engine,
        "engine_returns_routing": engine_routing,
        "is_moe": True,
        "old_log_probs": old,
        "replay_mode": runs,
        "replay_requested": replay,
        "routing_source": "rollout" if capture else "forward" if record else "none",
        "rollout_captures_routing": capture,
        "forward_records_routing": record,
        "forward_replays_routing": runs == "R3",
        "update_replays_routing": runs != "disabled",
        "load_balance_from_forward": metrics and (runs == "R2" or not engine_routing),
        "rollout_is_level": "token" if correction == "rollout_is" or off_policy else None,
        "rollout_rs": correction == "rollout_rs",
        "off_policy": off_policy,
        # The asynchronous source generates on the rollout worker group while the actor trains.
        "rollout_placement": "colocated" if mode == "sync" else "separate",
        # auto: the rollout on a thread of the trainer's process (own is asked for; tests below).
        "rollout_process": "trainer",
        "use_critic": role == "critic",
        "use_reference": role in ("kl_loss", "kl_reward"),
        "reference_from_actor": False,  # no LoRA in the table (tests/trainer/test_lora.py)
        "actor_loss_scale": 6.0,
        "critic_loss_scale": 6.0,  # data.max_response_length
        "engine_max_model_len": 64 + 6 if engine == "vllm" else None,
        "use_teacher": False,  # distillation is off in the table (tests/trainer/test_distillation.py)
        "teacher_placement": "colocated",
        "use_reward_model": False,  # reward_model.enable is off in the table (tests/trainer/test_reward_model_runs.py)
        "reward_model_placement": "colocated",
        "use_judge": False,
        # The roles that run, in the role table's order: the actor, the reference or critic the row asks for, the
        # rollout replicas when they run apart, and the reward worker beside them.
        "roles": {
            "actor": "colocated",
            **({"ref": "colocated"} if role in ("kl_loss", "kl_reward") else {}),
            **({"critic": "colocated"} if role == "critic" else {}),
            **({"rollout": "replicas"} if mode != "sync" else {}),
            "reward": "replicas",
        },
        "forward_sum_pi_squared": False,  # no estimator in the table reads it (tests/trainer/test_estimator_inputs.py)
        "warnings": (),  # the table's runs sample several responses a prompt
    }


@pytest.mark.parametrize("engine, device, replay, bypass", list(itertools.product(ENGINES, DEVICES, REPLAYS, BYPASS)))
def test_truth_table(engine, device, replay, bypass) -> None:
    checked = 0
    for mode, correction, role, interval in itertools.product(MODES, CORRECTIONS, ROLES, INTERVALS):
        case = (engine, device, replay, bypass, mode, correction, role, interval)
        if config_refuses(engine, replay, bypass, mode):
            with pytest.raises(ConfigError):
                make_config(engine, replay, bypass, mode, correction, role, interval)
            continue
        cfg = make_config(engine, replay, bypass, mode, correction, role, interval)
        engine_routing = engine == "hf" or device == "cuda"
        if replay == "R3" and not engine_routing and bypass is True:
            with pytest.raises(ConfigError) as info:
                build_run_plan(cfg, device)
            msg = str(info.value)
            assert "actor_rollout_ref.actor.router_replay.mode=R3" in msg, case
            assert "algorithm.rollout_correction.bypass_mode" in msg and "null or false" in msg, case
            continue
        plan = build_run_plan(cfg, device)
        got = {k: v for k, v in plan.to_dict().items() if k not in ("decisions", "replay_reason", "warnings")}
        assert {**got, "warnings": plan.warnings} == expected(*case), case
        assert bool(plan.replay_reason) == (plan.replay_mode != replay), case
        assert plan.decisions and all(isinstance(d, str) and d for d in plan.decisions), case
        checked += 1
    assert (
        checked
        or config_refuses(engine, replay, bypass, "sync")
        or (replay == "R3" and bypass is True and engine == "vllm" and device == "cpu")
    )


@pytest.mark.parametrize("mini_batch, epochs", [(16, 1), (32, 2)])
def test_more_than_one_optimizer_step_per_batch_needs_the_old_log_prob_forward(mini_batch, epochs) -> None:
    cfg = make_config("hf", "disabled", None, "async_k1", "none", "plain", 0, mini_batch=mini_batch)
    cfg.actor_rollout_ref.actor.ppo_epochs = epochs
    plan = build_run_plan(cfg, "cpu")
    assert plan.old_log_probs == "forward"
    want = expected("hf", "cpu", "disabled", None, "async_k1", "none", "plain", 0, one_step=False)
    got = {k: v for k, v in plan.to_dict().items() if k not in ("decisions", "replay_reason", "warnings")}
    assert {**got, "warnings": plan.warnings} == want


def test_loss_scales_fall_back_actor_then_response_length() -> None:
    cfg = copy.deepcopy(_BASE)
    assert (build_run_plan(cfg, "cpu").actor_loss_scale, build_run_plan(cfg, "cpu").critic_loss_scale) == (6.0, 6.0)
    cfg.actor_rollout_ref.actor.loss_scale_factor = 4.0
    assert (build_run_plan(cfg, "cpu").actor_loss_scale, build_run_plan(cfg, "cpu").critic_loss_scale) == (4.0, 4.0)
    cfg.critic.loss_scale_factor = 2.0
    assert (build_run_plan(cfg, "cpu").actor_loss_scale, build_run_plan(cfg, "cpu").critic_loss_scale) == (4.0, 2.0)
    cfg.actor_rollout_ref.rollout.max_model_len = 100
    cfg.actor_rollout_ref.rollout.name = "vllm"
    assert build_run_plan(cfg, "cpu").engine_max_model_len == 100


def test_critic_enable_overrides_the_estimator() -> None:
    cfg = copy.deepcopy(_BASE)
    cfg.critic.enable = True
    assert build_run_plan(cfg, "cpu").use_critic
    cfg.algorithm.adv_estimator, cfg.critic.enable = "gae", False
    assert not build_run_plan(cfg, "cpu").use_critic


def test_a_dense_model_records_and_replays_nothing() -> None:
    cfg = load_config(
        None, ["actor_rollout_ref.model.tiny.arch=qwen3", "actor_rollout_ref.actor.router_replay.mode=R2"]
    )
    plan = build_run_plan(cfg, "cpu")
    assert not plan.is_moe and plan.replay_mode == "R2" and plan.old_log_probs == "forward"
    assert not (plan.forward_records_routing or plan.forward_replays_routing or plan.update_replays_routing)
    # R3 on a dense model: the plan says there is nothing to replay, and no rollout "captures" routing.
    r3 = build_run_plan(
        load_config(None, ["actor_rollout_ref.model.tiny.arch=qwen3", "actor_rollout_ref.actor.router_replay.mode=R3"]),
        "cpu",
    )
    assert not r3.rollout_captures_routing and r3.routing_source == "none"
    assert "router replay R3 (nothing to replay: the model is dense)" in r3.decisions
    assert not [d for d in r3.decisions if d.startswith("routing:")]


def test_moe_is_read_from_a_checkpoints_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 4}))
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tmp_path}"])
    assert build_run_plan(cfg, "cpu").is_moe
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert not build_run_plan(cfg, "cpu").is_moe


def test_the_plan_is_plain_and_does_not_change_the_config() -> None:
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.model.tiny.num_heads=2",
            "actor_rollout_ref.model.tiny.num_kv_heads=2",
            "actor_rollout_ref.actor.router_replay.mode=R3",
        ],
    )
    before = copy.deepcopy(cfg)
    plan = build_run_plan(cfg, "cpu")
    assert cfg == before and plan.replay_mode == "R2"
    assert json.loads(json.dumps(plan.to_dict())) == plan.to_dict()
    with pytest.raises(AttributeError):
        plan.replay_mode = "R3"  # frozen
    assert "R2" in plan.describe()


def test_the_command_line_refuses_r3_with_bypass_on_the_vllm_cpu_engine_before_building_anything(tmp_path) -> None:
    """The run that used to fail at its first update with FieldNotFoundError: refused at start, exit status 2."""
    root = Path(__file__).resolve().parents[2]
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    env = {
        **os.environ,
        "CONVEYOR_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "conveyor.cli",
            "train",
            "--config",
            str(root / "examples" / "vllm_cpu.yaml"),
            "actor_rollout_ref.actor.router_replay.mode=R3",
            "algorithm.rollout_correction.bypass_mode=true",
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "actor_rollout_ref.actor.router_replay.mode=R3" in done.stderr
    assert "algorithm.rollout_correction.bypass_mode" in done.stderr and "Traceback" not in done.stderr
    # Nothing was built or written: no tiny model in the cache, no run directory, no vLLM engine.
    assert not cache.exists() or not any(cache.iterdir())
    assert not run_dir.exists()
    assert "vLLM engine started" not in done.stderr


@pytest.mark.parametrize("kl", ["actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true", None])
def test_lora_makes_the_reference_the_actors_base(kl) -> None:
    """With LoRA on, a KL term's reference is the actor with its adapters disabled; without one there is none."""
    cfg = load_config(None, ["actor_rollout_ref.model.lora_rank=8"] + ([kl] if kl else []))
    plan = build_run_plan(cfg, "cpu")
    assert plan.use_reference == plan.reference_from_actor == (kl is not None)
    assert any(d.startswith("LoRA: rank 8") for d in plan.decisions)
    assert any("adapters disabled" in d for d in plan.decisions) == (kl is not None)


def test_partial_rollouts_need_an_interruptible_engine() -> None:
    # The plan reads the capability: weights between two tokens need an engine that can stop between them.
    import dataclasses

    from conveyor.rollout.base import ROLLOUT_ENGINES, EngineSpec, register_rollout_engine

    partial = ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.partial_rollout=true"]
    heads = ["actor_rollout_ref.model.tiny.num_heads=2", "actor_rollout_ref.model.tiny.num_kv_heads=2"]
    hf = ROLLOUT_ENGINES["hf"]
    register_rollout_engine(
        EngineSpec(
            "test_uninterruptible", hf.module, lambda d: dataclasses.replace(hf.capabilities(d), interruptible=False)
        )
    )
    try:
        cfg = load_config(None, ["actor_rollout_ref.rollout.name=test_uninterruptible", *partial])
        with pytest.raises(ConfigError, match="interrupted between tokens.*partial_rollout=false or use hf, vllm"):
            build_run_plan(cfg, "cpu")
    finally:
        ROLLOUT_ENGINES.pop("test_uninterruptible")
    # Both built-in engines take weights between two tokens (vllm one engine step at a time), and the plan says
    # what the requests in flight do with their KV cache.
    hf_plan = build_run_plan(load_config(None, partial), "cpu")
    assert any("between two sampled tokens" in d and "in_flight_kv=recompute" in d for d in hf_plan.decisions)
    kept = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.in_flight_kv=keep", *heads, *partial]
    vllm_plan = build_run_plan(load_config(None, kept), "cpu")
    assert any("between two engine steps" in d and "keep the KV cache" in d for d in vllm_plan.decisions)


@pytest.mark.parametrize(
    "overrides, process, why",
    [
        ([], "trainer", "rollout_process=auto"),
        (["trainer.v1.sampler.max_off_policy_threshold=0"], "trainer", "rollout_process=auto"),
        (["trainer.v1.separate_async.partial_rollout=true"], "trainer", "rollout_process=auto"),
        (["trainer.v1.separate_async.rollout_process=trainer"], "trainer", "rollout_process=trainer"),
        (["trainer.v1.separate_async.rollout_process=own"], "own", "rollout_process=own"),
        (
            ["trainer.v1.separate_async.rollout_process=own", "trainer.v1.sampler.max_off_policy_threshold=0"],
            "own",
            "rollout_process=own",
        ),
        (
            ["trainer.v1.separate_async.rollout_process=own", "trainer.v1.separate_async.partial_rollout=true"],
            "own",
            "rollout_process=own",
        ),
    ],
)
def test_where_the_asynchronous_rollout_runs(overrides, process, why) -> None:
    plan = build_run_plan(load_config(None, ["trainer.v1.trainer_mode=separate_async", *overrides]), "cpu")
    assert plan.rollout_process == process
    assert any(d.startswith("rollout process:") and why in d for d in plan.decisions), plan.decisions


@pytest.mark.parametrize(
    "overrides, says",
    [
        ([], "the rollout runs in the trainer's process, where a replica is not replaced: a fault stops the run"),
        (["trainer.v1.separate_async.rollout_process=own"], "is replaced (at most 3 times"),
        (
            [
                "trainer.v1.separate_async.rollout_process=own",
                "actor_rollout_ref.rollout.fault_tolerance.max_restarts=5",
                "actor_rollout_ref.rollout.fault_tolerance.timeout_s=30",
            ],
            "answers no call within 30 s is replaced (at most 5 times",
        ),
        (
            ["trainer.v1.separate_async.rollout_process=own", "actor_rollout_ref.rollout.fault_tolerance.enable=false"],
            "fault_tolerance.enable=false: a rollout replica that dies or hangs stops the run",
        ),
        (
            ["trainer.v1.separate_async.rollout_process=own", "trainer.v1.separate_async.partial_rollout=true"],
            "(partial rollouts: not replaced;",
        ),
    ],
)
def test_the_plan_says_which_faults_the_run_survives(overrides, says) -> None:
    plan = build_run_plan(load_config(None, ["trainer.v1.trainer_mode=separate_async", *overrides]), "cpu")
    faults = [d for d in plan.decisions if d.startswith("faults:")]
    assert len(faults) == 1 and says in faults[0], plan.decisions
    assert "resume from the last complete checkpoint" in faults[0]


def test_fault_tolerance_keys_are_bounded_and_misspellings_suggest_the_key() -> None:
    key = "actor_rollout_ref.rollout.fault_tolerance"
    with pytest.raises(ConfigError, match=f"{key}.timeout_s"):
        load_config(None, [f"{key}.timeout_s=0"])
    with pytest.raises(ConfigError, match=f"{key}.max_restarts"):
        load_config(None, [f"{key}.max_restarts=-1"])
    with pytest.raises(ConfigError, match="max_restarts"):
        load_config(None, [f"{key}.max_restart=2"])


def test_the_rollout_in_its_own_process_is_refused_where_it_cannot_work(monkeypatch) -> None:
    own = ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.rollout_process=own"]
    with pytest.raises(ConfigError, match="on cuda.*n_gpus_per_node"):
        build_run_plan(load_config(None, own), "cuda")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'conveyor\[ray\]'"):
        build_run_plan(load_config(None, own), "cpu")
    # Synchronous runs keep the rollout in the trainer's process whatever the key says.
    assert build_run_plan(load_config(None, own[1:]), "cpu").rollout_process == "trainer"


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        (["actor_rollout_ref.rollout.n=1"], "no baseline (each advantage is its raw score)"),
        (["actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=rloo"], "zero for rloo"),
        (["actor_rollout_ref.rollout.n=2"], None),
        (["actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"], None),
        (["actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae"], None),
        (
            [
                "actor_rollout_ref.rollout.n=1",
                "distillation.enabled=true",
                "distillation.distillation_loss.use_task_rewards=false",
                "distillation.teacher_models.t.model_path=/nonexistent/teacher",
            ],
            None,
        ),
    ],
)
def test_one_sample_a_prompt_under_a_group_baseline_is_said_in_the_plan(overrides, warned) -> None:
    plan = build_run_plan(load_config(None, overrides), device="cpu")
    lines = [d for d in plan.decisions if d.startswith("advantages:")]
    if warned is None:
        assert lines == [] and plan.warnings == ()
    else:
        assert len(lines) == 1 and warned in lines[0] and "set rollout.n to 2 or more" in lines[0]
        assert plan.warnings == (lines[0],)  # run.py logs the plan's warnings once, at the run's start


@pytest.mark.parametrize("interval", [0, 1])
def test_a_replay_plan_says_the_old_log_probs_and_routing_are_the_recorded_ones(interval) -> None:
    cfg = load_config(
        None,
        [
            "trainer.replay_rollouts_from=/runs/orig/rollouts",
            f"actor_rollout_ref.rollout.moe_load_balance_metrics_interval={interval}",
        ],
    )
    plan = build_run_plan(cfg, device="cpu")
    text = "\n".join(plan.decisions)
    assert plan.rollout_placement == "none" and "rollout: none, samples replayed from /runs/orig/rollouts" in text
    # No engine samples in a replay: the lines name the recorded samples, not a rollout at work.
    assert "the hf rollout samples from" not in text and "routing: captured by" not in text
    olds = [d for d in plan.decisions if d.startswith("old log-probs:")]
    assert plan.old_log_probs == "rollout"
    assert olds == [
        "old log-probs: the replayed samples' recorded rollout_log_probs, no forward (the hf rollout that recorded "
        "them sampled from the trainer's own modules)"
    ]
    routing = [d for d in plan.decisions if d.startswith("routing:")]
    if interval:
        assert routing == [
            "routing: the replayed samples' recorded routed_experts, as the hf rollout that recorded them captured it"
        ]
    else:
        assert routing == []
    assert not any(d.startswith("faults:") for d in plan.decisions)  # no rollout process to lose


def test_a_replay_plan_names_no_engine_length_or_weight_sync() -> None:
    overrides = [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.model.tiny.num_heads=2",
        "actor_rollout_ref.model.tiny.num_kv_heads=2",
        "actor_rollout_ref.model.lora_rank=4",
    ]
    live = build_run_plan(load_config(None, overrides), device="cpu")
    replay = build_run_plan(load_config(None, overrides + ["trainer.replay_rollouts_from=/r"]), device="cpu")
    assert any(d.startswith("vllm max_model_len=") for d in live.decisions)
    assert not any("max_model_len" in d or "merged weights" in d for d in replay.decisions)
    assert (
        "old log-probs: the old-log-prob forward (the numerics of the vllm rollout that recorded them are not the "
        "trainer's)" in replay.decisions
    )


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        ([], "training ranks: 1; actor: strategy none"),
        (
            [
                "trainer.num_cpu_workers=2",
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.actor.use_kl_loss=true",
                "algorithm.adv_estimator=gae",
            ],
            "training ranks: 2; actor: strategy fsdp2, Ulysses sequence parallel 2 "
            "(actor_rollout_ref.actor.ulysses_sequence_parallel_size); reference: strategy fsdp2, Ulysses sequence "
            "parallel 2 (actor_rollout_ref.ref.ulysses_sequence_parallel_size); critic: strategy fsdp2",
        ),
        (
            [
                "trainer.num_cpu_workers=2",
                "actor_rollout_ref.actor.strategy=dp",
                "actor_rollout_ref.actor.use_kl_loss=true",
                "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
            ],
            "training ranks: 2; actor: strategy dp; reference: strategy fsdp2, Ulysses sequence parallel 2 "
            "(actor_rollout_ref.ref.ulysses_sequence_parallel_size)",
        ),
    ],
)
def test_the_plan_names_each_roles_strategy_and_sequence_parallel_size(overrides, line) -> None:
    plan = build_run_plan(load_config(None, overrides), device="cpu")
    assert [d for d in plan.decisions if d.startswith("training ranks:")] == [line]
    assert line in json.loads(json.dumps(plan.to_dict()))["decisions"]  # and so in plan.json


def test_the_plan_says_whether_the_sampling_mask_is_replayed() -> None:
    from conveyor.config import load_config
    from conveyor.trainer.plan import build_run_plan

    def lines(*overrides: str) -> list[str]:
        plan = build_run_plan(load_config(None, list(overrides)), "cpu")
        return [d for d in plan.decisions if d.startswith("sampling mask")]

    assert lines() == []
    assert lines("actor_rollout_ref.rollout.top_p=0.8", "actor_rollout_ref.rollout.do_sample=false") == []
    (on,) = lines("actor_rollout_ref.rollout.top_p=0.8", "actor_rollout_ref.rollout.min_p=0.1")
    assert "top_p=0.8 min_p=0.1" in on and "replayed in the policy's log-probs" in on
    (off,) = lines("actor_rollout_ref.rollout.top_k=5", "actor_rollout_ref.rollout.sampling_mask.replay=false")
    assert "top_k=5" in off and "not replayed" in off
