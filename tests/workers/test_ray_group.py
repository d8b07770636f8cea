"""Tests of Ray worker groups: data-parallel equivalence, per-rank metrics, failure reporting, resources."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group  # noqa: E402
from update_batches import ragged_update_fields  # noqa: E402

from conveyor.config import load_config  # noqa: E402
from conveyor.data_plane import FieldNotFoundError, make_data_plane  # noqa: E402
from conveyor.metrics.reduce import reduce_rank_metrics  # noqa: E402
from conveyor.protocol import KVBatchMeta  # noqa: E402
from conveyor.trainer.plan import build_run_plan  # noqa: E402
from conveyor.trainer.setup import prepare_default_model  # noqa: E402
from conveyor.workers.placement.group import LocalWorkerGroup, WorkerError, WorkerUserError  # noqa: E402
from conveyor.workers.placement.ray_group import RankDied, RayPlacement, RayWorkerGroup, build_ray_worker_groups  # noqa: E402
from conveyor.workers.placement.roles import worker_specs  # noqa: E402
from conveyor.workers.ranks.actor import PolicyWorker  # noqa: E402
from conveyor.workers.ranks.calls import LogProbCall, UpdateCall  # noqa: E402
from conveyor.workers.ranks.reference import ReferenceWorker  # noqa: E402

OVERRIDES = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "data.synthetic.num_train=64",
    "data.synthetic.num_val=8",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
    # Adam's first step moves each weight by about lr whatever the gradient's size, so a weight whose gradient is
    # ~1e-8 (an expert few tokens reach) moves by lr * g / (|g| + eps): summation-order noise in g shows up as
    # ~1e-3 * lr. At lr=1e-4 that stays far below the 1e-6 tolerance while correct updates move weights by ~1e-4.
    "actor_rollout_ref.actor.optim.lr=0.0001",
]
B, P, R = 6, 5, 4


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids: list[int], seconds: float = 20.0) -> list[int]:
    """The pids still running after waiting up to `seconds` for them to exit."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def env():
    """Ray with 4 logical CPUs, a ray data plane, the tiny model and its config (shared by the module)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    cfg = load_config(None, OVERRIDES)
    model_path = prepare_default_model(cfg)
    dp = make_data_plane("ray", num_storage_actors=2)
    try:
        yield cfg, model_path, dp
    finally:
        dp.close()
        if started:
            ray.shutdown()


def _put_batch(dp, partition: str, vocab: int) -> KVBatchMeta:
    """A batch with the fields an update needs except old_log_probs (left-padded prompts, right-padded responses)."""
    fields = ragged_update_fields(B, P, R, vocab, torch.Generator().manual_seed(0))
    return dp.kv_batch_put([f"s{i}" for i in range(B)], partition, fields)


@pytest.fixture(scope="module")
def two_ranks(env):
    """The actor role as two Ray ranks (gloo process group), shut down after the module."""
    cfg, model_path, dp = env
    group = RayWorkerGroup(
        worker_specs(cfg, build_run_plan(cfg, "cpu"), model_path, dp, None, "cpu")["actor"],
        world_size=2,
        num_cpus=0.5,
        timeout_s=60,
    )
    yield group
    group.shutdown()


def test_a_rank_leaves_its_built_worker_out_of_garbage_collection(two_ranks) -> None:
    # Full collections would walk the worker's, torch's and transformers' objects in every call's process for
    # nothing; each rank froze them once its worker was built (`freeze_heap`).
    import gc

    for actor in two_ranks.ranks.actors:
        assert ray.get(actor.__ray_call__.remote(lambda _: gc.get_freeze_count())) > 10_000


def test_two_ranks_update_like_one_over_the_same_batch(env, two_ranks, tmp_path) -> None:
    cfg, model_path, dp = env
    local = LocalWorkerGroup(worker_specs(cfg, build_run_plan(cfg, "cpu"), model_path, dp, None, "cpu")["actor"])
    meta = _put_batch(dp, "dp-equivalence", local.worker.model.config.vocab_size)
    # old_log_probs from the (shared) initial policy, so the ratio starts at 1 as in training.
    local.call(
        PolicyWorker.compute_log_prob,
        meta.with_extra_info(**LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info()),
    )
    initial = {k: v.clone() for k, v in local.worker.model.state_dict().items()}
    call = meta.with_extra_info(**UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info())

    one = local.call(PolicyWorker.update_actor, call)
    two = two_ranks.call(PolicyWorker.update_actor, call)

    # Per-rank results arrive merged: one entry per rank, in rank order.
    assert two.keys == meta.keys
    for key in ("perf/max_memory_allocated_gb", "actor/pg_loss@sum", "actor/grad_norm"):
        assert isinstance(two.extra_info[key], list) and len(two.extra_info[key]) == 2
    assert all(v > 0 for v in two.extra_info["perf/max_memory_allocated_gb"])
    pids = [w["pid"] for w in two_ranks.rank_info()]
    assert len(set(pids)) == 2 and all(_alive(p) for p in pids)

    # Same loss and gradient norm: normalisers are global and gradients all-reduced.
    m1, m2 = reduce_rank_metrics(one.extra_info), reduce_rank_metrics(two.extra_info)
    assert m1["actor/pg_loss"] != 0.0
    assert m2["actor/pg_loss"] == pytest.approx(m1["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert m2["actor/grad_norm"] == pytest.approx(m1["actor/grad_norm"], rel=1e-5)
    assert m2["perf/max_memory_allocated_gb"] == max(two.extra_info["perf/max_memory_allocated_gb"])

    # Same parameters after the step, on both ranks.
    want = local.worker.model.state_dict()
    moved = max(float((want[k] - initial[k]).abs().max()) for k in want)
    assert moved > 5e-5, "the update barely moved the weights: the comparison below would be vacuous"
    # Two Ray ranks default to fsdp2: the gathered weights are the one-rank step's.
    got, other = two_ranks.call_all(PolicyWorker.model_state_dict)
    assert other == {}  # gathered on rank 0 only
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    # Each Ray rank writes its own shards of a checkpoint into the shared directory.
    extras = two_ranks.call_all(PolicyWorker.save_checkpoint, str(tmp_path / "shards"))
    assert [e["optim_steps"] for e in extras] == [1, 1]
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_a_tagged_handle_is_split_by_tokens_and_logs_the_imbalance(env, two_ranks) -> None:
    """seq_len tags (prompt + response tokens) balance the ranks' shares; the call reports the split's imbalance."""
    from conveyor.workers.placement.group import split_for_ranks
    from conveyor.workers.training.balance import imbalance, sequence_lengths, with_seq_lens

    _, _, dp = env
    meta = _put_batch(dp, "balance", 40)
    td = dp.kv_batch_get(meta.keys, "balance", ["prompt_mask", "response_mask"])
    meta = with_seq_lens(meta, sequence_lengths(td["prompt_mask"], td["response_mask"]))
    out = two_ranks.call(
        PolicyWorker.compute_log_prob,
        meta.with_extra_info(**LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info()),
    )
    assert sorted(out.keys) == sorted(meta.keys)
    assert {k: t["seq_len"] for k, t in zip(out.keys, out.tags)} == {
        k: t["seq_len"] for k, t in zip(meta.keys, meta.tags)
    }
    want = imbalance([sum(t["seq_len"] for t in c.tags) for c in split_for_ranks(meta, 2)])
    assert out.extra_info["perf/compute_log_prob/rank_token_imbalance"] == [pytest.approx(want)] * 2


def test_a_failing_rank_is_one_worker_error_and_stops_the_role(env, two_ranks) -> None:
    cfg, model_path, dp = env
    meta = _put_batch(dp, "failure", 100)
    dp.kv_batch_put(meta.keys[:3], "failure", {"old_log_probs": torch.zeros(3, R)})  # rank 1's rows lack it
    pids = [w["pid"] for w in two_ranks.rank_info()]
    t0 = time.monotonic()
    # Rank 0 has its rows and waits for rank 1 in the all-reduce of normalisers; rank 1 fails reading its rows.
    with pytest.raises(WorkerError) as info:
        two_ranks.call(
            PolicyWorker.update_actor,
            meta.with_extra_info(**UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info()),
        )
    assert time.monotonic() - t0 < 60
    err = info.value
    assert not isinstance(err, WorkerUserError)
    assert (err.role, err.rank, err.stage) == ("actor", 1, "update_actor")
    assert type(err.cause) is FieldNotFoundError and err.cause.fields == ["old_log_probs"]
    assert str(err).startswith("actor rank 1 failed in update_actor: FieldNotFoundError: field(s) ['old_log_probs']")
    assert "'failure'" in str(err)
    # Both ranks' processes are gone (rank 0 was stuck in a collective), their placement is given back,
    # and the group refuses further calls.
    assert _wait_gone(pids) == []
    assert two_ranks.placement is None
    with pytest.raises(RuntimeError, match="shut down"):
        two_ranks.call(PolicyWorker.update_actor, meta)


def test_a_crashed_rank_reports_the_end_of_its_stderr(env) -> None:
    # A rank whose process dies (here a segfault, as a native crash would) has no exception to send back: the error
    # says so and carries the Python stack `faulthandler` wrote to the process's stderr before it died.
    cfg, model_path, dp = env
    group = RayWorkerGroup(
        worker_specs(cfg, build_run_plan(cfg, "cpu"), model_path, dp, None, "cpu")["actor"],
        world_size=1,
        num_cpus=0.5,
        timeout_s=60,
    )
    try:
        pid = group.rank_info()[0]["pid"]
        os.kill(pid, signal.SIGSEGV)
        assert _wait_gone([pid]) == []
        with pytest.raises(WorkerError) as info:
            group.call_all(PolicyWorker.weights_version)
        err = info.value
        assert (err.role, err.rank, err.stage) == ("actor", 0, "weights_version")
        assert isinstance(err.cause, RankDied)
        assert "ActorDiedError" in str(err) and f"-{pid}.err" in str(err)
        assert "Segmentation fault" in str(err)  # faulthandler's report, from the rank's own stderr
    finally:
        group.shutdown()


def test_a_rank_that_dies_behind_its_link_is_the_same_worker_error(env) -> None:
    # Calls over the ranks' links (the asynchronous rollout's hot path) fail as Ray tasks do: Ray is asked why the
    # rank is gone, and the error names the role, the rank and the call, with the end of the rank's stderr.
    cfg, model_path, dp = env
    group = RayWorkerGroup(
        worker_specs(cfg, build_run_plan(cfg, "cpu"), model_path, dp, None, "cpu")["actor"],
        world_size=1,
        num_cpus=0.5,
        timeout_s=60,
    )
    try:
        group.ranks.open_links()
        empty = KVBatchMeta(keys=[], partition_id="none")
        with pytest.raises(WorkerError, match="actor rank 0 failed in compute_log_prob"):
            group.call(PolicyWorker.compute_log_prob, empty)  # an error in the rank comes back over the link
        pid = group.rank_info()[0]["pid"]
        os.kill(pid, signal.SIGSEGV)
        assert _wait_gone([pid]) == []
        with pytest.raises(WorkerError) as info:
            group.call(PolicyWorker.compute_log_prob, empty)
        err = info.value
        assert (err.role, err.rank, err.stage) == ("actor", 0, "compute_log_prob")
        assert isinstance(err.cause, RankDied)
        assert "ActorDiedError" in str(err) and "Segmentation fault" in str(err)
    finally:
        group.shutdown()


def test_impossible_resources_fail_at_once_with_a_clear_message(env) -> None:
    cfg, model_path, dp = env
    # 4 prompts x 16 samples: a mini-batch has a sequence for each of the 64 ranks asked for.
    big = load_config(
        None,
        OVERRIDES
        + [
            "trainer.n_gpus_per_node=64",
            "actor_rollout_ref.rollout.n=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        ],
    )
    live_before = {k for k, p in placement_group_table().items() if p["state"] in ("PENDING", "CREATED")}
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        build_ray_worker_groups(big, worker_specs(big, build_run_plan(big, "cuda"), model_path, dp, None, "cuda"), dp)
    assert time.monotonic() - t0 < 10
    msg = str(info.value)
    assert "the actor ranks need" in msg and "GPU 64" in msg  # what was asked
    assert "CPU 4" in msg and "1 node(s)" in msg  # what the cluster has
    assert "trainer.n_gpus_per_node" in msg and "ray.worker_cpus" in msg  # what to change
    live_after = {k for k, p in placement_group_table().items() if p["state"] in ("PENDING", "CREATED")}
    assert live_after <= live_before  # nothing reserved, nothing left pending


def test_busy_resources_time_out_and_leave_no_placement_group(env) -> None:
    free = ray.available_resources().get("CPU", 0)
    hog = placement_group([{"CPU": free - 0.3}])  # leave less than the 2 x 0.5 CPU asked for below
    ray.get(hog.ready(), timeout=30)
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="within ray.timeout_s=1s") as info:
            RayPlacement("actor", 2, {"CPU": 0.5}, timeout_s=1)
        assert time.monotonic() - t0 < 10
        assert "actor" in str(info.value) and "CPU" in str(info.value)
        states = [p["state"] for p in placement_group_table().values() if p["placement_group_id"] != hog.id.hex()]
        assert "PENDING" not in states and "CREATED" not in states
    finally:
        remove_placement_group(hog)


def test_memory_data_plane_is_refused(env) -> None:
    cfg, model_path, _ = env
    with make_data_plane("memory") as memory:
        with pytest.raises(ValueError, match="transfer_queue.backend=ray"):
            build_ray_worker_groups(
                cfg, worker_specs(cfg, build_run_plan(cfg, "cpu"), model_path, memory, None, "cpu"), memory
            )


def _ray_rank_actors() -> list[dict]:
    """The live rank actors (model roles' ranks and the reward's) of this Ray session."""
    from ray._private.state import actors as actor_table

    return [a for a in actor_table().values() if a["State"] == "ALIVE" and a["ActorClassName"].endswith("_RankActor")]


def test_the_reference_lives_in_the_actors_processes_and_agrees_with_one_rank(env) -> None:
    cfg, model_path, dp = env
    kl = load_config(None, OVERRIDES + ["actor_rollout_ref.actor.use_kl_loss=true", "trainer.num_cpu_workers=2"])
    plan = build_run_plan(kl, "cpu")
    assert plan.use_reference
    before = len(_ray_rank_actors())
    groups = build_ray_worker_groups(kl, worker_specs(kl, plan, model_path, dp, None, "cpu"), dp)
    try:
        assert sorted(groups) == ["actor", "ref", "reward"]
        actor_pids = [w["pid"] for w in groups["actor"].rank_info()]
        # Rank i of the reference is built in rank i's process of the actor: two model processes for two ranks.
        assert [w["pid"] for w in groups["ref"].rank_info()] == actor_pids
        assert len(set(actor_pids)) == 2
        assert len(_ray_rank_actors()) - before == 2 + 1  # two model ranks and the reward worker
        # The placement reserves one share per rank for all model roles, not one per role.
        assert groups["ref"].placement is groups["actor"].placement
        assert groups["actor"].placement.bundle == {"CPU": kl.ray.worker_cpus}

        local = LocalWorkerGroup(worker_specs(kl, plan, model_path, dp, None, "cpu")["ref"])
        assert local.worker.trained.optimizer is None
        assert not any(p.requires_grad for p in local.worker.model.parameters())
        call = LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info()
        vocab = local.worker.model.config.vocab_size
        on_ray = _put_batch(dp, "ref-colocated", vocab).with_extra_info(**call)
        in_process = _put_batch(dp, "ref-local", vocab).with_extra_info(**call)
        groups["ref"].call(ReferenceWorker.compute_log_prob, on_ray)
        local.call(ReferenceWorker.compute_log_prob, in_process)
        got = dp.kv_batch_get(on_ray.keys, on_ray.partition_id, select_fields=["ref_log_prob"])["ref_log_prob"]
        want = dp.kv_batch_get(in_process.keys, in_process.partition_id, select_fields=["ref_log_prob"])["ref_log_prob"]
        assert got.dtype == torch.float32 and float(want.abs().max()) > 0
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)

        # The actor's ranks still train in the same processes, next to the reference.
        upd = _put_batch(dp, "ref-colocated-update", vocab)
        groups["actor"].call(PolicyWorker.compute_log_prob, upd.with_extra_info(**call))
        groups["ref"].call(ReferenceWorker.compute_log_prob, upd.with_extra_info(**call))
        out = groups["actor"].call(
            PolicyWorker.update_actor,
            upd.with_extra_info(**UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info()),
        )
        assert len(out.extra_info["actor/grad_norm"]) == 2
    finally:
        for group in groups.values():
            group.shutdown()
    assert groups["actor"].placement is None and groups["ref"].placement is None
    assert _wait_gone(actor_pids) == []
