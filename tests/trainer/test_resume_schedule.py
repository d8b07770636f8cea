"""Resume restores the learning-rate schedule's position: a cosine run resumed after step k continues exactly."""

from __future__ import annotations

import shutil

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.trainer.run import run_training

KEYS = ("actor/lr", "actor/pg_loss", "actor/grad_norm", "reward/mean", "actor/entropy")


def test_cosine_run_resumed_after_step_two_matches_the_uninterrupted_run(tiny_run, tmp_path):
    common = [
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        "trainer.max_ckpt_to_keep=null",
        "actor_rollout_ref.actor.optim.lr_scheduler=cosine",
        "actor_rollout_ref.model.tiny.warmstart_steps=20",
    ]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    run_training(load_config(None, tiny_run + common + [f"trainer.default_local_dir={ref_dir}"]))
    run_training(load_config(None, tiny_run + common + [f"trainer.default_local_dir={run_dir}"]))
    # A crash right after step 2's checkpoint: later checkpoints and metric lines never happened.
    for step in (3, 4):
        shutil.rmtree(run_dir / "checkpoints" / f"global_step_{step}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")  # steps 0, 1, 2
    run_training(load_config(None, tiny_run + common + [f"trainer.default_local_dir={run_dir}"]))
    ref = {r["step"]: r for r in read_metrics_jsonl(ref_dir / "metrics.jsonl")}
    got = {r["step"]: r for r in read_metrics_jsonl(run_dir / "metrics.jsonl")}
    assert ref[3]["actor/lr"] < ref[1]["actor/lr"], "the schedule must actually decay in this run"
    for step in (3, 4):
        assert {k: got[step][k] for k in KEYS} == {k: ref[step][k] for k in KEYS}
