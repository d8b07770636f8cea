"""`conveyor export`: a run's sharded checkpoint becomes a Hugging Face checkpoint with the trainer's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conveyor.cli import main
from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.trainer.checkpoint import load_checkpoint
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.run import run_training
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.ranks.actor import PolicyWorker
from conveyor.workers.ranks.settings import actor_settings

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Rewards that differ within a group, so the untrained model's updates move its weights.
    return float(sum(map(ord, solution_str)) % 5)
"""


def test_export_gives_the_trainers_logits(tiny_run, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = load_config(
        None,
        tiny_run
        + [
            "trainer.save_freq=1",
            "trainer.max_ckpt_to_keep=null",
            f"reward.custom_reward_function.path={tmp_path / 'reward.py'}",
        ],
    )
    run_training(cfg)
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path), "--step", "1", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith(str(out))
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    exported = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)

    # The trainer's policy at step 1: a worker restored from that checkpoint.
    worker = PolicyWorker(
        actor_settings(cfg, build_run_plan(cfg, "cpu")),
        model_path=prepare_default_model(cfg),
        data_plane=make_data_plane("memory"),
    )
    parts = load_checkpoint(tmp_path / "checkpoints" / "global_step_1")
    worker.load_checkpoint(str(parts["actor"]), parts["trainer_state"]["roles"]["actor"])
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    with torch.no_grad():
        want = worker.model(input_ids=ids).logits
        got = exported(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Training moved the weights, and step 2 moved them further: the comparison above is not vacuous.
    later = tmp_path / "exported-2"
    assert main(["export", str(tmp_path), "--out", str(later)]) == 0
    with torch.no_grad():
        initial = AutoModelForCausalLM.from_pretrained(prepare_default_model(cfg))(input_ids=ids).logits
        assert (got - initial).abs().max() > 1e-4
        assert (AutoModelForCausalLM.from_pretrained(later)(input_ids=ids).logits - got).abs().max() > 1e-4


def test_export_errors_say_what_to_change(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "run").mkdir()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x")]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
