"""`conveyor export` of a run with loss-free balancing: the model without the selection bias, the bias beside it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conveyor.cli import main
from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.models.moe_routing import moe_layers
from conveyor.models.router_control import BIAS_NAME, selection_biases
from conveyor.trainer.checkpoint import load_checkpoint
from conveyor.trainer.export import SELECTION_BIAS_FILE
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.run import run_training
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.ranks.actor import PolicyWorker
from conveyor.workers.ranks.settings import actor_settings


def test_export_drops_the_bias_says_why_and_keeps_it_beside(tiny_run, tmp_path: Path, caplog) -> None:
    cfg = load_config(None, tiny_run + ["actor_rollout_ref.actor.router.bias_update_rate=0.01", "trainer.save_freq=2"])
    run_training(cfg)
    out = tmp_path / "exported"
    with caplog.at_level(logging.WARNING):
        assert main(["export", str(tmp_path), "--out", str(out)]) == 0
    assert any(
        "loss-free balancing bias" in r.getMessage() and SELECTION_BIAS_FILE in r.getMessage() for r in caplog.records
    )

    # The trainer's actor at the checkpoint, with its biases.
    worker = PolicyWorker(
        actor_settings(cfg, build_run_plan(cfg, "cpu")),
        model_path=prepare_default_model(cfg),
        data_plane=make_data_plane("memory"),
    )
    parts = load_checkpoint(tmp_path / "checkpoints" / "global_step_2")
    worker.load_checkpoint(str(parts["actor"]), parts["trainer_state"]["roles"]["actor"])
    biases = selection_biases(worker.model)
    assert float(biases.abs().max()) > 0  # two steps of updates moved them
    kept = load_file(str(out / SELECTION_BIAS_FILE))
    assert torch.equal(torch.stack([kept[f"model.layers.{i}.mlp.gate.{BIAS_NAME}"] for i in range(2)]), biases)

    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not any(BIAS_NAME in k for k in exported.state_dict())
    # The exported model is the trainer's with its biases at zero: same weights, routing by the logits alone.
    for layer in moe_layers(worker.model):
        getattr(layer.router, BIAS_NAME).zero_()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=ids).logits, worker.model(input_ids=ids).logits, atol=1e-5, rtol=0
        )


def test_export_without_the_bias_warns_nothing(tiny_run, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run_training(load_config(None, tiny_run + ["trainer.total_training_steps=1"]))
    with caplog.at_level(logging.WARNING):
        assert main(["export", str(tmp_path), "--out", str(tmp_path / "x")]) == 0
    assert not any("balancing bias" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "x" / SELECTION_BIAS_FILE).exists()
