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


def test_weights_loaded_in_one_chunk_of_an_hf_replica_s_share_version_only_that_chunk_s_later_tokens() -> None:
    # The hf engine generates a share in chunks of rollout.max_num_seqs; a switch between two tokens of the second
    # chunk is at that chunk's count of sampled tokens, which says nothing of the other chunks' rows.
    from conveyor.workers.ranks.calls import GenerateCall

    cfg = load_config(None, [*BASE, "actor_rollout_ref.rollout.max_num_seqs=2"])
    plane = make_data_plane("memory")
    worker = ReplicaWorker(
        rollout_settings(cfg, build_run_plan(cfg, "cpu")), model_path=prepare_default_model(cfg), data_plane=plane
    )
    worker.engine.eos_token_id = 10**6  # no row stops early: every chunk takes 4 steps, 3 hook calls
    worker.version = 5
    new = _new_weights(worker)

    class Inbox:
        calls = 0

        def take(self):
            self.calls += 1
            return (6, new) if self.calls == 5 else None  # the second chunk, after its second token

    worker.take_weights_between_tokens(Inbox())
    keys = [f"k{i}" for i in range(6)]
    prompts = torch.randint(4, 40, (6, 3), generator=torch.Generator().manual_seed(0))
    meta = plane.kv_batch_put(keys, "p", {"prompts": prompts, "prompt_mask": torch.ones(6, 3, dtype=torch.bool)})
    call = GenerateCall(
        max_new_tokens=4,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        do_sample=True,
        seed=0,
        capture_routing=False,
        pad_to_max_new_tokens=False,
    )
    worker.generate_sequences(meta.with_extra_info(**call.to_extra_info()))
    got = plane.kv_batch_get(keys, "p", ["token_policy_version", "policy_version"])
    assert got["token_policy_version"].tolist() == [[5] * 4] * 2 + [[5, 5, 6, 6]] * 2 + [[6] * 4] * 2
    assert got["policy_version"].tolist() == [5] * 6 and worker.version == 6
