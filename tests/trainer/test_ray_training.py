"""End-to-end runs on Ray: two simulated nodes and a rank that fails (two CPU ranks on this machine: see
test_one_construction_path.py)."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from conveyor.config import load_config  # noqa: E402
from conveyor.data_plane.ray_store import RayDataPlane  # noqa: E402
from conveyor.trainer.run import run_training  # noqa: E402
from conveyor.workers.placement.group import WorkerError  # noqa: E402

# tiny_run (tests/conftest.py) keeps only the actor and the reward: GRPO, no KL term, so no reference or critic.


def _steps(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): r for r in rows}


def _assert_trained_two_steps(run_dir: Path) -> None:
    steps = _steps(run_dir)
    assert {1, 2} <= set(steps)
    for s in (1, 2):
        row = steps[s]
        # Each rank reports its own peak; the trainer logs the max over ranks under the role.
        assert row["actor/perf/max_memory_allocated_gb"] > 0
        assert row["actor/perf/cpu_memory_used_gb"] > 0
        assert "actor/pg_loss" in row and "actor/grad_norm" in row


def test_ray_data_plane_needs_a_running_ray() -> None:
    if ray.is_initialized():
        pytest.skip("another test module left Ray running")
    with pytest.raises(RuntimeError, match="ray.init"):
        RayDataPlane()


def test_an_address_where_no_ray_listens_fails_fast() -> None:
    from conveyor.ray_utils import ensure_ray

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"ray.address='127.0.0.1:{port}': no Ray head answers there"):
        ensure_ray(load_config(None, [f"ray.address=127.0.0.1:{port}"]))
    assert time.monotonic() - t0 < 10 and not ray.is_initialized()


@pytest.mark.parametrize(
    "overrides,backend,why",
    [
        (["trainer.num_cpu_workers=2"], "memory", "on this machine"),
        (["trainer.nnodes=2"], "ray", "other machines"),
        (["trainer.num_cpu_workers=2", "ray.address=auto"], "ray", "other machines"),
        (["trainer.n_gpus_per_node=2"], "ray", "GPU workers"),
        (["trainer.num_cpu_workers=2", "transfer_queue.backend=ray"], "ray", None),
        ([], "memory", None),
    ],
)
def test_which_data_plane_workers_on_ray_reach(overrides, backend, why, caplog) -> None:
    from conveyor.ray_utils import data_plane_backend, serves_memory_plane

    cfg = load_config(None, overrides)
    with caplog.at_level(logging.INFO, logger="conveyor"):
        assert data_plane_backend(cfg) == backend
    assert serves_memory_plane(cfg) == (why == "on this machine")
    said = [r.getMessage() for r in caplog.records]
    assert (why is None and not said) or any(why in m for m in said), said


# Two CPU ranks on this machine, started and stopped by run_training itself: the Ray case of
# test_one_construction_path.py checks that run (its logs, its metrics, nothing left running), so that
# one Ray run serves both.


def test_a_failing_rank_stops_the_run_and_releases_everything(tiny_run, wait_until, tmp_path, monkeypatch) -> None:
    import dataclasses

    from conveyor.workers.placement.role_table import ROLES

    base = ROLES["actor"].worker
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    # Defined here, so Ray ships the class by value to the rank processes.
    class FailingPolicyWorker(base):
        """A policy worker whose rank 1 fails in its first update."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            (pid_dir / f"actor-{self.rank}").write_text(str(os.getpid()))

        def update_actor(self, meta):
            if self.rank == 1:
                raise RuntimeError("injected failure in rank 1")
            return super().update_actor(meta)

    monkeypatch.setitem(ROLES, "actor", dataclasses.replace(ROLES["actor"], worker=FailingPolicyWorker))
    # Ray started here and left running, so the run's own clean-up is what is checked.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        cfg = load_config(None, tiny_run + ["trainer.num_cpu_workers=2"])
        with pytest.raises(WorkerError) as info:
            run_training(cfg)
        err = info.value
        assert (err.role, err.rank, err.stage) == ("actor", 1, "update_actor")
        assert type(err.cause) is RuntimeError
        assert str(err) == "actor rank 1 failed in update_actor: RuntimeError: injected failure in rank 1"
        assert ray.is_initialized()  # not ours to stop
        # Every worker actor is dead; no placement group is left.
        from ray._private.state import actors as actor_table
        from ray.util.placement_group import placement_group_table

        assert wait_until(lambda: all(a["State"] == "DEAD" for a in actor_table().values()))
        assert len(actor_table()) >= 3  # 2 actor ranks + 1 reward at least (the data plane is the trainer's)
        assert not [p for p in placement_group_table().values() if p["state"] in ("PENDING", "CREATED")]
        pids = [int(p.read_text()) for p in pid_dir.iterdir()]
        assert len(pids) == 2
        assert wait_until(
            lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
        )
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def two_node_run(tiny_run_base: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run that two tests check (a Ray run costs ~25 s here, nearly all of it starting processes): the tiny run
    on two simulated nodes with a KL loss (the reference role) and GAE (the critic role), each rank's worker of
    every model role recording the pid of the process that built it."""
    import dataclasses

    from ray.cluster_utils import Cluster

    from conveyor.workers.placement.role_table import ROLES

    tmp = tmp_path_factory.mktemp("two-nodes")
    run_dir, pid_dir = tmp / "run", tmp / "pids"
    pid_dir.mkdir()

    def recording(base, role):
        # Defined here, so Ray ships the classes by value to the rank processes.
        class WithPid(base):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                (pid_dir / f"{role}-{self.rank}").write_text(str(os.getpid()))

        return WithPid

    assert not ray.is_initialized()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("conveyor")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    with pytest.MonkeyPatch.context() as mp:
        for role in ("actor", "ref", "critic"):
            mp.setitem(ROLES, role, dataclasses.replace(ROLES[role], worker=recording(ROLES[role].worker, role)))
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=2)
            cluster.wait_for_nodes()
            run_training(
                load_config(
                    None,
                    tiny_run_base
                    + [
                        f"trainer.default_local_dir={run_dir}",
                        "trainer.nnodes=2",
                        f"ray.address={cluster.address}",
                        "actor_rollout_ref.actor.use_kl_loss=true",
                        "algorithm.adv_estimator=gae",
                        # Token budgets on (every role's forwards fill micro-batches
                        # by tokens): the stages' plumbing on two ranks.
                        "actor_rollout_ref.actor.use_dynamic_bsz=true",
                        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=140",
                    ],
                )
            )
            still_connected = ray.is_initialized()
        finally:
            cluster.shutdown()
            logger.removeHandler(handler)
            logger.setLevel(old_level)
    return {
        "run_dir": run_dir,
        "messages": [r.getMessage() for r in records],
        "still_connected": still_connected,
        "pids": {p.name: int(p.read_text()) for p in pid_dir.iterdir()},
    }


def test_two_simulated_nodes(two_node_run) -> None:
    run_dir = two_node_run["run_dir"]
    _assert_trained_two_steps(run_dir)
    assert all("actor/kl_loss" in row for row in _steps(run_dir).values() if row["step"] > 0)
    # One process per node, hosting that rank of the actor, of the reference and of the critic: the placement
    # spread the bundles over both nodes.
    assert "actor+ref+critic: 2 rank(s) on 2 node(s), one process per rank" in two_node_run["messages"], [
        m for m in two_node_run["messages"] if "rank(s)" in m
    ]
    assert not two_node_run["still_connected"]  # run_training connected, so it disconnected


def test_a_reference_and_critic_run_on_two_ranks_hosts_every_model_role_in_one_process_per_rank(two_node_run) -> None:
    # The two-node run above: a KL loss and GAE bring the reference and the critic next to the actor.
    pids = two_node_run["pids"]
    assert sorted(pids) == ["actor-0", "actor-1", "critic-0", "critic-1", "ref-0", "ref-1"]
    # Rank i of the reference and of the critic was built in rank i's process of the actor: as many model
    # processes as ranks.
    for rank in (0, 1):
        assert pids[f"ref-{rank}"] == pids[f"critic-{rank}"] == pids[f"actor-{rank}"]
    assert len(set(pids.values())) == 2
    steps = _steps(two_node_run["run_dir"])
    for s in (1, 2):
        for key in ("actor/kl_loss", "critic/vf_loss", "actor/perf/cpu_memory_used_gb"):
            assert key in steps[s], key
        # Every split after the rollout balances prompt + response tokens over the two ranks, and says how well
        # (the old log-probs come from the rollout here: no actor forward).
        logged = sorted(k for k in steps[s] if k.endswith("/rank_token_imbalance"))
        assert logged == [
            "actor/perf/generate_sequences/rank_token_imbalance",
            "actor/perf/update_actor/rank_token_imbalance",
            "critic/perf/compute_values/rank_token_imbalance",
            "critic/perf/update_critic/rank_token_imbalance",
            "ref/perf/compute_log_prob/rank_token_imbalance",
        ]
        assert all(1.0 <= steps[s][k] < 1.5 for k in logged), {k: steps[s][k] for k in logged}
    assert steps[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference before step 1
    assert (two_node_run["run_dir"] / "checkpoints" / "global_step_2" / "critic" / ".metadata").is_file()
