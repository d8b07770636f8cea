"""Rollout bundles: a replayed step's update is the recorded one's, bit for bit; the window; mismatches refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conveyor.cli import main
from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.protocol import KVBatchMeta
from conveyor.trainer.export import export_hf
from conveyor.trainer.rollout_dumps import list_bundles, read_bundle, write_bundle
from conveyor.trainer.run import run_training

# Wall-clock and memory readings differ from run to run by nature; every other metric must not. Validation
# (val/*) generates, which a replay does not: it is no part of a step's update.
_MEASURED = ("timing_s/", "timing_cpu_s/", "perf/", "gen_time_s", "val/")


def _metrics(run_dir: Path) -> dict[int, dict]:
    """Each step's metrics but the measured ones and validation's."""
    return {
        r["step"]: {k: v for k, v in r.items() if not any(m in k for m in _MEASURED)}
        for r in read_metrics_jsonl(run_dir / "metrics.jsonl")
    }


def _checksum(run_dir: Path, step: int, out: Path) -> str:
    """sha256 over the policy's parameters (names, dtypes, shapes and bytes) at checkpoint `step`."""
    export_hf(run_dir, out, step=step)
    h = hashlib.sha256()
    tensors: dict = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


# A warm-started policy: its samples earn rewards, so every update moves the weights (all-zero rewards would give
# zero advantages, and a replay that reproduced "no change" would prove nothing).
_LEARNS = ["actor_rollout_ref.model.tiny.warmstart_steps=30"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_run_base) -> Path:
    """A 4-step run that checkpoints and dumps every step, keeping the newest 3 bundles."""
    run_dir = tmp_path_factory.mktemp("recorded")
    run_training(
        load_config(
            None,
            tiny_run_base
            + _LEARNS
            + [
                f"trainer.default_local_dir={run_dir}",
                "trainer.total_training_steps=4",
                "trainer.save_freq=1",
                "trainer.max_ckpt_to_keep=null",
                "trainer.dump_rollouts.freq=1",
                "trainer.dump_rollouts.window=3",
            ],
        )
    )
    return run_dir


def _replay(run_dir: Path, tiny_run_base: list[str], source: Path, resume: Path | None) -> None:
    resume_keys = (
        ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={resume}"] if resume is not None else []
    )
    run_training(
        load_config(
            None,
            tiny_run_base
            + _LEARNS
            + [
                f"trainer.default_local_dir={run_dir}",
                "trainer.total_training_steps=4",  # the recorded run's: its lr schedule spans 4 steps
                "trainer.save_freq=1",
                "trainer.max_ckpt_to_keep=null",
                f"trainer.replay_rollouts_from={source}",
                *resume_keys,
            ],
        )
    )


def test_window_keeps_the_newest_bundles(recorded: Path) -> None:
    assert list_bundles(recorded / "rollouts") == [2, 3, 4]
    assert sorted(p.name for p in (recorded / "rollouts").iterdir()) == ["step_000002", "step_000003", "step_000004"]
    record, columns = read_bundle(recorded / "rollouts" / "step_000003")
    assert record["step"] == 3 and record["policy_version"] == 2
    assert {"responses", "response_mask", "rollout_log_probs", "rm_scores", "uid"} <= set(columns)
    assert record["seeds"]["trainer.seed"] == 0 and isinstance(record["seeds"]["generation"], int)
    assert record["compat"]["data.train_batch_size"] == 4 and "rollout/generated_tokens" in record["metrics"]


def test_replaying_a_step_reproduces_its_update(recorded: Path, tmp_path: Path, tiny_run_base) -> None:
    want = _metrics(recorded)
    assert all(want[s]["actor/grad_norm"] > 0 for s in (3, 4))  # the updates replayed below are not vacuous
    # One bundle, from the checkpoint of the step before.
    one = tmp_path / "one"
    _replay(one, tiny_run_base, recorded / "rollouts" / "step_000003", recorded / "checkpoints/global_step_2")
    got = _metrics(one)
    assert sorted(got) == [3]  # no validation: a replay cannot generate
    assert got[3] == want[3] and "actor/pg_loss" in got[3]
    three = _checksum(recorded, 3, tmp_path / "x0")
    assert _checksum(one, 3, tmp_path / "x1") == three != _checksum(recorded, 2, tmp_path / "x2")
    # The dump root: every step trained from its own bundle.
    root = tmp_path / "root"
    _replay(root, tiny_run_base, recorded / "rollouts", recorded / "checkpoints/global_step_2")
    got = _metrics(root)
    assert got[3] == want[3] and got[4] == want[4]
    four = _checksum(recorded, 4, tmp_path / "y0")
    assert _checksum(root, 4, tmp_path / "y1") == four != three
    # Nothing generated: the plan says so and no engine started.
    plan = json.loads((root / "plan.json").read_text())
    assert plan["rollout_placement"] == "none"


def test_replaying_step_one_starts_from_the_initial_weights(tmp_path: Path, tiny_run_base) -> None:
    first = tmp_path / "first"
    keys = [*_LEARNS, "trainer.total_training_steps=1", "trainer.save_freq=1"]
    run_training(
        load_config(None, tiny_run_base + keys + [f"trainer.default_local_dir={first}", "trainer.dump_rollouts.freq=1"])
    )
    again = tmp_path / "again"
    source = first / "rollouts" / "step_000001"
    run_training(
        load_config(
            None,
            tiny_run_base + keys + [f"trainer.default_local_dir={again}", f"trainer.replay_rollouts_from={source}"],
        )
    )
    assert _metrics(again)[1] == _metrics(first)[1]
    assert _checksum(again, 1, tmp_path / "x1") == _checksum(first, 1, tmp_path / "x0")


def test_an_asynchronous_step_replays_too(tmp_path: Path, tiny_run_base) -> None:
    """k = 1: the bundle holds samples of the step before's weights, and the update over them is the recorded one."""
    keys = [*_LEARNS, "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.v1.trainer_mode=separate_async"]
    first = tmp_path / "first"
    run_training(
        load_config(None, tiny_run_base + keys + [f"trainer.default_local_dir={first}", "trainer.dump_rollouts.freq=1"])
    )
    assert read_bundle(first / "rollouts" / "step_000002")[0]["policy_version"] == 0  # sampled a version early
    again = tmp_path / "again"
    resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={first / 'checkpoints/global_step_1'}"]
    source = f"trainer.replay_rollouts_from={first / 'rollouts'}"
    run_training(load_config(None, tiny_run_base + keys + [f"trainer.default_local_dir={again}", source, *resume]))
    assert _metrics(again)[2] == _metrics(first)[2]
    assert _checksum(again, 2, tmp_path / "x1") == _checksum(first, 2, tmp_path / "x0")


def test_a_mismatched_bundle_is_refused_naming_the_key(
    recorded: Path, tmp_path: Path, tiny_run_base, capsys: pytest.CaptureFixture
) -> None:
    base = [o for o in tiny_run_base if not o.startswith("data.train_batch_size=")]
    status = main(
        [
            "train",
            *base,
            *_LEARNS,
            "trainer.total_training_steps=4",
            "data.train_batch_size=8",
            f"trainer.default_local_dir={tmp_path / 'bad'}",
            f"trainer.replay_rollouts_from={recorded / 'rollouts'}",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert "trainer.replay_rollouts_from" in err and "data.train_batch_size=4" in err and "Traceback" not in err
    # A bundle of another step than the one the run trains next.
    status = main(
        [
            "train",
            *tiny_run_base,
            *_LEARNS,
            "trainer.total_training_steps=4",
            f"trainer.default_local_dir={tmp_path / 'early'}",
            f"trainer.replay_rollouts_from={recorded / 'rollouts' / 'step_000003'}",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and "the bundle is of step 3, but this run trains step 1" in err
    # A bundle without a field this run's stages read: ReMax's greedy baseline was never recorded.
    status = main(
        [
            "train",
            *tiny_run_base,
            *_LEARNS,
            "trainer.total_training_steps=4",
            "algorithm.adv_estimator=remax",
            f"trainer.default_local_dir={tmp_path / 'remax'}",
            f"trainer.replay_rollouts_from={recorded / 'rollouts'}",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={recorded / 'checkpoints' / 'global_step_2'}",
            "trainer.resume_accept_config_changes=true",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and "the bundle of step 3 lacks reward_baselines" in err and "Traceback" not in err


def test_a_bundle_reads_back_as_written_and_a_damaged_one_is_refused(tmp_path: Path) -> None:
    meta = KVBatchMeta(keys=["a", "b"], partition_id="train-1", tags=[{"len": 3}, {"len": 1}])
    columns = {
        "responses": torch.tensor([[1, 2], [3, 4]], dtype=torch.int64),
        "routed_experts": torch.tensor([[[0, -1]], [[1, 1]]], dtype=torch.int16),
        "jagged": torch.nested.nested_tensor([torch.ones(3), torch.zeros(1)], layout=torch.jagged),
        "ragged": [torch.arange(2.0), torch.arange(5.0)],
        "raw_prompt": [[{"role": "user", "content": "1+1="}], [{"role": "user", "content": "2+2="}]],
    }
    path = write_bundle(tmp_path, 7, meta, columns, metrics={"rollout/x": 1.5, "timing_s/gen": 2.0}, info={})
    record, back = read_bundle(path)
    assert record["keys"] == ["a", "b"] and record["tags"] == [{"len": 3}, {"len": 1}]
    assert record["metrics"] == {"rollout/x": 1.5}  # timings measure a machine, not the samples
    for name in ("responses", "routed_experts"):
        assert back[name].dtype == columns[name].dtype and torch.equal(back[name], columns[name])
    assert [r.tolist() for r in back["jagged"].unbind(0)] == [[1.0, 1.0, 1.0], [0.0]]
    assert [r.tolist() for r in back["ragged"]] == [[0.0, 1.0], [0.0, 1.0, 2.0, 3.0, 4.0]]
    assert back["raw_prompt"] == columns["raw_prompt"]
    assert list_bundles(tmp_path) == [7] and not list(tmp_path.glob(".*"))  # no temporary left behind
    record["kinds"]["missing"] = "dense"
    (path / "bundle.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="incomplete rollout bundle"):
        read_bundle(path)
