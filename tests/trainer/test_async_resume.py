"""An asynchronous run stopped after a checkpoint and resumed logs what the uninterrupted run logs, bit for bit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.trainer.run import run_training

# What a run measures rather than computes (seconds, CPU time, memory and bytes held, throughput, idle shares):
# these differ between any two runs, resumed or not.
MEASURED = re.compile(r"^timing_(cpu_)?s/|_s$|_s/|memory|_bytes_|throughput|idle_frac")


def _cut_back(run_dir: Path, step: int) -> None:
    """What a run killed right after `step`'s checkpoint leaves: no later checkpoint, no later record."""
    for ck in (run_dir / "checkpoints").glob("global_step_*"):
        if int(ck.name.rsplit("_", 1)[1]) > step:
            shutil.rmtree(ck)
    for name in ("metrics.jsonl", "async_versions.jsonl"):
        path = run_dir / name
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


def _computed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not MEASURED.search(k)} for r in rows]


@pytest.mark.parametrize("k", [1, 2])
def test_a_resumed_async_run_logs_every_computed_metric_of_the_uninterrupted_one(tmp_path, tiny_run, k):
    base = [o for o in tiny_run if not o.startswith("trainer.default_local_dir=")]
    overrides = base + [
        "trainer.v1.trainer_mode=separate_async",
        f"trainer.v1.sampler.max_off_policy_threshold={k}",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.max_ckpt_to_keep=null",
        # The MoE load-balance and router-health metrics every step: their accumulators are checkpointed too.
        "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_training(load_config(None, overrides + [f"trainer.default_local_dir={full}"]))
    saved = torch.load(full / "checkpoints" / "global_step_2" / "in_flight.pt", weights_only=True)
    # Batches 3.. were handed out before step 2's checkpoint (k of them), generated with older weights.
    assert [b["batch_id"] for b in saved["batches"]] == list(range(3, 3 + k))
    assert all(b["version"] < 2 for b in saved["batches"])

    shutil.copytree(full, resumed)
    _cut_back(resumed, 2)
    run_training(load_config(None, overrides + [f"trainer.default_local_dir={resumed}"]))

    a, b = read_metrics_jsonl(full / "metrics.jsonl"), read_metrics_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert any(key.startswith("rollout/moe/") for key in b[3]) and any(key.startswith("actor/moe/") for key in b[3])
    assert _computed(a) == _computed(b)  # exact: the same samples at the same versions, the same updates
    # Every trained sample's generating version, and the batch each step trained.
    assert (full / "async_versions.jsonl").read_text() == (resumed / "async_versions.jsonl").read_text()


def test_a_checkpoint_without_batches_in_flight_draws_them_again(tmp_path, tiny_run):
    """A checkpoint written before batches in flight were kept (no in_flight.pt) still loses no prompt: the resumed
    run draws the oldest batch not yet trained again and generates it with the resumed weights."""
    base = [o for o in tiny_run if not o.startswith("trainer.default_local_dir=")]
    overrides = base + [
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.sampler.max_off_policy_threshold=1",
        "trainer.total_training_steps=3",
        "trainer.save_freq=2",
        "trainer.dump_freq=1",
        "trainer.dump_num=8",
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    run_training(load_config(None, overrides + [f"trainer.default_local_dir={full}"]))
    shutil.copytree(full, resumed)
    _cut_back(resumed, 2)
    (resumed / "generations" / "step_000003.jsonl").unlink()
    ck = resumed / "checkpoints" / "global_step_2"
    (ck / "in_flight.pt").unlink()
    state = torch.load(ck / "trainer_state.pt", weights_only=True)
    del state["in_flight"], state["files"]  # as such a checkpoint was written
    torch.save(state, ck / "trainer_state.pt")
    run_training(load_config(None, overrides + [f"trainer.default_local_dir={resumed}"]))

    def prompts(run_dir: Path) -> list[str]:
        path = run_dir / "generations" / "step_000003.jsonl"
        return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]

    assert prompts(resumed) == prompts(full)
    step3 = [json.loads(line) for line in (resumed / "async_versions.jsonl").read_text().splitlines()][-1]
    assert step3["step"] == 3 and set(step3["sample_versions"]) == {2}  # regenerated with the resumed weights


def test_a_stop_keeps_the_batches_generating_and_the_resumed_run_draws_the_queued_ones_again(
    tmp_path, tiny_run, monkeypatch
):
    """Ctrl-C with batches queued behind the one generating: the stop's checkpoint keeps only those generated or
    generating (it does not wait for the queue), and the resumed run trains every prompt of the order once."""
    import os
    import signal
    import threading
    import time

    from conveyor.trainer.async_source import AsyncSource

    base = [o for o in tiny_run if not o.startswith("trainer.default_local_dir=")]
    overrides = base + [
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.sampler.max_off_policy_threshold=1000",  # every batch of the run handed out at step 1
        "trainer.total_training_steps=6",
        "trainer.dump_freq=1",
        "trainer.dump_num=8",
    ]
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    run_training(load_config(None, overrides + [f"trainer.default_local_dir={full}"]))

    generate = AsyncSource._generate_batch

    def slow(self, *args, **kwargs):
        time.sleep(1.0)  # a rollout far slower than the trainer: the batches behind the one generating stay queued
        return generate(self, *args, **kwargs)

    def interrupt_after_step_1() -> None:
        metrics = stopped / "metrics.jsonl"
        while not (metrics.is_file() and '"step": 1,' in metrics.read_text()):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)  # the trainer's handler: finish the step, save, stop

    monkeypatch.setattr(AsyncSource, "_generate_batch", slow)
    threading.Thread(target=interrupt_after_step_1, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_training(load_config(None, overrides + [f"trainer.default_local_dir={stopped}"]))
    monkeypatch.undo()
    (ck,) = (stopped / "checkpoints").glob("global_step_*")
    step = int(ck.name.rsplit("_", 1)[1])
    saved = torch.load(ck / "in_flight.pt", weights_only=True)
    kept = [b["batch_id"] for b in saved["batches"]]
    # The batch generating when the step ended (and any finished since), in order; not the whole queue.
    assert kept and kept == list(range(step + 1, step + 1 + len(kept)))
    assert saved["next_batch"] == step + 1 + len(kept) <= 6

    run_training(load_config(None, overrides + [f"trainer.default_local_dir={stopped}"]))

    def prompts(run_dir: Path, s: int) -> list[str]:
        path = run_dir / "generations" / f"step_{s:06d}.jsonl"
        return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]

    for s in range(1, 7):  # none lost, none twice
        assert prompts(stopped, s) == prompts(full, s), s
    log = [json.loads(line) for line in (stopped / "async_versions.jsonl").read_text().splitlines()]
    assert [r["batch"] for r in log] == list(range(1, 7))


def test_every_kind_of_column_comes_back_from_the_file_as_it_was_written(tmp_path):
    """Dense, jagged and list columns (strings, dicts, lists) survive the checkpoint file, which is read without
    unpickling code, and write back into the data plane as the same kind."""
    from conveyor.data_plane import make_data_plane
    from conveyor.trainer.async_source import _loaded_column, _saved_column

    keys = ["a", "b", "c"]
    columns = {
        "responses": torch.arange(12).view(3, 4),
        "router_margins": torch.rand(3, 5, 2).half(),
        "multi_modal": torch.nested.nested_tensor_from_jagged(
            torch.arange(6, dtype=torch.float32), offsets=torch.tensor([0, 1, 3, 6])
        ),
        "raw_prompt": ["1+1=", "2+2=", "3+3="],
        "extra_info": [{"split": "train", "index": i, "a": [i, 2.5]} for i in range(3)],
    }
    tags = [{"seq_len": 4 + i} for i in range(3)]
    with make_data_plane("memory") as before, make_data_plane("memory") as after:
        before.kv_batch_put(keys, "batch-3", columns, tags=tags)
        read = before.kv_batch_get_columns(keys, "batch-3", list(columns))
        assert read["multi_modal"].is_nested  # read back jagged: the path a file cannot hold as it is
        torch.save({name: _saved_column(v) for name, v in read.items()}, tmp_path / "in_flight.pt")
        loaded = torch.load(tmp_path / "in_flight.pt", weights_only=True)
        meta = after.kv_batch_put(keys, "batch-3", {n: _loaded_column(v) for n, v in loaded.items()}, tags=tags)
        assert meta.tags == tags
        back = after.kv_batch_get_columns(keys, "batch-3", list(columns))
    for name, value in read.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            assert back[name].is_nested and all(x.equal(y) for x, y in zip(value.unbind(), back[name].unbind()))
        elif isinstance(value, torch.Tensor):
            assert back[name].dtype == value.dtype and back[name].equal(value), name
        else:
            assert back[name] == value, name
