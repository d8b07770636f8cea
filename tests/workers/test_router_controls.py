"""The actor's router controls on the tiny MoE model: freezing (one rank, LoRA, fsdp2 on two gloo ranks), the
load-balancing loss in the update, and loss-free balancing (the update, the rollout, checkpoints, a separate
replica, expert parallelism on two ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_strategies import BASE, RANKS_SCRIPT, UPDATE, B, _actor, _batch  # tests/workers on sys.path

from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.models.moe_routing import moe_layers
from conveyor.models.router_control import BIAS_NAME, router_parameter_names, selection_bias_step, selection_biases
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.ranks.calls import GenerateCall
from conveyor.workers.ranks.forward import sequence_inputs
from conveyor.workers.ranks.replica import ReplicaWorker
from conveyor.workers.ranks.settings import rollout_settings

FREEZE = ["actor_rollout_ref.actor.router.freeze=true"]
BIAS = ["actor_rollout_ref.actor.router.bias_update_rate=0.01"]
LORA = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.model.target_modules=all-linear",
]
FSDP2 = ["actor_rollout_ref.actor.strategy=fsdp2"]
EP = FSDP2 + ["actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2", "trainer.num_cpu_workers=2"]
HF = ["actor_rollout_ref.model.forward_impl=hf"]
RULE = ["actor_rollout_ref.actor.router.bias_update=proportional", "actor_rollout_ref.actor.router.bias_dead_band=0.2"]


@pytest.fixture(scope="module")
def model_path() -> str:
    return prepare_default_model(load_config(None, BASE))


@pytest.fixture(scope="module")
def batch(model_path: str) -> dict[str, torch.Tensor]:
    return _batch(model_path)


def _worker(model_path: str, batch: dict, overrides: list[str]):
    """A one-rank actor over `batch` in its own data plane, and the update call's handle."""
    cfg = load_config(None, BASE + overrides)
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put([f"s{i}" for i in range(B)], "p", batch)
    return _actor(cfg, model_path=model_path, data_plane=plane), meta


def _state(worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.state_dict().items()}


def _own_load(worker, batch: dict) -> torch.Tensor:
    """(L, E) assignments of the actor's own routing over the batch's fed tokens."""
    from tensordict import TensorDict

    td = TensorDict({k: v for k, v in batch.items()}, batch_size=[B])
    with torch.no_grad():
        routing = worker.forward.routing(td).long()  # (B, S, L, K)
    fed = sequence_inputs(td)[1].bool()
    own = routing[fed]  # (tokens, L, K)
    return torch.stack([torch.bincount(own[:, i].reshape(-1), minlength=8) for i in range(own.shape[1])]).double()


@pytest.mark.parametrize("lora", [False, True])
def test_freeze_keeps_the_routers_bit_identical_while_the_rest_trains(model_path, batch, lora) -> None:
    worker, meta = _worker(model_path, batch, FREEZE + (LORA if lora else []))
    routers = router_parameter_names(worker.model)
    assert len(routers) == 2
    before = _state(worker)
    for _ in range(2):
        worker.update_actor(meta.with_extra_info(**UPDATE))
    after = _state(worker)
    for name in routers:
        assert torch.equal(after[name], before[name]), name
    moved = [k for k in after if not torch.equal(after[k], before[k])]
    assert moved, "the rest of the model must train"
    params = dict(worker.model.named_parameters())
    assert all(params[n] not in worker.trained.optimizer.state for n in routers)  # no optimizer state
    if lora:  # the router is never adapted: no adapter sits on it
        assert not any("gate.lora" in k or "gate.base_layer" in k for k in after)


def test_aux_loss_is_logged_as_transformers_computes_it_and_trains_the_router(model_path, batch) -> None:
    # One micro-batch: the logged loss is then the loss of the whole batch, as transformers computes it.
    coef = [
        "actor_rollout_ref.actor.router.aux_loss_coef=0.5",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    ]
    results = {}
    for name, overrides in (("off", []), ("on", coef)):
        worker, meta = _worker(model_path, batch, HF + overrides)
        if name == "on":
            td = worker._get(meta, ["prompts", "prompt_mask", "responses", "response_mask"])
            ids, mask, pos = sequence_inputs(td)
            with torch.no_grad():
                want = worker.model(
                    input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True
                ).aux_loss
        out = worker.update_actor(meta.with_extra_info(**UPDATE)).extra_info
        results[name] = (out, _state(worker))
    out, _ = results["on"]
    got = out["actor/moe/aux_loss@sum"] / out["actor/moe/aux_loss@count"]
    assert abs(got - float(want)) < 1e-6
    assert "actor/moe/aux_loss@sum" not in results["off"][0]
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(results["on"][1][gate], results["off"][1][gate]), "the loss must reach the router"


def test_loss_free_balancing_updates_the_bias_and_the_rollout_routes_with_it(model_path, batch, tmp_path) -> None:
    worker, meta = _worker(model_path, batch, BIAS)
    load = _own_load(worker, batch)
    worker.update_actor(meta.with_extra_info(**UPDATE))
    want = 0.01 * torch.sign(load.mean(dim=1, keepdim=True) - load)
    torch.testing.assert_close(selection_biases(worker.model), want.float())
    assert float(want.abs().sum()) > 0

    # The colocated hf engine samples from the same routers: a bias that forces expert 5 shows in its routing.
    for layer in moe_layers(worker.model):
        getattr(layer.router, BIAS_NAME)[5] = 100.0
    plane = worker.data_plane
    prompts = {k: batch[k] for k in ("prompts", "prompt_mask")}
    gen = plane.kv_batch_put([f"g{i}" for i in range(B)], "gen", prompts)
    call = GenerateCall(
        max_new_tokens=3,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        do_sample=False,
        seed=0,
        capture_routing=True,
        pad_to_max_new_tokens=False,
    )
    worker.generate_sequences(gen.with_extra_info(**call.to_extra_info()))
    routed = plane.kv_batch_get(gen.keys, "gen", ["routed_experts"])["routed_experts"].long()
    known = (routed >= 0).all(dim=-1)
    assert known.any() and bool((routed == 5).any(dim=-1)[known].all())

    # Checkpoints carry the bias.
    biases = selection_biases(worker.model)
    extra = worker.save_checkpoint(str(tmp_path / "actor"))
    fresh, _ = _worker(model_path, batch, BIAS)
    assert float(selection_biases(fresh.model).abs().max()) == 0
    fresh.load_checkpoint(str(tmp_path / "actor"), extra)
    assert torch.equal(selection_biases(fresh.model), biases)

    # A separate hf replica gets it with the weights.
    cfg = load_config(None, BASE + BIAS + ["actor_rollout_ref.rollout.placement=separate"])
    plan = build_run_plan(cfg, "cpu")
    replica = ReplicaWorker(rollout_settings(cfg, plan), model_path=model_path, data_plane=make_data_plane("memory"))
    replica.load_weights(worker.weight_stream(), version=1)
    assert torch.equal(selection_biases(replica.model), biases)


def test_the_chosen_bias_update_rule_and_dead_band_reach_the_actor(model_path, batch) -> None:
    worker, meta = _worker(model_path, batch, BIAS + RULE)
    load = _own_load(worker, batch)
    worker.update_actor(meta.with_extra_info(**UPDATE))
    want = selection_bias_step(load, 0.01, "proportional", 0.2)
    torch.testing.assert_close(selection_biases(worker.model), want)
    # The band leaves some experts still and the rule moves others by less than the full rate.
    assert bool((want == 0).any()) and bool(((want.abs() > 0) & (want.abs() < 0.01)).any())


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, model_path: str, batch) -> dict[str, Path]:
    """Freeze under fsdp2 and loss-free balancing under expert parallelism, two gloo ranks, one spawn."""
    root = tmp_path_factory.mktemp("router-ranks")
    torch.save(batch, root / "batch.pt")
    runs = {"freeze": FREEZE + FSDP2, "ep-bias": BIAS + EP, "ep-proportional": BIAS + RULE + EP}
    spec = []
    for name, overrides in runs.items():
        (root / name).mkdir()
        spec.append(
            {
                "role": "actor",
                "overrides": BASE + overrides,
                "jobs": ["update"],
                "out": str(root / name),
                "batch": str(root / "batch.pt"),
            }
        )
    (root / "spec.json").write_text(json.dumps({"world": 2, "model_path": model_path, "runs": spec}))
    done = subprocess.run(
        [sys.executable, str(RANKS_SCRIPT), str(root / "spec.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {name: root / name for name in runs}


def test_fsdp2_two_ranks_freeze_the_routers(model_path, batch, ranks) -> None:
    worker, _ = _worker(model_path, batch, [])
    initial = worker.model_state_dict()
    got = torch.load(ranks["freeze"] / "params.pt", weights_only=True)
    routers = router_parameter_names(worker.model)
    for name in routers:
        assert torch.equal(got[name], initial[name]), name
    assert any(not torch.equal(got[k], initial[k]) for k in initial if k not in routers)


@pytest.mark.parametrize("run", ["ep-bias", "ep-proportional"])
def test_expert_parallel_ranks_move_the_bias_by_the_global_load(model_path, batch, ranks, run) -> None:
    # The one-rank actor sees the whole batch: its load is the sum of the two ranks' shares. The proportional
    # step follows the load's size, not only its sign: a rank that moved by its own share would differ.
    worker, meta = _worker(model_path, batch, BIAS + HF + (RULE if run == "ep-proportional" else []))
    worker.update_actor(meta.with_extra_info(**UPDATE))
    want = selection_biases(worker.model)
    got = torch.load(ranks[run] / "params.pt", weights_only=True)
    names = [f"model.layers.{i}.mlp.gate.{BIAS_NAME}" for i in range(2)]
    torch.testing.assert_close(torch.stack([got[n] for n in names]), want, atol=0, rtol=0)
    metrics = [json.loads((ranks[run] / f"metrics_{r}.json").read_text()) for r in range(2)]
    assert metrics[0]["actor/moe/update_max_vio/max"] == metrics[1]["actor/moe/update_max_vio/max"]
