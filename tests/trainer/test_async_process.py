"""The asynchronous rollout in processes of its own (trainer.v1.separate_async.rollout_process=own).

The rollout worker group and the reward worker are Ray actors beside the
trainer's process, on the trainer's data plane served to them; the weights go
over the weight channel into a copy the replica loads before its next batch.
None of that may change what is trained: these runs equal the same runs with
the rollout on a thread of the trainer's process, and k = 0 equals the
synchronous trainer, bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.trainer.export import export_hf
from conveyor.trainer.run import run_training
from conveyor.workers.placement.group import WorkerError

pytest.importorskip("ray")

# Wall-clock and memory readings differ from run to run by nature, and the sides' CPU and idle figures with them.
_MEASURED = (
    "timing_s/",
    "timing_cpu_s/",
    "perf/",
    "gen_time_s",
    "off_policy/trainer_",
    "off_policy/rollout_",
    "off_policy/helper_",
    "weight_sync_s",
    "weight_load_s",
    "weight_send",
    "weight_sync_gb",
    "weight_sync_buckets",
)
ASYNC = "trainer.v1.trainer_mode=separate_async"
OWN, THREAD = "trainer.v1.separate_async.rollout_process=own", "trainer.v1.separate_async.rollout_process=trainer"


def _run(tmp_path, tiny_run_base: list[str], name: str, extra: list[str]) -> tuple[list[dict], object]:
    run_dir = tmp_path / name
    run_training(load_config(None, tiny_run_base + [f"trainer.default_local_dir={run_dir}", "ray.num_cpus=4", *extra]))
    return read_metrics_jsonl(run_dir / "metrics.jsonl"), run_dir


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every op on one torch thread in both runs a test compares, as the replicas have (half a CPU each) and the
    thread mode's trainer (it halves its threads between its two threads): an op split over another number of
    threads may sum in another order, a last-bit difference with some CPUs' kernels (AVX-512 MKL)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(m in k for m in _MEASURED)} for r in rows]


def _weights(run_dir, out) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(export_hf(run_dir, out).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _same_weights(a_dir, b_dir, tmp_path) -> None:
    a, b = _weights(a_dir, tmp_path / f"hf-{a_dir.name}"), _weights(b_dir, tmp_path / f"hf-{b_dir.name}")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)


COMMON = [
    "trainer.total_training_steps=3",
    "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
    "actor_rollout_ref.actor.router_replay.mode=R3",
    "actor_rollout_ref.model.tiny.warmstart_steps=20",
]


def test_a_rollout_in_its_own_process_trains_exactly_what_the_thread_does(tmp_path, tiny_run_base):
    # k = 1 and R3: samples one version old, their routing replayed; generated, scored, versioned and synced
    # across processes, then trained here.
    thread, thread_dir = _run(tmp_path, tiny_run_base, "thread", COMMON + [ASYNC, THREAD])
    own, own_dir = _run(tmp_path, tiny_run_base, "own", COMMON + [ASYNC, OWN])
    plan = json.loads((own_dir / "plan.json").read_text())
    assert plan["rollout_process"] == "own"
    assert json.loads((thread_dir / "plan.json").read_text())["rollout_process"] == "trainer"
    assert _strip(own) == _strip(thread)
    assert own[-1]["off_policy/staleness_max"] == 1.0 and own[-1]["rollout/moe/routed_experts_found"] == 1.0
    versions = [
        (r["trained_at"], r["sample_versions"], r["token_version_range"])
        for r in map(json.loads, (own_dir / "async_versions.jsonl").read_text().splitlines())
    ]
    assert versions == [
        (r["trained_at"], r["sample_versions"], r["token_version_range"])
        for r in map(json.loads, (thread_dir / "async_versions.jsonl").read_text().splitlines())
    ]
    assert [v for _, v, _ in versions] == [[0] * 8, [0] * 8, [1] * 8]  # v0, v0, then the weights of update 1
    # The syncs reached the replica through shared memory: packed here, loaded there, no sending thread.
    assert any(k == "rollout/weight_sync_s" for r in own for k in r)
    assert any("rollout/weight_load_s" in r for r in own)
    assert not list(Path("/dev/shm").glob("conveyor-weights-*"))  # the file went once the replica had mapped it
    if sys.platform.startswith("linux"):  # which helper threads of the trainer's process spent CPU (from /proc)
        later = [r for r in own if r["step"] >= 2 and "off_policy/helper_cpu_s/data_plane" in r]
        assert later and all(r["off_policy/helper_cpu_s/data_plane"] > 0 for r in later)  # the replica's reads, writes
        assert not any(r.get("off_policy/helper_cpu_s/weights") for r in later)
        generating = [r for r in thread if r["step"] >= 2 and "timing_s/step" in r]  # the training steps
        assert generating and all(r.get("off_policy/helper_cpu_s/rollout", 0.0) > 0 for r in generating)
    _same_weights(own_dir, thread_dir, tmp_path)


def test_delta_syncs_through_shared_memory_train_what_whole_ones_do(tmp_path, tiny_run_base):
    # The own process's syncs into shared-memory slots, delta-coded: every replica decodes each one into its staged
    # copy in order, so the run equals the same run with whole syncs, and after the first only what changed went.
    delta = "actor_rollout_ref.rollout.delta_sync.enable=true"
    # Every weight moves (the untrained model's rewards are all 0: GRPO alone would leave them as they are).
    moves = ["actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.optim.lr=1e-6"]
    whole, whole_dir = _run(tmp_path, tiny_run_base, "whole", COMMON + moves + [ASYNC, OWN])
    coded, coded_dir = _run(tmp_path, tiny_run_base, "delta", COMMON + moves + [ASYNC, OWN, delta])
    sync_figures = ("rollout/weight_sync/", "rollout/weight_sync_s", "rollout/weight_send")
    assert _strip([{k: v for k, v in r.items() if not k.startswith(sync_figures)} for r in coded]) == _strip(
        [{k: v for k, v in r.items() if not k.startswith(sync_figures)} for r in whole]
    )
    # A step logs the latest of the syncs that finished since its last row (how many rows get one depends on the
    # machine's timing): each decoded without a mismatch, each delta smaller than whole, and the last one logged
    # (a sync after an update, never the first) a delta.
    syncs = [r for r in coded if "rollout/weight_sync/changed_frac" in r]
    assert syncs, "no row logged a sync"
    for row in syncs:
        assert row["rollout/weight_sync/checksum_mismatches"] == 0.0
        if row["rollout/weight_sync/full"] == 0.0:
            assert row["rollout/weight_sync/bytes"] < row["rollout/weight_sync/full_bytes"]
    assert syncs[-1]["rollout/weight_sync/full"] == 0.0
    assert not any(k.startswith("rollout/weight_sync/") for r in whole for k in r)
    assert not list(Path("/dev/shm").glob("conveyor-weights-*"))
    _same_weights(coded_dir, whole_dir, tmp_path)


def test_k0_with_the_rollout_in_its_own_process_is_the_synchronous_trainer(tmp_path, tiny_run_base):
    sync, sync_dir = _run(tmp_path, tiny_run_base, "sync", COMMON)
    own, own_dir = _run(
        tmp_path, tiny_run_base, "own", COMMON + [ASYNC, OWN, "trainer.v1.sampler.max_off_policy_threshold=0"]
    )
    assert [r["step"] for r in sync] == [0, 1, 2, 3]
    strip_async = [{k: v for k, v in r.items() if not k.startswith("off_policy/")} for r in _strip(own)]
    assert _strip(sync) == strip_async
    assert all(own[i]["off_policy/staleness_max"] == 0.0 for i in (1, 2, 3))
    _same_weights(sync_dir, own_dir, tmp_path)


def test_a_crashing_rollout_in_its_own_process_is_one_error_naming_the_stage(tmp_path, tiny_run_base):
    # A plugin is imported in every process of the run; this one breaks the rollout in the replica's only.
    plugin = tmp_path / "explode.py"
    plugin.write_text(
        "import os\n"
        "from conveyor.workers.ranks.replica import ReplicaWorker\n"
        f"if os.getpid() != {os.getpid()}:\n"
        "    def generate_sequences(self, meta):\n"
        "        raise RuntimeError('rollout exploded')\n"
        "    ReplicaWorker.generate_sequences = generate_sequences\n"
    )
    with pytest.raises(WorkerError, match="rollout rank 0 failed in generate_sequences.*rollout exploded"):
        _run(tmp_path, tiny_run_base, "run", [ASYNC, OWN, f"trainer.plugins=[{plugin}]"])


def test_partial_rollouts_in_a_process_of_its_own_continue_samples_with_the_weights_staged_beside_them(
    tmp_path, tiny_run_base
):
    # The replica samples slower than the trainer updates (10 ms per token, in the replica's process only), so a sync
    # staged beside a generation is loaded between two of its tokens; R3 replays the routing across the switch.
    from test_async import check_partial_rollouts

    plugin = tmp_path / "slow.py"
    plugin.write_text(
        "import os, time\n"
        "from conveyor.rollout import hf\n"
        f"if os.getpid() != {os.getpid()}:\n"
        "    sample = hf._Sampler.__call__\n"
        "    def slow(self, logits):\n"
        "        time.sleep(0.01)\n"
        "        return sample(self, logits)\n"
        "    hf._Sampler.__call__ = slow\n"
    )
    metrics, run_dir = _run(
        tmp_path,
        tiny_run_base,
        "run",
        [
            ASYNC,
            OWN,
            "trainer.v1.separate_async.partial_rollout=true",
            f"trainer.plugins=[{plugin}]",
            "trainer.total_training_steps=4",
            "data.max_response_length=24",
            "actor_rollout_ref.actor.router_replay.mode=R3",
            "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
        ],
    )
    assert json.loads((run_dir / "plan.json").read_text())["rollout_process"] == "own"
    check_partial_rollouts(metrics, run_dir)


def test_remax_and_dynamic_sampling_compose_the_same_in_a_process_of_its_own(tmp_path, tiny_run_base):
    # Several generation batches a step into one shared partition (padded), each with its greedy baseline decoded
    # by the same replica right after its samples: the replica in its own process trains what the thread does.
    from test_async_compose import HALF_CONSTANT

    reward = tmp_path / "half.py"
    reward.write_text(HALF_CONSTANT)
    extra = [
        ASYNC,
        "algorithm.adv_estimator=remax",
        "algorithm.filter_groups.enable=true",
        f"reward.custom_reward_function.path={reward}",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_training_steps=3",
    ]
    thread, thread_dir = _run(tmp_path, tiny_run_base, "thread", extra + [THREAD])
    own, own_dir = _run(tmp_path, tiny_run_base, "own", extra + [OWN])
    assert _strip(own) == _strip(thread)
    rows = [r for r in own if "actor/pg_loss" in r]
    assert sum(r["train/num_gen_batches"] for r in rows) > 3  # constant groups were dropped and drawn again
    assert all("timing_s/async/rollout_gen_baseline" in r for r in rows)
    _same_weights(own_dir, thread_dir, tmp_path)


def test_a_reward_that_fails_in_the_replicas_process_is_the_users_error_naming_the_reward(tmp_path, tiny_run_base):
    # The reward worker scores in the replica's call, after the generation: its failure still names its own role
    # and stage, and a user's failure (a reward function that raises) stays the user's (exit status 2 at the CLI).
    from conveyor.workers.placement.group import WorkerUserError

    reward = tmp_path / "broken.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise ValueError('no score for ' + ground_truth)\n"
    )
    with pytest.raises(WorkerUserError, match=r"reward rank 0 failed in compute_reward.*no score for"):
        # No validation first: its reward call is not chained, and the first failure must be the chained one's.
        _run(
            tmp_path,
            tiny_run_base,
            "run",
            [
                ASYNC,
                OWN,
                f"reward.custom_reward_function.path={reward}",
                "trainer.total_training_steps=2",
                "trainer.val_before_train=false",
            ],
        )


def test_replicas_render_the_prompts_the_trainer_would_have_put(tmp_path, tiny_run_base, monkeypatch):
    # Two replicas share each batch: the trainer renders the lengths too (their common width, a balanced split), and
    # each replica renders and writes its share's prompts with its fields. The same run with the prompts put by the
    # trainer trains the same, bit for bit.
    from conveyor.trainer.stages import Stages
    from conveyor.workers.placement.roles import ReplicaGroup

    handed: list[str] = []  # the batches whose prompts were left to the replicas
    to_render = Stages.prompts_to_render

    def counting(self, records, partition_id, *args, **kwargs):
        handed.append(partition_id)
        return to_render(self, records, partition_id, *args, **kwargs)

    monkeypatch.setattr(Stages, "prompts_to_render", counting)
    extra = [ASYNC, OWN, "actor_rollout_ref.rollout.replicas=2", "trainer.total_training_steps=2"]
    rendered, rendered_dir = _run(tmp_path, tiny_run_base, "rendered", extra)
    assert handed == ["batch-1", "batch-2"]
    monkeypatch.setattr(ReplicaGroup, "renders_prompts", property(lambda self: False))
    put, put_dir = _run(tmp_path, tiny_run_base, "put", extra)
    assert handed == ["batch-1", "batch-2"]  # the second run's prompts were put by the trainer
    assert _strip(rendered) == _strip(put)
    assert all("actor/perf/generate_sequences/rank_token_imbalance" in r for r in rendered if "actor/pg_loss" in r)
    _same_weights(rendered_dir, put_dir, tmp_path)
