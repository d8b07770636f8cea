"""Asynchronous training (trainer.v1.trainer_mode=separate_async): the staleness bound, k = 0 = sync, faults, config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conveyor.config import ConfigError, load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.trainer.export import export_hf
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.run import run_training
from conveyor.workers.placement.group import WorkerError

# Wall-clock and memory readings differ from run to run by nature; the async loop's own counters are extra.
_MEASURED = ("timing_s/", "timing_cpu_s/", "perf/", "gen_time_s", "off_policy/", "weight_sync_s")

ASYNC = "trainer.v1.trainer_mode=separate_async"


def _run(tmp_path, tiny_run: list[str], name: str, extra: list[str]) -> tuple[list[dict], object]:
    run_dir = tmp_path / name
    base = [o for o in tiny_run if not o.startswith("trainer.default_local_dir=")]
    run_training(load_config(None, base + [f"trainer.default_local_dir={run_dir}", *extra]))
    return read_metrics_jsonl(run_dir / "metrics.jsonl"), run_dir


def _weights(run_dir, out) -> dict[str, torch.Tensor]:
    path = export_hf(run_dir, out)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_k0_is_the_synchronous_trainer_bit_for_bit(tmp_path, tiny_run):
    common = [
        "trainer.total_training_steps=3",
        "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
        "actor_rollout_ref.model.tiny.warmstart_steps=20",
    ]
    sync, sync_dir = _run(tmp_path, tiny_run, "sync", common)
    async_, async_dir = _run(
        tmp_path, tiny_run, "async", common + [ASYNC, "trainer.v1.sampler.max_off_policy_threshold=0"]
    )
    strip = lambda rows: [{k: v for k, v in r.items() if not any(m in k for m in _MEASURED)} for r in rows]  # noqa: E731
    assert [r["step"] for r in sync] == [0, 1, 2, 3]
    assert strip(sync) == strip(async_)  # exact: same samples, same losses, same gradients
    assert all(async_[i]["off_policy/staleness_max"] == 0.0 for i in (1, 2, 3))
    a, b = _weights(sync_dir, tmp_path / "hf-sync"), _weights(async_dir, tmp_path / "hf-async")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy", ["drop", "wait"])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_no_trained_sample_is_more_than_k_versions_old(tmp_path, tiny_run, k, strategy):
    steps = 8
    # Weights only every k + 1 updates: the slowest shipping the bound allows, so drop has something to drop.
    metrics, run_dir = _run(
        tmp_path,
        tiny_run,
        "run",
        [
            ASYNC,
            f"trainer.total_training_steps={steps}",
            f"trainer.v1.sampler.max_off_policy_threshold={k}",
            f"trainer.v1.sampler.max_off_policy_strategy={strategy}",
            f"trainer.v1.separate_async.parameter_sync_step={k + 1}",
        ],
    )
    log = [json.loads(line) for line in (run_dir / "async_versions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, steps + 1))
    staleness = []
    for r in log:
        assert r["trained_at"] == r["step"] - 1  # one update per step: version = updates so far
        assert len(r["sample_versions"]) == 4 * 2  # every sample of the batch is logged
        for v in r["sample_versions"]:
            assert r["trained_at"] - k <= v <= r["trained_at"]
            staleness.append(r["trained_at"] - v)
    dropped = log[-1]["dropped_batches"]
    if strategy == "wait" or k == 0:
        assert dropped == 0
    else:
        assert dropped > 0  # weights every k + 1 updates make some batches k + 1 versions old
    if k > 0:
        assert max(staleness) > 0  # it did run ahead
    rows = {r["step"]: r for r in metrics}
    assert rows[steps]["off_policy/staleness_max"] <= k
    assert 0.0 <= rows[steps]["off_policy/dropped_frac"] < 1.0
    for key in ("off_policy/trainer_idle_frac", "off_policy/rollout_idle_frac"):
        assert 0.0 <= rows[steps][key] <= 1.0


@pytest.fixture(scope="module")
def off_policy_r3_run(tiny_run_base, tmp_path_factory) -> list[dict]:
    """The metrics of one 3-step run at k = 1 with R3 and the load-balance metrics, which two tests check."""
    metrics, _ = _run(
        tmp_path_factory.mktemp("off-policy-r3"),
        tiny_run_base,
        "run",
        [
            ASYNC,
            "trainer.total_training_steps=3",
            "trainer.v1.sampler.max_off_policy_threshold=1",
            "actor_rollout_ref.actor.router_replay.mode=R3",
            "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
        ],
    )
    return metrics


def test_off_policy_training_logs_the_importance_weights(off_policy_r3_run):
    last = off_policy_r3_run[-1]
    # The decoupled objective's behaviour weights (token level) and the staleness they correct.
    assert any(k.startswith("rollout_corr/") for k in last)
    assert last["off_policy/staleness_mean"] == 1.0


def test_one_optimizer_step_per_batch_takes_the_proximal_policy_from_the_update(tmp_path, tiny_run):
    # ppo_mini_batch_size = train_batch_size, one epoch: the update's forward, before its only step, is pi_prox.
    metrics, _ = _run(
        tmp_path,
        tiny_run,
        "run",
        [ASYNC, "trainer.total_training_steps=3", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
    )
    for row in metrics[1:]:
        assert row["actor/ppo_kl"] == 0.0 and row["actor/pg_clipfrac"] == 0.0  # ratio to itself: exactly 1
        assert any(k.startswith("rollout_corr/") for k in row)
        assert "actor/entropy" in row

    def old(overrides):
        return build_run_plan(load_config(None, overrides), "cpu").old_log_probs

    assert old([ASYNC, "actor_rollout_ref.actor.ppo_mini_batch_size=32"]) == "update"
    assert old([ASYNC, "actor_rollout_ref.actor.ppo_mini_batch_size=16"]) == "forward"
    assert old(["actor_rollout_ref.actor.ppo_mini_batch_size=32"]) == "rollout"


def test_weights_leave_when_the_update_ends(tmp_path, tiny_run, monkeypatch):
    # Each update's weights are staged right after it (before the step's metrics), so the next step's start finds
    # them sent; the last update's are not staged, as no later step would train what they generate.
    from conveyor.trainer.async_source import AsyncSource

    staged: list[tuple[str, int, int]] = []
    where = {"updated": False}
    original_updated, original_stage = AsyncSource.updated, AsyncSource._stage_if_due

    def updated(self):
        where["updated"] = True
        try:
            return original_updated(self)
        finally:
            where["updated"] = False

    def stage(self, version):
        before = self._sent_version
        original_stage(self, version)
        if self._sent_version != before:
            staged.append(("updated" if where["updated"] else "step start", self.stages.global_step, version))

    monkeypatch.setattr(AsyncSource, "updated", updated)
    monkeypatch.setattr(AsyncSource, "_stage_if_due", stage)
    metrics, _ = _run(tmp_path, tiny_run, "run", [ASYNC, "trainer.total_training_steps=4"])
    # (Version 0 went out with the step-0 validation's generation.)
    assert staged == [("updated", 1, 1), ("updated", 2, 2), ("updated", 3, 3)]
    assert all("timing_s/async/stage_weights" in r for r in metrics if r["step"] in (1, 2, 3))


def test_a_crashing_rollout_is_one_error_naming_the_stage(tmp_path, tiny_run, monkeypatch):
    from conveyor.workers.ranks.replica import ReplicaWorker

    def generate_sequences(self, meta):
        raise RuntimeError("rollout exploded")

    monkeypatch.setattr(ReplicaWorker, "generate_sequences", generate_sequences)
    with pytest.raises(WorkerError, match="rollout rank 0 failed in generate_sequences.*rollout exploded"):
        _run(tmp_path, tiny_run, "run", [ASYNC])


@pytest.mark.parametrize(
    "override, key",
    [
        (["trainer.v1.sampler.max_off_policy_threshold=-1"], "max_off_policy_threshold"),
        # Up to k + 1 batches in memory: a bound of 10^9 would fill it before the first step.
        (["trainer.v1.sampler.max_off_policy_threshold=1000000000"], "at most 1024"),
        (["trainer.v1.sampler.max_off_policy_strategy=skip"], "max_off_policy_strategy"),
        (["trainer.v1.trainer_mode=fully_async"], "trainer_mode"),
        (
            ["trainer.v1.sampler.max_off_policy_threshold=1", "trainer.v1.separate_async.parameter_sync_step=3"],
            "parameter_sync_step",
        ),
        ([ASYNC, "algorithm.rollout_correction.bypass_mode=true"], "bypass_mode"),
    ],
)
def test_async_settings_are_checked(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, override)


def test_sync_is_the_default_and_off_policy_turns_the_proximal_forward_on():
    assert load_config(None, []).trainer.v1.trainer_mode == "sync"
    plan = build_run_plan(load_config(None, [ASYNC]), "cpu")
    assert plan.off_policy and plan.old_log_probs != "rollout" and plan.rollout_is_level == "token"
    k0 = build_run_plan(load_config(None, [ASYNC, "trainer.v1.sampler.max_off_policy_threshold=0"]), "cpu")
    assert not k0.off_policy and k0.old_log_probs == "rollout" and k0.rollout_is_level is None


def _prompts(run_dir, step: int) -> list[str]:
    path = run_dir / "generations" / f"step_{step:06d}.jsonl"
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]


def test_a_resumed_run_trains_the_batches_that_were_in_flight(tmp_path, tiny_run):
    """Stopped after step 2's checkpoint with batch 3 already generated: the checkpoint keeps it, and the resumed run
    trains it as generated, with the version-1 weights, as the uninterrupted run does."""
    import shutil

    base = [o for o in tiny_run if not o.startswith("trainer.default_local_dir=")]
    common = base + [
        ASYNC,
        "trainer.v1.sampler.max_off_policy_threshold=1",
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        "trainer.max_ckpt_to_keep=null",
        "trainer.dump_freq=1",
        "trainer.dump_num=8",
    ]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    run_training(load_config(None, common + [f"trainer.default_local_dir={ref_dir}"]))
    shutil.copytree(ref_dir, run_dir)
    for step in (3, 4):  # a crash right after step 2's checkpoint
        shutil.rmtree(run_dir / "checkpoints" / f"global_step_{step}")
        (run_dir / "generations" / f"step_{step:06d}.jsonl").unlink()
    versions = run_dir / "async_versions.jsonl"
    versions.write_text("".join(line + "\n" for line in versions.read_text().splitlines()[:2]))
    run_training(load_config(None, common + [f"trainer.default_local_dir={run_dir}"]))
    for step in (1, 2, 3, 4):  # the same prompts at every step: none lost, none twice
        assert _prompts(run_dir, step) == _prompts(ref_dir, step)
    log = [json.loads(line) for line in versions.read_text().splitlines()]
    ref = [json.loads(line) for line in (ref_dir / "async_versions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    # Batch 3 as generated before the stop (version 1, one version stale), not drawn and generated again.
    assert log[2]["batch"] == 3 and log[2]["trained_at"] == 2 and set(log[2]["sample_versions"]) == {1}
    assert log == ref


def test_routed_experts_come_back_with_their_tokens_for_replay_and_the_load_balance_metrics(off_policy_r3_run):
    # R3 replays, in the update, the experts the rollout worker recorded with the (older) generating weights.
    for row in off_policy_r3_run[1:]:
        assert row["rollout/moe/routed_experts_found"] == 1.0
        assert row["rollout/moe/routing_from_trainer_forward"] == 0.0
        assert 0.0 < row["actor/moe/routing_agreement"] <= 1.0
        assert row["off_policy/staleness_max"] <= 1.0


def test_partial_rollouts_continue_unfinished_samples_with_the_new_weights(tmp_path, tiny_run, monkeypatch):
    # A rollout slower than the update (10 ms per sampled token, on the rollout's thread only), so weights
    # reach it mid-generation; R3 replays the routing recorded across the switch.
    import threading
    import time

    from conveyor.rollout import hf

    sample = hf._Sampler.__call__

    def slow(self, logits):
        if threading.current_thread().name.startswith("conveyor-rollout"):
            time.sleep(0.01)
        return sample(self, logits)

    monkeypatch.setattr(hf._Sampler, "__call__", slow)
    metrics, run_dir = _run(
        tmp_path,
        tiny_run,
        "run",
        [
            ASYNC,
            "trainer.v1.separate_async.partial_rollout=true",
            "trainer.total_training_steps=4",
            "data.max_response_length=24",
            "actor_rollout_ref.actor.router_replay.mode=R3",
            "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
        ],
    )
    check_partial_rollouts(metrics, run_dir)


def check_partial_rollouts(metrics: list[dict], run_dir) -> None:
    """Samples continued with newer weights, every token's version within the bound, the switches counted, and the
    routing R3 replays still on its tokens."""
    check_token_versions(metrics, run_dir)
    rows = {r["step"]: r for r in metrics}
    for step in (1, 2, 3, 4):
        # Routing that slipped off its tokens would agree with the update's own routing at about chance.
        assert rows[step]["rollout/moe/routed_experts_found"] == 1.0
        assert rows[step]["actor/moe/routing_agreement"] > 0.9
        assert rows[step]["rollout/moe/routed_expert_assignments"] > 0 and "rollout/moe/max_vio/max" in rows[step]


def check_token_versions(metrics: list[dict], run_dir) -> None:
    """Samples continued with newer weights, none thrown away, every token's version within the bound, and the
    switches counted in the metrics of the steps that trained them."""
    log = [json.loads(line) for line in (run_dir / "async_versions.jsonl").read_text().splitlines()]
    continued = 0
    for r in log:
        for first, (oldest, newest) in zip(r["sample_versions"], r["token_version_range"]):
            # A sample's version is its oldest token's; later tokens are newer, none beyond the trained version.
            assert oldest == first and r["trained_at"] - 1 <= first and newest <= r["trained_at"]
            continued += newest > oldest
    assert continued > 0  # some samples were continued with newer weights, never thrown away
    rows = {r["step"]: r for r in metrics}
    partial = [rows[r["step"]] for r in log if any(new > old for old, new in r["token_version_range"])]
    for row in partial:
        assert row["off_policy/weight_switches"] >= 1 and 0 < row["off_policy/partial_frac"] <= 1
        assert row["off_policy/token_staleness_mean"] < row["off_policy/staleness_mean"]


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_vllm_partial_rollouts_continue_samples_with_weights_loaded_between_engine_steps(
    tmp_path, tiny_run, monkeypatch, kv
) -> None:
    # A rollout slower than the update (10 ms between engine steps), so weights reach vLLM mid-generation.
    import time

    from conveyor.rollout.vllm import VLLMEngine

    run = VLLMEngine._generate_steps
    seen: list[str] = []

    def slow(self, rows, seeds, params, routing, interrupt):
        seen.append(self.in_flight_kv)
        return run(self, rows, seeds, params, routing, lambda sampled: time.sleep(0.01) or interrupt(sampled))

    monkeypatch.setattr(VLLMEngine, "_generate_steps", slow)
    metrics, run_dir = _run(
        tmp_path,
        tiny_run,
        "run",
        [
            ASYNC,
            # vLLM's CPU attention needs heads of 32 or more.
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.model.tiny.num_heads=2",
            "actor_rollout_ref.model.tiny.num_kv_heads=2",
            "trainer.v1.separate_async.partial_rollout=true",
            f"actor_rollout_ref.rollout.in_flight_kv={kv}",
            "trainer.total_training_steps=4",
            "data.max_response_length=24",
            "actor_rollout_ref.rollout.n=4",
        ],
    )
    assert seen and set(seen) == {kv}  # every generation ran one engine step at a time, with the key's KV policy
    check_token_versions(metrics, run_dir)


def test_ray_workers_train_and_ship_their_weights_to_the_rollout(tmp_path, tiny_run):
    # Two actor ranks on Ray; the rollout process gets rank 0's full weights. k = 0 takes the rollout's
    # log-probs as the old policy, and one mini-batch per step makes the update's ratio compare them with
    # the trained weights before they change: a rollout a version behind shows a KL of ~1e-2 here.
    metrics, run_dir = _run(
        tmp_path,
        tiny_run,
        "run",
        [
            ASYNC,
            "trainer.v1.sampler.max_off_policy_threshold=0",
            "trainer.num_cpu_workers=2",
            "ray.num_cpus=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.model.tiny.warmstart_steps=20",
            "trainer.total_training_steps=4",
        ],
    )
    rows = {r["step"]: r for r in metrics}
    assert [r["trained_at"] for r in map(json.loads, (run_dir / "async_versions.jsonl").read_text().splitlines())] == [
        0,
        1,
        2,
        3,
    ]
    assert sum(rows[s]["actor/grad_norm"] > 0 for s in (1, 2, 3)) >= 2  # the weights did change
    for s in (1, 2, 3, 4):
        assert abs(rows[s]["actor/ppo_kl"]) < 1e-5, (s, rows[s]["actor/ppo_kl"])
        assert rows[s]["off_policy/staleness_max"] == 0.0
