"""Training strategies against the one-rank reference: FSDP2 and DDP over two gloo ranks take the same step.

The multi-rank cases of every test run in one subprocess (`strategy_ranks.py`,
the `ranks` fixture) that spawns the ranks once: a spawn costs ~15 s here,
nearly all of it importing torch, transformers and conveyor in three
processes, against ~1 s for a case. Each test checks its own case's outputs;
the one-rank reference runs in this process on the same batch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from update_batches import ragged_update_fields

from conveyor.algos.trajectory import span_lengths
from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.ranks.actor import PolicyWorker
from conveyor.workers.ranks.calls import LogProbCall, UpdateCall
from conveyor.workers.ranks.critic import CriticWorker
from conveyor.workers.ranks.settings import actor_settings, critic_settings
from conveyor.workers.training.shards import load_model_weights
from conveyor.workers.training.strategy import TrainingStrategy, resolve_strategy

RANKS_SCRIPT = Path(__file__).with_name("strategy_ranks.py")
B, P, R = 7, 5, 4  # 7 rows: the ranks get 4 and 3, so with micro-batches of 3 they run 2 and 1 passes
BASE = [
    "data.synthetic.num_train=64",
    "data.synthetic.num_val=8",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
    "actor_rollout_ref.model.forward_impl=hf",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
    "critic.ppo_micro_batch_size_per_gpu=3",
    # Adam's first step moves each weight by about lr whatever its gradient: at lr 1e-4 summation-order noise
    # stays far below the tolerance while a correct update moves weights by ~1e-4.
    "actor_rollout_ref.actor.optim.lr=0.0001",
    "critic.optim.lr=0.0001",
    "actor_rollout_ref.actor.optim.lr_scheduler=constant",
    "critic.optim.lr_scheduler=constant",
]


R3 = "actor_rollout_ref.actor.router_replay.mode=R3"
FSDP2_CASES = {"actor": ("actor", []), "actor-R3": ("actor", [R3]), "critic": ("critic", [])}
LEAN_FLAGS = [
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.model.forward_impl=lean",
    "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
]
MIXED_FLAGS = [
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16",
    "actor_rollout_ref.actor.fsdp_config.reduce_dtype=float32",
]
FSDP2 = ["actor_rollout_ref.actor.strategy=fsdp2"]
DENSE = ["actor_rollout_ref.model.tiny.arch=qwen3"]
CKPT = "actor_rollout_ref.model.enable_gradient_checkpointing=true"
FUSED = "actor_rollout_ref.model.use_fused_kernels=true"
PADDED = "actor_rollout_ref.model.use_remove_padding=false"
LP_MICRO = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3"  # ranks of 4 and 3 rows: 2 and 1 passes
# Token budgets (rows of 6 to 9 tokens): the actor's 16 packs 1 or 2 rows a pass (5 passes on one rank); the
# critic's 9 one row a pass (4 and 3 on two ranks: the second pairs with a dropped repeat).
DYN = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16"]
CRITIC_DYN = ["critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=9"]
# The no-grad forwards over the shards against the gathered model: name -> role, overrides, dense, with routing.
NO_GRAD_CASES = {
    "actor-dense": ("actor", FSDP2 + [LP_MICRO], True, False),
    "actor-moe-R3": ("actor", FSDP2 + [LP_MICRO, R3], False, True),
    "critic-dense": ("critic", ["critic.strategy=fsdp2", "critic.optim.lr=0.05"], True, False),
    "critic-moe": ("critic", ["critic.strategy=fsdp2", "critic.optim.lr=0.05"], False, False),
}


@pytest.fixture(scope="module")
def model_path() -> str:
    return prepare_default_model(load_config(None, BASE))


@pytest.fixture(scope="module")
def dense_path() -> str:
    return prepare_default_model(load_config(None, BASE + DENSE))


@pytest.fixture(scope="module")
def batches(model_path: str) -> dict[bool, dict[str, torch.Tensor]]:
    """The update batch without (False) and with (True) recorded routing."""
    return {False: _batch(model_path), True: _batch(model_path, with_routing=True)}


# The calls the trainer makes, with the parameters these tests use.
UPDATE = UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info()
LOG_PROB = LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info()


def _actor(cfg, **kwargs) -> PolicyWorker:
    return PolicyWorker(actor_settings(cfg, build_run_plan(cfg, "cpu")), **kwargs)


def _critic(cfg, **kwargs) -> CriticWorker:
    return CriticWorker(critic_settings(cfg, build_run_plan(cfg, "cpu")), **kwargs)


@pytest.fixture(scope="module")
def one_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory, model_path: str, batches) -> dict:
    """A one-rank actor's checkpoint after one update: its folder, schedule state, weights and initial weights."""
    cfg = load_config(None, BASE)
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put([f"s{i}" for i in range(B)], "p", batches[False]).with_extra_info(**UPDATE)
    worker = _actor(cfg, model_path=model_path, data_plane=plane)
    initial = {k: v.clone() for k, v in worker.model_state_dict().items()}
    worker.update_actor(meta)
    folder = tmp_path_factory.mktemp("one-rank-checkpoint")
    extra = worker.save_checkpoint(str(folder))
    return {"dir": folder, "extra": extra, "params": worker.model_state_dict(), "initial": initial}


@pytest.fixture(scope="module")
def ranks(
    tmp_path_factory: pytest.TempPathFactory, model_path: str, dense_path: str, batches, one_rank_checkpoint
) -> dict[str, Path]:
    """Every test's multi-rank case, run by one spawn of two ranks; case name -> the folder of its outputs."""
    root = tmp_path_factory.mktemp("ranks")
    runs: dict[str, tuple[str, list[str], bool, list[str]]] = {}  # name -> role, overrides, with routing, jobs
    paths: dict[str, str] = {}  # name -> model path, where not the default MoE model
    for name, (role, overrides) in FSDP2_CASES.items():
        strategy = "critic.strategy=fsdp2" if role == "critic" else "actor_rollout_ref.actor.strategy=fsdp2"
        runs[f"fsdp2-{name}"] = (role, overrides + [strategy], R3 in overrides, ["update"])
    runs["dp"] = ("actor", ["actor_rollout_ref.actor.strategy=dp"], False, ["update"])
    runs["lean"] = ("actor", LEAN_FLAGS, False, ["log_prob", "update"])
    runs["mixed"] = ("actor", MIXED_FLAGS, False, ["update"])
    runs["save"] = ("actor", FSDP2, False, ["update", f"save:{root / 'two-ranks'}"])
    runs["load"] = ("actor", FSDP2, False, [f"load:{one_rank_checkpoint['dir']}"])
    runs["fsdp2-defer"] = (
        "actor",
        FSDP2 + ["actor_rollout_ref.actor.fsdp_config.defer_grad_sync=true"],
        False,
        ["update"],
    )
    runs["dp-defer"] = (
        "actor",
        ["actor_rollout_ref.actor.strategy=dp", "actor_rollout_ref.actor.fsdp_config.defer_grad_sync=true"],
        False,
        ["update"],
    )
    runs["gen-shards"] = ("actor", FSDP2 + ["actor_rollout_ref.rollout.hf_whole_gather_max_gb=0"], False, ["generate"])
    runs["gen-whole"] = ("actor", FSDP2, False, ["generate"])
    # Chunks of 3: the ranks' 4 and 3 rows make 2 chunks and 1 (which the second rank pairs with a dropped repeat).
    runs["gen-shards-chunks"] = (
        "actor",
        FSDP2 + ["actor_rollout_ref.rollout.hf_whole_gather_max_gb=0", "actor_rollout_ref.rollout.max_num_seqs=3"],
        False,
        ["generate"],
    )
    runs["fsdp2-dynbsz"] = ("actor", FSDP2 + DYN, False, ["log_prob", "grads"])
    runs["fsdp2-critic-dynbsz"] = ("critic", ["critic.strategy=fsdp2"] + CRITIC_DYN, False, ["update"])
    runs["router"] = ("actor", FSDP2, True, ["router"])
    runs["fsdp2-fused-R3-ckpt"] = ("actor", FSDP2 + [FUSED, R3, CKPT], True, ["update"])
    runs["grads-R3"] = ("actor", FSDP2 + [R3], True, ["grads"])
    runs["grads-R3-ckpt"] = ("actor", FSDP2 + [R3, CKPT], True, ["grads"])
    for name, (role, overrides, dense, with_routing) in NO_GRAD_CASES.items():
        # The value head starts at zero: an update at a large lr first, so that the values say something.
        jobs = ["update", "no_grad_both"] if role == "critic" else ["no_grad_both"]
        runs[f"no-grad-{name}"] = (role, overrides + (DENSE if dense else []), with_routing, jobs)
        if dense:
            paths[f"no-grad-{name}"] = dense_path
    for with_routing, fields in batches.items():
        torch.save(fields, root / f"batch-{int(with_routing)}.pt")
    spec_runs = []
    for name, (role, overrides, with_routing, jobs) in runs.items():
        (root / name).mkdir()
        spec_runs.append(
            {
                "role": role,
                "overrides": BASE + overrides,
                "jobs": jobs,
                "out": str(root / name),
                "batch": str(root / f"batch-{int(with_routing)}.pt"),
            }
        )
        if name in paths:
            spec_runs[-1]["model_path"] = paths[name]
    torch.save(one_rank_checkpoint["extra"], root / "load" / "extra.pt")
    spec = {"world": 2, "model_path": model_path, "runs": spec_runs}
    (root / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, str(RANKS_SCRIPT), str(root / "spec.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {name: root / name for name in runs}


def _batch(model_path: str, with_routing: bool = False) -> dict[str, torch.Tensor]:
    """Ragged prompts and responses, advantages, values/returns, old log-probs from the initial policy."""
    gen = torch.Generator().manual_seed(0)
    fields = ragged_update_fields(B, P, R, 40, gen)
    fields["values"] = torch.randn(B, R, generator=gen) * fields["response_mask"]
    fields["returns"] = torch.randn(B, R, generator=gen) * fields["response_mask"]
    cfg = load_config(None, BASE)
    if with_routing:
        tiny = cfg.actor_rollout_ref.model.tiny
        scores = torch.rand(B, P + R, tiny.num_layers, tiny.num_experts, generator=gen)
        fields["routed_experts"] = scores.argsort(-1)[..., : tiny.top_k].to(torch.int8)
    plane = make_data_plane("memory")
    keys = [f"s{i}" for i in range(B)]
    meta = plane.kv_batch_put(keys, "p", fields)
    worker = _actor(cfg, model_path=model_path, data_plane=plane)
    worker.compute_log_prob(meta.with_extra_info(**LOG_PROB))
    fields["old_log_probs"] = plane.kv_batch_get(keys, "p", ["old_log_probs"])["old_log_probs"]
    return fields


def _one_rank(role: str, model_path: str, fields: dict, overrides: list[str]) -> tuple[dict, dict]:
    """(parameters after one update, metrics) of the in-process one-rank worker."""
    cfg = load_config(None, BASE + overrides)
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put([f"s{i}" for i in range(B)], "p", fields).with_extra_info(**UPDATE)
    if role == "critic":
        worker = _critic(cfg, model_path=model_path, data_plane=plane)
        out = worker.update_critic(meta)
    else:
        worker = _actor(cfg, model_path=model_path, data_plane=plane)
        out = worker.update_actor(meta)
    return worker.model_state_dict(), dict(out.extra_info)


def _assert_same_params(got: dict, want: dict, initial: dict | None = None, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=0, msg=lambda m: f"{k}: {m}")
    if initial is not None:
        moved = max(float((want[k] - initial[k]).abs().max()) for k in want)
        assert moved > 5e-5, "the update barely moved the weights: the comparison would be vacuous"


def _metrics(out: Path, world: int = 2) -> list[dict]:
    return [json.loads((out / f"metrics_{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("case", list(FSDP2_CASES))
def test_fsdp2_two_ranks_take_the_one_rank_step(model_path: str, batches, ranks, case: str) -> None:
    """Two ranks' packed forwards (the default) take the one-rank step of padded forwards."""
    role, overrides = FSDP2_CASES[case]
    fields = batches[R3 in overrides]
    want, one_metrics = _one_rank(role, model_path, fields, overrides + [PADDED])
    initial_cfg = load_config(None, BASE)
    plane = make_data_plane("memory")
    fresh = (_critic if role == "critic" else _actor)(initial_cfg, model_path=model_path, data_plane=plane)
    out = ranks[f"fsdp2-{case}"]
    _assert_same_params(torch.load(out / "params.pt", weights_only=True), want, fresh.model_state_dict())
    ranks_metrics = _metrics(out)
    prefix = "critic/" if role == "critic" else "actor/"
    loss = "vf_loss@sum" if role == "critic" else "pg_loss@sum"
    assert sum(m[prefix + loss] for m in ranks_metrics) == pytest.approx(one_metrics[prefix + loss], rel=1e-5, abs=1e-7)
    assert ranks_metrics[0][prefix + "grad_norm"] == pytest.approx(one_metrics[prefix + "grad_norm"], rel=1e-5)
    # Each rank holds about half of the parameters, gradients and optimizer state.
    for key in ("perf/param_bytes_local", "perf/grad_bytes_local", "perf/optim_bytes_local"):
        for m in ranks_metrics:
            assert 0.4 <= m[key] / one_metrics[key] <= 0.6, (key, m[key], one_metrics[key])


def test_fused_log_prob_under_fsdp2_takes_the_logits_step(model_path: str, batches, ranks) -> None:
    """The fused LM head inside two fsdp2 ranks' packed, checkpointed, R3-replayed forward (its weight gathered by
    the root unit, its gradient reduce-scattered) takes the one-rank step of the padded logits path."""
    want, _ = _one_rank("actor", model_path, batches[True], [R3, PADDED])
    _assert_same_params(torch.load(ranks["fsdp2-fused-R3-ckpt"] / "params.pt", weights_only=True), want)


def test_dp_two_ranks_take_the_one_rank_step(model_path: str, batches, ranks) -> None:
    want, one_metrics = _one_rank("actor", model_path, batches[False], [])
    out = ranks["dp"]
    _assert_same_params(torch.load(out / "params.pt", weights_only=True), want)
    for m in _metrics(out):
        assert m["perf/param_bytes_local"] == one_metrics["perf/param_bytes_local"]  # full replicas


def test_lean_forward_checkpointing_and_offload_under_fsdp2(model_path: str, batches, ranks) -> None:
    """Under fsdp2 with forward_impl=lean: the no-grad forwards run over the shards (not the lean forward) and
    match the one-rank Hugging Face forward; recomputed activations give the same step; offload is accepted on
    a CPU run and changes nothing."""
    fields = batches[False]  # old_log_probs: the one-rank Hugging Face forward
    want, _ = _one_rank("actor", model_path, fields, [])
    out = ranks["lean"]  # LEAN_FLAGS, jobs log_prob then update
    got = torch.cat([torch.load(out / f"log_probs_{r}.pt", weights_only=True) for r in range(2)])
    torch.testing.assert_close(got, fields["old_log_probs"], atol=1e-5, rtol=0)
    _assert_same_params(torch.load(out / "params.pt", weights_only=True), want)
    cfg = load_config(None, BASE + ["actor_rollout_ref.model.enable_gradient_checkpointing=true"])
    worker = _actor(cfg, model_path=model_path, data_plane=make_data_plane("memory"))
    assert worker.model.is_activation_checkpointing


def test_offload_on_cpu_is_accepted_and_says_it_does_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conveyor")
    strategy = TrainingStrategy(
        "fsdp2", world_size=2, device=torch.device("cpu"), param_offload=True, optimizer_offload=True
    )
    assert not strategy.param_offload and not strategy.optimizer_offload
    assert any("no effect on a CPU run" in r.getMessage() for r in caplog.records)


def test_mixed_precision_under_fsdp2(model_path: str, batches, ranks) -> None:
    """bf16 compute with fp32 reduction: a different but close step, and fp32 master weights."""
    want, _ = _one_rank("actor", model_path, batches[False], [])
    got = torch.load(ranks["mixed"] / "params.pt", weights_only=True)  # MIXED_FLAGS
    assert all(v.dtype == torch.float32 for v in got.values())
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert 0 < diff <= 3e-4, diff  # bf16 arithmetic shows, but one step at lr 1e-4 moves a weight by ~1e-4


def test_sharded_checkpoints_move_between_world_sizes(model_path: str, ranks, one_rank_checkpoint) -> None:
    out = ranks["save"]  # fsdp2: one update, then a sharded save
    two = out.parent / "two-ranks"
    trained = torch.load(out / "params.pt", weights_only=True)
    assert sorted(p.name for p in two.iterdir() if p.suffix == ".distcp") == ["__0_0.distcp", "__1_0.distcp"]
    # Two ranks' shards into one plain rank: the same weights (and the optimizer state loads with them).
    cfg = load_config(None, BASE)
    one = _actor(cfg, model_path=model_path, data_plane=make_data_plane("memory"))
    one.load_checkpoint(str(two), torch.load(out / "extra.pt", weights_only=True))
    _assert_same_params(one.model_state_dict(), trained, atol=0)
    assert one.trained.optimizer.state, "the optimizer state was not restored"
    # Only the weights, into a fresh model outside any worker (what `conveyor export` does).
    bare = _actor(cfg, model_path=model_path, data_plane=make_data_plane("memory")).model
    load_model_weights(two, bare)
    _assert_same_params({k: v for k, v in bare.state_dict().items()}, trained, atol=0)
    # One rank's checkpoint (after a one-rank update) into two fsdp2 ranks: its weights, not the initial ones.
    loaded = torch.load(ranks["load"] / "loaded.pt", weights_only=True)
    _assert_same_params(loaded, one_rank_checkpoint["params"], one_rank_checkpoint["initial"], atol=0)


def test_hf_rollout_over_the_shards_equals_the_gathered_model(ranks) -> None:
    """Decoding over the shards (a collective per layer and token, ranks stepping together), whole or in chunks of
    `rollout.max_num_seqs`, gives what the gathered model gives."""
    for rank in range(2):
        whole = torch.load(ranks["gen-whole"] / f"gen_{rank}.pt", weights_only=True)
        assert whole["response_mask"].any(), "nothing was generated: the comparison would be vacuous"
        for case in ("gen-shards", "gen-shards-chunks"):
            got = torch.load(ranks[case] / f"gen_{rank}.pt", weights_only=True)
            width = int(got["response_mask"].sum(-1).max())
            assert width == int(whole["response_mask"].sum(-1).max())
            assert torch.equal(got["responses"][:, :width], whole["responses"][:, :width]), case
            assert torch.equal(got["response_mask"][:, :width], whole["response_mask"][:, :width]), case
            assert torch.equal(got["routed_experts"], whole["routed_experts"]), case
            assert (got["routed_experts"] >= 0).any()
            torch.testing.assert_close(got["rollout_log_probs"], whole["rollout_log_probs"], atol=1e-5, rtol=0)
    # Both ranks write one width into the shared partition: the longest response of either. (This random tiny
    # model rarely stops early, so here that longest is max_new_tokens too: the check is of the agreement.)
    gens = [torch.load(ranks["gen-shards"] / f"gen_{rank}.pt", weights_only=True) for rank in range(2)]
    longest = max(int(span_lengths(g["response_mask"]).max()) for g in gens)
    assert [g["responses"].shape[1] for g in gens] == [longest, longest]


def test_strategy_resolution() -> None:
    assert resolve_strategy(None, 1) == "none" and resolve_strategy(None, 2) == "fsdp2"
    assert resolve_strategy("dp", 1) == "none" and resolve_strategy("dp", 4) == "dp"
    assert resolve_strategy("fsdp2", 1) == "fsdp2"
    with pytest.raises(ValueError, match="strategy: unknown .zero3.; valid names are dp, fsdp2, none"):
        resolve_strategy("zero3", 2)


@pytest.mark.parametrize("case", list(NO_GRAD_CASES))
def test_no_grad_forwards_over_shards_equal_the_gathered_model(ranks, case: str) -> None:
    """Old log-probs (with entropy, at a temperature; with R3 replay on the MoE model) and values computed over
    the fsdp2 shards, one layer gathered at a time, equal the same forward on the whole gathered model."""
    for r in range(2):
        both = torch.load(ranks[f"no-grad-{case}"] / f"both_{r}.pt", weights_only=True)
        if case == "actor-moe-R3":
            assert both["replayed"], "the R3 case must replay the routing in its old-log-prob forward"
        assert both["sharded"].keys() == both["full"].keys()
        for key, want in both["full"].items():
            assert want.abs().sum() > 0, key
            torch.testing.assert_close(both["sharded"][key], want, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("strategy", ["fsdp2", "dp"])
def test_deferred_grad_sync_takes_the_same_step(ranks, strategy: str) -> None:
    """Gradients communicated every micro-batch (the default) and only in the last one (defer_grad_sync) give the
    same update; rank 0 runs two micro-batches, rank 1 one real one and one dummy pass."""
    synced = torch.load(ranks["fsdp2-actor" if strategy == "fsdp2" else "dp"] / "params.pt", weights_only=True)
    deferred = torch.load(ranks[f"{strategy}-defer"] / "params.pt", weights_only=True)
    _assert_same_params(deferred, synced, atol=1e-6)


def test_r3_replay_holds_in_the_checkpointed_recompute_under_fsdp2(ranks, batches, model_path: str) -> None:
    """Under fsdp2 on two ranks, with R3 and activation checkpointing, the gradients equal those without
    checkpointing (the recomputed forward replays the recorded routing, which differs from the native one)."""
    _assert_native_routing_differs(model_path, batches[True])
    plain = torch.load(ranks["grads-R3"] / "grads.pt", weights_only=True)
    ckpt = torch.load(ranks["grads-R3-ckpt"] / "grads.pt", weights_only=True)
    assert plain.keys() == ckpt.keys() and plain
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


def _assert_native_routing_differs(model_path: str, fields: dict) -> None:
    """The batch's recorded routing is not what the model routes natively (so a native recompute would differ)."""
    from tensordict import TensorDict

    from conveyor.models.moe_routing import compute_routing_agreement

    worker = _actor(load_config(None, BASE), model_path=model_path, data_plane=make_data_plane("memory"))
    td = TensorDict(fields, batch_size=[B])
    with torch.no_grad():
        _, own = worker.forward.response_logits(td, None, record_routing=True)
    valid = torch.cat([td["prompt_mask"], td["response_mask"]], dim=1).bool()
    assert compute_routing_agreement(own.long(), td["routed_experts"].long(), valid) < 0.5


def _update_grads(cfg, model_path: str, fields: dict) -> dict[str, torch.Tensor]:
    """The gradients of one in-process update (captured just before the optimizer step)."""
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put([f"s{i}" for i in range(B)], "p", fields).with_extra_info(**UPDATE)
    worker = _actor(cfg, model_path=model_path, data_plane=plane)
    grads: dict[str, torch.Tensor] = {}
    step = worker.trained.step

    def capturing(grad_clip: float):
        grads.update({n: p.grad.detach().clone() for n, p in worker.model.named_parameters() if p.grad is not None})
        return step(grad_clip)

    worker.trained.step = capturing
    worker.update_actor(meta)
    return grads


def test_r3_replay_holds_in_the_checkpointed_recompute(model_path: str, batches) -> None:
    """Strategy none, Hugging Face forward: R3 with activation checkpointing takes the gradients R3 takes without
    it (before the fix the recompute routed natively and raised CheckpointError)."""
    fields = batches[True]
    _assert_native_routing_differs(model_path, fields)
    plain = _update_grads(load_config(None, BASE + [R3]), model_path, fields)
    ckpt = _update_grads(load_config(None, BASE + [R3, CKPT]), model_path, fields)
    assert plain.keys() == ckpt.keys() and plain
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    native = _update_grads(load_config(None, BASE), model_path, fields)
    router = next(k for k in plain if "gate" in k and "mlp" in k)
    assert not torch.allclose(native[router], plain[router], atol=1e-5), "replay must change the gradients"


def _plane_meta(fields: dict, extra: dict):
    plane = make_data_plane("memory")
    return plane, plane.kv_batch_put([f"s{i}" for i in range(B)], "p", fields).with_extra_info(**extra)


@pytest.mark.parametrize("replay", [False, True])
def test_token_budget_update_takes_the_fixed_micro_batch_gradient(model_path: str, batches, replay: bool) -> None:
    """Micro-batches of at most 16 tokens (5 passes of 1 or 2 rows, regrouped, their padding columns dropped, with
    the routing they replay under R3) against 3 rows a pass: the same gradient."""
    from tensordict import TensorDict

    from conveyor.workers.training.batching import TokenBudget, plan_micro_batches, take

    fields = batches[replay]
    budgeted = plan_micro_batches(fields["prompt_mask"], fields["response_mask"], 3, TokenBudget(16, "k"))
    td = TensorDict({k: fields[k] for k in ("prompts", "prompt_mask", "responses", "response_mask")}, batch_size=[B])
    widths = [take(td, b)[0]["prompts"].shape[1] + take(td, b)[0]["responses"].shape[1] for b in budgeted]
    assert len(budgeted) == 5 and all(len(b) * w <= 16 for b, w in zip(budgeted, widths)) and min(widths) < P + R
    extra = [R3] if replay else []
    fixed = _update_grads(load_config(None, BASE + extra), model_path, fields)
    dynamic = _update_grads(load_config(None, BASE + extra + DYN), model_path, fields)
    assert fixed.keys() == dynamic.keys() and fixed
    assert max(float(g.abs().max()) for g in fixed.values()) > 1e-3
    for k in fixed:
        torch.testing.assert_close(dynamic[k], fixed[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")


def test_token_budget_critic_update_takes_the_fixed_step(model_path: str, batches) -> None:
    want, one = _one_rank("critic", model_path, batches[False], [])
    got, dyn = _one_rank("critic", model_path, batches[False], CRITIC_DYN)
    _assert_same_params(got, want)
    assert dyn["critic/vf_loss@sum"] == pytest.approx(one["critic/vf_loss@sum"], rel=1e-5)


@pytest.mark.parametrize("impl,replay", [("hf", False), ("lean", False), ("hf", True)])
def test_token_budget_forwards_write_the_fixed_outputs_in_row_order(
    model_path: str, batches, impl: str, replay: bool
) -> None:
    """Old log-probs and entropy, reference log-probs and values, with micro-batches of at most 9 or 16 tokens
    (one or two rows each, not in row order, without their padding columns), equal the fixed micro-batches' at the
    same keys; under R3, replaying the rollout's routing over the kept columns."""
    from conveyor.workers.ranks.reference import ReferenceWorker
    from conveyor.workers.ranks.settings import reference_settings

    fields = batches[replay]
    entropy_call = LogProbCall(temperature=0.7, calculate_entropy=True).to_extra_info()
    budget = [
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=9",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=16",
        "critic.use_dynamic_bsz=true",
        "critic.forward_max_token_len_per_gpu=9",
    ]
    out = {}
    for name, overrides in (("fixed", []), ("budget", budget)):
        cfg = load_config(
            None, BASE + overrides + [f"actor_rollout_ref.model.forward_impl={impl}"] + ([R3] if replay else [])
        )
        plane, meta = _plane_meta(fields, entropy_call)
        _actor(cfg, model_path=model_path, data_plane=plane).compute_log_prob(meta)
        ReferenceWorker(
            reference_settings(cfg, build_run_plan(cfg, "cpu")), model_path=model_path, data_plane=plane
        ).compute_log_prob(meta)
        _critic(cfg, model_path=model_path, data_plane=plane).compute_values(meta)
        out[name] = plane.kv_batch_get(meta.keys, "p", ["old_log_probs", "entropy", "ref_log_prob", "values"])
    for key in ("old_log_probs", "entropy", "ref_log_prob", "values"):
        want = out["fixed"][key]
        if key != "values":  # the value head starts at zero
            assert want.abs().sum() > 0, key
        torch.testing.assert_close(out["budget"][key], want, atol=1e-6, rtol=0, msg=lambda m: f"{key}: {m}")


def test_a_sequence_longer_than_the_token_budget_names_the_key(model_path: str, batches) -> None:
    cfg = load_config(
        None,
        BASE + ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8"],
    )
    plane, meta = _plane_meta(batches[False], UPDATE)
    worker = _actor(cfg, model_path=model_path, data_plane=plane)
    key = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    with pytest.raises(ValueError, match=f"a sequence of 9 tokens .* exceeds {key}=8; set {key} to at least 9"):
        worker.update_actor(meta)
    # The old-log-prob forward's own key when it is set, else the actor's that it defaults to.
    with pytest.raises(ValueError, match=key):
        worker.compute_log_prob(dataclasses.replace(meta, extra_info=dict(LOG_PROB)))
    cfg = load_config(None, BASE + ["critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=8"])
    critic = _critic(cfg, model_path=model_path, data_plane=plane)
    with pytest.raises(ValueError, match="critic.forward_max_token_len_per_gpu=8"):
        critic.compute_values(meta)


def test_token_budget_under_two_fsdp2_ranks_takes_the_one_rank_step(model_path: str, batches, ranks) -> None:
    """Two fsdp2 ranks, token-budget micro-batches (the critic's: 4 and 3 passes, the second rank's count agreed up
    with a dropped repeat): the one-rank fixed micro-batches' gradient, log-probs and step."""
    fields = batches[False]
    out = ranks["fsdp2-dynbsz"]
    got = torch.cat([torch.load(out / f"log_probs_{r}.pt", weights_only=True) for r in range(2)])
    torch.testing.assert_close(got, fields["old_log_probs"], atol=1e-5, rtol=0)
    fixed = _update_grads(load_config(None, BASE), model_path, fields)
    grads = torch.load(out / "grads.pt", weights_only=True)
    assert grads.keys() == fixed.keys()
    for k in fixed:
        torch.testing.assert_close(grads[k], fixed[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    want, _ = _one_rank("critic", model_path, fields, [])
    _assert_same_params(torch.load(ranks["fsdp2-critic-dynbsz"] / "params.pt", weights_only=True), want)


def test_router_health_over_two_fsdp2_ranks_is_the_one_rank_figures(model_path: str, batches, ranks) -> None:
    """Two fsdp2 ranks: the router-health sums add up to one rank's, the gate-load distance (summed over ranks
    before it is taken) and the per-expert gradient norms (reduced over the shards) are one rank's."""
    out = ranks["router"]
    two = [json.loads((out / f"router_{r}.json").read_text()) for r in range(2)]
    two_update = [json.loads((out / f"router_update_{r}.json").read_text()) for r in range(2)]
    plane, meta = _plane_meta(batches[True], {})
    worker = _actor(load_config(None, BASE), model_path=model_path, data_plane=plane)
    one = worker.compute_routing_agreement(meta).extra_info
    one_update = worker.update_actor(
        meta.with_extra_info(**UpdateCall(temperature=1.0, calculate_entropy=False, moe_metrics=True).to_extra_info())
    ).extra_info
    keys = [k for k in one if k.startswith("actor/moe/")]
    assert any("flip_rate" in k for k in keys) and any("gate_load_tv" in k for k in keys)
    for key in keys:
        if key.endswith(("@sum", "@count")):
            assert sum(rank[key] for rank in two) == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
        else:
            assert two[0][key] == pytest.approx(one[key], rel=1e-5) and two[1][key] == two[0][key], key
    norms = [k for k in one_update if "expert_grad_norm" in k]
    assert len(norms) == 2 * 2 + 2 and one_update["actor/moe/expert_grad_norm_max/max"] > 0
    for key in norms:
        for rank in two_update:
            assert rank[key] == pytest.approx(one_update[key], rel=1e-4, abs=1e-8), key


def test_token_budget_routing_agreement_is_the_fixed_one(model_path: str, batches) -> None:
    """The routing-agreement forward over token-budget micro-batches (columns trimmed) agrees as the fixed one does."""
    got = {}
    for name, overrides in (
        ("fixed", []),
        (
            "budget",
            [
                "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=9",
            ],
        ),
    ):
        plane, meta = _plane_meta(batches[True], {})
        info = (
            _actor(load_config(None, BASE + overrides), model_path=model_path, data_plane=plane)
            .compute_routing_agreement(meta)
            .extra_info
        )
        got[name] = {k: v for k, v in info.items() if k.startswith("actor/moe/")}
    fixed, budget = got["fixed"], got["budget"]
    assert budget["actor/moe/routing_agreement@count"] == fixed["actor/moe/routing_agreement@count"] > 0
    # So do the router-health sums (flips, near ties, entropy per layer) and the gate mass against the load.
    assert budget.keys() == fixed.keys() and "actor/moe/gate_load_tv/layer_1" in fixed
    for key, value in fixed.items():
        assert budget[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
