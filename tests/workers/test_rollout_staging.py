"""A replica's staged weights (a sync received beside a generation) wait in host memory at the engine's dtype.

A whole model in the trainer's float32 on the replica's device, beside an engine that fills it, would not fit.
"""

from __future__ import annotations

import pytest
import torch
from test_strategies import BASE  # tests/workers on sys.path

from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.setup import prepare_default_model
from conveyor.weights import StagedWeights
from conveyor.workers.ranks.replica import ReplicaWorker
from conveyor.workers.ranks.settings import rollout_settings


@pytest.fixture(scope="module")
def replica() -> ReplicaWorker:
    cfg = load_config(None, BASE)
    return ReplicaWorker(
        rollout_settings(cfg, build_run_plan(cfg, "cpu")),
        model_path=prepare_default_model(cfg),
        data_plane=make_data_plane("memory"),
    )


def _new_weights(worker: ReplicaWorker) -> list[tuple[str, torch.Tensor]]:
    """The replica's own weights moved a little, as a sync would bring them (float32, the trainer's dtype)."""
    gen = torch.Generator().manual_seed(0)
    return [
        (name, (p.detach() + 0.01 * torch.randn(p.shape, generator=gen)).float())
        for name, p in worker.model.named_parameters()
    ]


@pytest.mark.parametrize("engine_dtype", [torch.float32, torch.bfloat16])
def test_staged_copies_are_host_copies_at_the_engine_dtype(replica: ReplicaWorker, monkeypatch, engine_dtype) -> None:
    # bfloat16: a vllm replica's (rollout.dtype, or bf16 on CUDA)
    monkeypatch.setattr(replica, "staged", StagedWeights(engine_dtype))
    sent = _new_weights(replica)
    replica.staged.stage(5, iter(sent))
    staged = replica.staged.newest_after(4)
    assert staged is not None and staged[0] == 5
    replica.staged.stage(5, iter(sent))  # newest_after removed it: stage it again for the load below
    assert [n for n, _ in staged[1]] == [n for n, _ in sent]
    for (_, got), (_, original) in zip(staged[1], sent):
        assert got.device.type == "cpu" and got.dtype == engine_dtype
        assert got.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()  # the buffer is reused
        torch.testing.assert_close(got, original.to(engine_dtype), rtol=0, atol=0)
    replica.load_staged_weights(5)
    own = dict(replica.model.named_parameters())
    for name, tensor in sent:
        torch.testing.assert_close(own[name], tensor.to(engine_dtype).to(own[name].dtype), rtol=0, atol=0)


def test_an_hf_replica_stages_at_its_models_dtype(replica: ReplicaWorker) -> None:
    # The hf replica serves its own model's parameters (float32 here), whatever rollout.dtype says.
    assert replica.staged.dtype == torch.float32
