"""Expert parallelism on two gloo ranks (fsdp2, expert_parallel_size=2) against the one-rank run.

(The spawn also runs the other dimension of the role's mesh, HSDP's `dp_replicate`, at the end.)

The tiny Qwen3-MoE has 8 experts per layer: under EP=2 each rank holds 4 of them whole, with their AdamW
state, and tokens reach them by all-to-all. One spawn of two ranks (`strategy_ranks.py`) runs every case;
the one-rank references run in this process on the same batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_strategies import (  # noqa: E501
    BASE,
    R3,
    RANKS_SCRIPT,
    UPDATE,
    B,
    _actor,
    _assert_native_routing_differs,
    _assert_same_params,
    _batch,
    _metrics,
    _one_rank,
    _update_grads,
)

from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.metrics.moe_load_balance import count_expert_assignments, load_balance_metrics_from_counts
from conveyor.protocol import KVBatchMeta
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.ranks.calls import GenerateCall
from conveyor.workers.training.shards import load_model_weights

EP2 = [
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2",
    "trainer.num_cpu_workers=2",
]
FSDP2 = ["actor_rollout_ref.actor.strategy=fsdp2"]
# HSDP in groups of one: each rank a replica (the `fsdp` dimension of size 1, `dp_replicate` of 2).
HSDP = FSDP2 + ["actor_rollout_ref.actor.fsdp_config.fsdp_size=1", "trainer.num_cpu_workers=2"]
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# Delta weight sync on: at BASE's lr 1e-4 Adam's step changes ~85% of the bf16 elements of this tiny model (bitmaps
# at ~0.9 of the whole bytes); at 1e-6 ~4% change, as at a real model's learning rate, so indices and bitmaps travel.
DELTA = ["actor_rollout_ref.rollout.delta_sync.enable=true", "actor_rollout_ref.actor.optim.lr=1e-6"]


@pytest.fixture(scope="module")
def model_path() -> str:
    return prepare_default_model(load_config(None, BASE))


@pytest.fixture(scope="module")
def batches(model_path: str) -> dict[bool, dict[str, torch.Tensor]]:
    return {False: _batch(model_path), True: _batch(model_path, with_routing=True)}


@pytest.fixture(scope="module")
def one_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory, model_path: str, batches) -> dict:
    """A one-rank actor's checkpoint after one update: folder, schedule state, weights and initial weights."""
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put([f"s{i}" for i in range(B)], "p", batches[False]).with_extra_info(**UPDATE)
    worker = _actor(load_config(None, BASE), model_path=model_path, data_plane=plane)
    initial = {k: v.clone() for k, v in worker.model_state_dict().items()}
    worker.update_actor(meta)
    folder = tmp_path_factory.mktemp("one-rank-ckpt")
    extra = worker.save_checkpoint(str(folder))
    return {"dir": folder, "extra": extra, "params": worker.model_state_dict(), "initial": initial}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, model_path: str, batches, one_rank_checkpoint) -> dict[str, Path]:
    """Every case's two-rank run, from one spawn; case name -> its output folder."""
    root = tmp_path_factory.mktemp("ep-ranks")
    runs = {  # name -> overrides, with routing, jobs
        "ep": (EP2, False, ["logits", "log_prob", "update", "layout", f"save:{root / 'ep-ckpt'}"]),
        "ep-R3": (EP2 + [R3], True, ["grads"]),
        "ep-gen": (EP2, False, ["generate", "iter_weights"]),
        "ep-delta": (EP2 + DELTA, False, ["delta_sync"]),
        "ep-load-one": (EP2, False, [f"load:{one_rank_checkpoint['dir']}"]),
        "fsdp2-save": (FSDP2, False, ["update", f"save:{root / 'fsdp2-ckpt'}"]),
        "fsdp2-load-ep": (FSDP2, False, [f"load:{root / 'ep-ckpt'}"]),
        "ep-load-fsdp2": (EP2, False, [f"load:{root / 'fsdp2-ckpt'}"]),
        "hsdp": (HSDP, False, ["update", "layout", f"save:{root / 'hsdp-ckpt'}"]),
    }
    for with_routing, fields in batches.items():
        torch.save(fields, root / f"batch-{int(with_routing)}.pt")
    spec_runs = []
    for name, (overrides, with_routing, jobs) in runs.items():
        (root / name).mkdir()
        spec_runs.append(
            {
                "role": "actor",
                "overrides": BASE + overrides,
                "jobs": jobs,
                "out": str(root / name),
                "batch": str(root / f"batch-{int(with_routing)}.pt"),
            }
        )
    torch.save(one_rank_checkpoint["extra"], root / "ep-load-one" / "extra.pt")
    (root / "spec.json").write_text(json.dumps({"world": 2, "model_path": model_path, "runs": spec_runs}))
    done = subprocess.run(
        [sys.executable, str(RANKS_SCRIPT), str(root / "spec.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {name: root / name for name in runs} | {"root": root}


def test_each_rank_holds_half_the_experts_whole_with_their_optimizer_state(ranks) -> None:
    for rank in range(2):
        layout = torch.load(ranks["ep"] / f"layout_{rank}.pt", weights_only=False)
        experts = {k: v for k, v in layout.items() if k.endswith(EXPERT_PARAMS)}
        assert len(experts) == 4  # 2 layers x (gate_up_proj, down_proj)
        for name, entry in experts.items():
            # 4 of the 8 experts, each whole (the other dimensions are the full expert's), on the ep dimension.
            assert entry["dims"] == ("efsdp", "ep"), name
            assert entry["placements"][1] == "S(0)", name  # split on the expert dimension over `ep`
            tiny = load_config(None, BASE).actor_rollout_ref.model.tiny
            width, hidden = tiny.intermediate_size // 2, tiny.hidden_size  # an expert: half the dense MLP width
            whole = (2 * width, hidden) if name.endswith("gate_up_proj") else (hidden, width)
            assert entry["shape"] == (4, *whole) and entry["moment_shape"] == entry["shape"], name
        dense = {k: v for k, v in layout.items() if k not in experts}
        assert all(v["dims"] == ("fsdp",) for v in dense.values())


def test_forward_logits_and_log_probs_equal_one_rank(model_path: str, batches, ranks) -> None:
    fields = batches[False]
    worker = _actor(load_config(None, BASE), model_path=model_path, data_plane=make_data_plane("memory"))
    with torch.no_grad():
        want = worker.model(input_ids=fields["prompts"].long()).logits
    got = torch.cat([torch.load(ranks["ep"] / f"logits_{r}.pt", weights_only=True) for r in range(2)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    lps = torch.cat([torch.load(ranks["ep"] / f"log_probs_{r}.pt", weights_only=True) for r in range(2)])
    torch.testing.assert_close(lps, fields["old_log_probs"], atol=1e-5, rtol=0)


def test_one_update_equals_one_rank_with_the_whole_model_grad_norm(
    model_path: str, batches, ranks, one_rank_checkpoint
) -> None:
    want, one = _one_rank("actor", model_path, batches[False], [])
    _assert_same_params(torch.load(ranks["ep"] / "params.pt", weights_only=True), want, one_rank_checkpoint["initial"])
    metrics = _metrics(ranks["ep"])
    # The norm clipping uses is the whole model's (dense shards and both ranks' experts), on every rank.
    for m in metrics:
        assert m["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-5)
    assert sum(m["actor/pg_loss@sum"] for m in metrics) == pytest.approx(one["actor/pg_loss@sum"], rel=1e-5, abs=1e-7)
    # The experts' parameters and AdamW moments: half of the whole model's per rank, and half of what one layer's
    # forward gathers under fsdp2 alone (every expert of the layer).
    for m in metrics:
        for key in (
            "perf/expert_param_bytes_local",
            "perf/expert_optim_bytes_local",
            "perf/expert_param_bytes_gathered",
        ):
            # AdamW's step counters (8 bytes a parameter) are not split: the rest is exactly half.
            assert one[key] > 0 and abs(m[key] * 2 - one[key]) <= (32 if "optim" in key else 0), key
        # The tokens each rank's experts received per layer, max over mean across the two ranks: at least 1.
        assert m["moe/ep_tokens_received_max_over_mean"] >= 1.0
        assert m["perf/ep_tokens_received_local"] > 0
    assert metrics[0]["moe/ep_tokens_received_max_over_mean"] == metrics[1]["moe/ep_tokens_received_max_over_mean"]


def test_r3_replay_under_ep_gives_the_one_rank_gradients(model_path: str, batches, ranks) -> None:
    _assert_native_routing_differs(model_path, batches[True])  # replay changes the gradients: not vacuous
    want = _update_grads(load_config(None, BASE + [R3]), model_path, batches[True])
    got = torch.load(ranks["ep-R3"] / "grads.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


def test_routing_capture_and_load_balance_under_ep_equal_one_rank(model_path: str, batches, ranks) -> None:
    """Greedy generation under EP (decoding in step over the shards) records the experts one rank records."""
    fields = batches[False]
    plane = make_data_plane("memory")
    keys = [f"s{i}" for i in range(B)]
    plane.kv_batch_put(keys, "gen", {k: fields[k] for k in ("prompts", "prompt_mask")})
    worker = _actor(load_config(None, BASE), model_path=model_path, data_plane=plane)
    call = GenerateCall(
        max_new_tokens=6,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        do_sample=False,
        seed=0,
        capture_routing=True,
        pad_to_max_new_tokens=False,
    )
    worker.generate_sequences(KVBatchMeta(keys, "gen", [], [{} for _ in keys], call.to_extra_info()))
    want = plane.kv_batch_get(keys, "gen", ["responses", "response_mask", "routed_experts"])
    gens = [torch.load(ranks["ep-gen"] / f"gen_{r}.pt", weights_only=True) for r in range(2)]
    n0 = len(gens[0]["responses"])
    for rank, (got, rows) in enumerate(zip(gens, (slice(0, n0), slice(n0, B)))):
        width = int(got["response_mask"].sum(-1).max())
        assert width > 0
        assert torch.equal(got["responses"][:, :width], want["responses"][rows, :width]), rank
        re_w = want["routed_experts"][rows]
        assert torch.equal(got["routed_experts"][:, : re_w.shape[1]], re_w[:, : got["routed_experts"].shape[1]]), rank
        assert (got["routed_experts"] >= 0).any()
    ep_counts = count_expert_assignments(
        torch.cat([g["routed_experts"] for g in gens]).long(), torch.cat([g["response_mask"] for g in gens]), 8
    )
    one_counts = count_expert_assignments(want["routed_experts"].long(), want["response_mask"], 8)
    assert torch.equal(ep_counts, one_counts)
    ep_metrics = load_balance_metrics_from_counts(ep_counts)
    assert ep_metrics == load_balance_metrics_from_counts(one_counts) and ep_metrics


def test_weight_sync_streams_whole_experts_under_ep(model_path: str, ranks) -> None:
    """The vllm weight sync's `iter_weights` gathers each split expert tensor whole (one DTensor gather each)."""
    worker = _actor(load_config(None, BASE), model_path=model_path, data_plane=make_data_plane("memory"))
    streamed = torch.load(ranks["ep-gen"] / "streamed.pt", weights_only=True)
    want = worker.model.state_dict()
    assert streamed.keys() == want.keys()
    for k in want:
        assert torch.equal(streamed[k], want[k]), k
    assert streamed["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8


def test_delta_weight_sync_under_ep_is_bitwise_and_sends_less_than_whole(ranks) -> None:
    """The shipper's in-process chain (weight_stream -> bf16 -> encode -> decode) over EP=2's gathered experts: the
    receiver's copy equals the trainer's bf16 weights after every sync, and after an update only what changed went."""
    syncs = torch.load(ranks["ep-delta"] / "delta.pt", weights_only=True)
    assert len(syncs) == 3
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    for i, sync in enumerate(syncs):
        decoded, trainer = sync["decoded"], sync["trainer"]
        assert decoded.keys() == trainer.keys() and experts in trainer, i
        for k in trainer:
            assert decoded[k].dtype == trainer[k].dtype and torch.equal(decoded[k], trainer[k]), (i, k)
        assert trainer[experts].dtype == torch.bfloat16 and trainer[experts].shape[0] == 8  # whole, not a shard
        assert sync["mismatches"] == 0, i
    first = syncs[0]
    assert first["forced"] == "first" and first["full"] and first["changed_frac"] == 1.0
    assert first["bytes"] >= first["full_bytes"]
    for i, sync in enumerate(syncs[1:], 1):
        # An update moved the weights (the experts' included), and the sync went as a delta, not whole.
        before, after = syncs[i - 1]["trainer"], sync["trainer"]
        assert not torch.equal(before[experts], after[experts]), i
        assert sync["forced"] == "" and not sync["full"], i
        assert 0 < sync["changed_frac"] < 0.1, (i, sync["changed_frac"])
        assert sync["bytes"] < 0.25 * sync["full_bytes"], (i, sync["bytes"], sync["full_bytes"])


def test_checkpoints_move_between_ep_and_plain_bitwise(model_path: str, ranks, one_rank_checkpoint) -> None:
    trained = torch.load(ranks["ep"] / "params.pt", weights_only=True)
    ckpt = ranks["root"] / "ep-ckpt"
    extra = torch.load(ranks["ep"] / "extra.pt", weights_only=True)
    cfg = load_config(None, BASE)
    # EP=2 shards into one plain rank, with the optimizer state; and the weights alone (what export reads).
    one = _actor(cfg, model_path=model_path, data_plane=make_data_plane("memory"))
    one.load_checkpoint(str(ckpt), extra)
    _assert_same_params(one.model_state_dict(), trained, atol=0)
    assert one.trained.optimizer.state
    bare = _actor(cfg, model_path=model_path, data_plane=make_data_plane("memory")).model
    load_model_weights(ckpt, bare)
    _assert_same_params(dict(bare.state_dict()), trained, atol=0)
    # EP=2 into two plain fsdp2 ranks, one rank into EP=2, and two fsdp2 ranks into EP=2.
    _assert_same_params(torch.load(ranks["fsdp2-load-ep"] / "loaded.pt", weights_only=True), trained, atol=0)
    _assert_same_params(
        torch.load(ranks["ep-load-one"] / "loaded.pt", weights_only=True),
        one_rank_checkpoint["params"],
        one_rank_checkpoint["initial"],
        atol=0,
    )
    fsdp2_trained = torch.load(ranks["fsdp2-save"] / "params.pt", weights_only=True)
    _assert_same_params(torch.load(ranks["ep-load-fsdp2"] / "loaded.pt", weights_only=True), fsdp2_trained, atol=0)


def test_hsdp_replicates_over_dp_replicate_and_takes_the_one_rank_step(
    model_path: str, batches, ranks, one_rank_checkpoint
) -> None:
    want, one = _one_rank("actor", model_path, batches[False], [])
    out = ranks["hsdp"]
    _assert_same_params(torch.load(out / "params.pt", weights_only=True), want, one_rank_checkpoint["initial"])
    for rank, m in enumerate(_metrics(out)):
        assert m["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-5)
        # Shards of one rank: every rank holds the whole model, as a replica.
        assert m["perf/param_bytes_local"] == one["perf/param_bytes_local"]
        layout = torch.load(out / f"layout_{rank}.pt", weights_only=False)
        assert {v["dims"] for v in layout.values()} == {("dp_replicate", "fsdp")}
    # Its checkpoint (replicas written once) loads into one plain rank bitwise.
    worker = _actor(load_config(None, BASE), model_path=model_path, data_plane=make_data_plane("memory"))
    worker.load_checkpoint(str(ranks["root"] / "hsdp-ckpt"), torch.load(out / "extra.pt", weights_only=True))
    _assert_same_params(worker.model_state_dict(), torch.load(out / "params.pt", weights_only=True), atol=0)


def test_four_ranks_with_experts_also_fsdp_sharded_take_the_one_rank_step(tmp_path) -> None:
    """ep=2 over 4 ranks: efsdp=2 shards each rank's experts again (the sum-then-divide reduction on gloo and the
    strided expert shards in the clipping norm), against one rank's forward, gradients, clipped norm and step."""
    import ep_ranks  # tests/workers on sys.path

    done = subprocess.run(
        [sys.executable, str(Path(ep_ranks.__file__)), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = torch.load(tmp_path / "four_ranks.pt", weights_only=True)
    assert got["expert_mesh"] == ("efsdp", "ep") and got["expert_local_shape"][0] == 2  # 8 experts / (2 x 2)
    model = ep_ranks.build_model()
    logits = model(input_ids=ep_ranks.batch()).logits
    ep_ranks.loss_of(logits).backward()
    torch.testing.assert_close(got["logits"], logits.detach(), atol=1e-5, rtol=0)
    for k, p in model.named_parameters():
        torch.testing.assert_close(got["grads"][k], p.grad, atol=1e-6, rtol=0, msg=lambda m: f"{k}: {m}")
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    assert norm > 0.05 and got["norm"] == pytest.approx(norm, rel=1e-5)  # clipping was active
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    for k, p in model.named_parameters():
        torch.testing.assert_close(got["params"][k], p.detach(), atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2"], "must divide the 1 ranks"),
        (
            ["actor_rollout_ref.actor.fsdp_config.expert_parallel_size=3", "trainer.num_cpu_workers=3"],
            "must divide actor_rollout_ref.model.tiny.num_experts=8",
        ),
        (EP2[1:] + ["actor_rollout_ref.actor.strategy=dp"], "set actor_rollout_ref.actor.strategy=fsdp2"),
        (EP2 + ["actor_rollout_ref.model.tiny.arch=qwen3"], "needs a Mixture-of-Experts model"),
        (HSDP + ["actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2"], "HSDP .* is not supported yet"),
        (["actor_rollout_ref.actor.fsdp_config.fsdp_size=3", "trainer.num_cpu_workers=2"], "must divide the 2 ranks"),
    ],
)
def test_expert_parallel_size_errors_say_what_to_change(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_a_dense_model_or_uneven_experts_are_refused_at_wrap() -> None:
    """A real checkpoint's experts are known only when it loads: the strategy checks them there."""
    from transformers import AutoModelForCausalLM

    from conveyor.models.tiny import tiny_config
    from conveyor.workers.training.expert_parallel import check_expert_parallel

    dense = AutoModelForCausalLM.from_config(tiny_config("qwen3", vocab_size=32))
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        check_expert_parallel(dense, 2, 2)
    moe = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", vocab_size=32, num_experts=6))
    with pytest.raises(ValueError, match="must divide the 6 experts"):
        check_expert_parallel(moe, 4, 4)
    assert len(check_expert_parallel(moe, 2, 4)) == 2
