"""A replica's staged weights (a sync received beside a generation) wait in host memory at the engine's dtype.

A whole model in the trainer's float32 on the replica's device, beside an engine that fills it, would not fit.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.rollout import RolloutWorker, _engine_dtype
from conveyor.workers.settings import rollout_settings
from test_strategies import BASE  # tests/workers on sys.path


@pytest.fixture(scope="module")
def replica() -> RolloutWorker:
    cfg = load_config(None, BASE)
    return RolloutWorker(rollout_settings(cfg, build_run_plan(cfg, "cpu")), model_path=prepare_default_model(cfg),
                         data_plane=make_data_plane("memory"))


def _new_weights(worker: RolloutWorker) -> list[tuple[str, torch.Tensor]]:
    """The replica's own weights moved a little, as a sync would bring them (float32, the trainer's dtype)."""
    gen = torch.Generator().manual_seed(0)
    return [(name, (p.detach() + 0.01 * torch.randn(p.shape, generator=gen)).float())
            for name, p in worker.model.named_parameters()]


@pytest.mark.parametrize("engine_dtype", [torch.float32, torch.bfloat16])
def test_staged_copies_are_host_copies_at_the_engine_dtype(replica: RolloutWorker, monkeypatch, engine_dtype) -> None:
    monkeypatch.setattr(replica, "_engine_dtype", engine_dtype)  # bfloat16: a vllm replica with rollout.dtype=bfloat16
    sent = _new_weights(replica)
    replica._stage(5, iter(sent))
    staged = replica._staged[5]
    assert [n for n, _ in staged] == [n for n, _ in sent]
    for (_, got), (_, original) in zip(staged, sent):
        assert got.device.type == "cpu" and got.dtype == engine_dtype
        assert got.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()  # the buffer is reused
        torch.testing.assert_close(got, original.to(engine_dtype), rtol=0, atol=0)
    replica.load_staged_weights(5)
    own = dict(replica.model.named_parameters())
    for name, tensor in sent:
        torch.testing.assert_close(own[name], tensor.to(engine_dtype).to(own[name].dtype), rtol=0, atol=0)


def test_the_engine_dtype_is_the_one_it_serves_in() -> None:
    assert _engine_dtype(True, "float32", "bfloat16") == torch.float32  # hf ignores rollout.dtype
    assert _engine_dtype(False, "float32", "bfloat16") == torch.bfloat16
    assert _engine_dtype(False, "float32", None) == torch.float32
