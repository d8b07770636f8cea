"""Ulysses sequence parallelism on 2 and 4 gloo ranks against the one-rank worker, in float32.

Every rank of an SP group computes its slice of each packed row; the group's results must be the one-rank
results: old log-probs and entropy (and the recorded routing), values, and the parameters after one update, at
1e-5, for the tiny Qwen3 (dense) and Qwen3-MoE, with and without R3 replay, with the fused log-prob, and with
SP beside fsdp2 sharding (dp=2) and expert parallelism on 4 ranks. One spawn per world size runs every case
(`strategy_ranks.py`); the one-rank references run in this process on the same batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from strategy_ranks import _capture_grads
from test_strategies import (  # noqa: E501
    BASE,
    DENSE,
    R3,
    RANKS_SCRIPT,
    UPDATE,
    B,
    _actor,
    _assert_same_params,
    _batch,
    _critic,
    _metrics,
)

from conveyor.config import ConfigError, load_config
from conveyor.data_plane import make_data_plane
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.ranks.calls import LogProbCall
from conveyor.workers.ranks.reference import ReferenceWorker
from conveyor.workers.ranks.settings import reference_settings

SP_ACTOR = "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"
SP_CRITIC = "critic.ulysses_sequence_parallel_size=2"
SP_REF = "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"
R2 = "actor_rollout_ref.actor.router_replay.mode=R2"
FUSED = "actor_rollout_ref.model.use_fused_kernels=true"
CKPT = "actor_rollout_ref.model.enable_gradient_checkpointing=true"
TRUNCATED, TRUNCATED_K = "actor_rollout_ref.rollout.top_p=0.8", "actor_rollout_ref.rollout.top_k=5"
EP2 = "actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2"
FSDP2 = ["actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2"]
# A per-GPU token budget below the longest row (9 tokens): an SP group of 2 takes micro-batches of twice it, as
# verl does; the one-rank reference runs at the group's budget.
DYN = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=5"]

# name -> (world, role, overrides beyond SP, dense model, batch with routing, jobs)
CASES: dict[str, tuple[int, str, list[str], bool, bool, list[str]]] = {
    "moe": (2, "actor", [], False, False, ["stats", "grads_update"]),
    "moe-R3": (2, "actor", [R3], False, True, ["stats", "grads_update"]),
    "moe-R2-record": (2, "actor", [R2], False, False, ["stats"]),
    "moe-dynbsz": (2, "actor", DYN, False, False, ["stats", "grads_update"]),
    "moe-R3-fused-ckpt": (2, "actor", [R3, FUSED, CKPT], False, True, ["stats", "grads_update"]),
    "dense": (2, "actor", [], True, False, ["stats", "grads_update"]),
    "dense-dp": (2, "actor", ["actor_rollout_ref.actor.strategy=dp"], True, False, ["grads_update"]),
    # The rollout's top-p / top-k mask replayed on each rank's slice, fused head included (stats only: this batch's
    # old log-probs are the full softmax's, so every replayed ratio is clipped and an update would not move).
    "dense-truncated": (2, "actor", [TRUNCATED, TRUNCATED_K, FUSED], True, False, ["stats"]),
    "critic": (2, "critic", ["critic.optim.lr=0.05"], False, False, ["grads_update", "stats"]),
    "ref": (2, "ref", ["actor_rollout_ref.ref.strategy=fsdp2"], False, False, ["stats"]),
    # 4 ranks: SP groups of 2 (ranks 0-1, 2-3), fsdp2 sharding over all 4 (dp=2), the rows split over dp.
    "4-moe-R3": (4, "actor", [R3], False, True, ["stats", "grads_update"]),
    "4-moe-EP2": (4, "actor", [EP2], False, False, ["grads_update"]),
}


@pytest.fixture(scope="module")
def model_path() -> str:
    return prepare_default_model(load_config(None, BASE))


@pytest.fixture(scope="module")
def dense_path() -> str:
    return prepare_default_model(load_config(None, BASE + DENSE))


@pytest.fixture(scope="module")
def batches(model_path: str) -> dict[bool, dict[str, torch.Tensor]]:
    return {False: _batch(model_path), True: _batch(model_path, with_routing=True)}


def _overrides(case: str) -> list[str]:
    world, role, extra, dense, _, _ = CASES[case]
    return BASE + FSDP2 + extra + (DENSE if dense else []) + [f"trainer.num_cpu_workers={world}"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, model_path: str, dense_path: str, batches) -> dict[str, Path]:
    """Every case's SP run, one spawn per world size; case name -> its output folder."""
    root = tmp_path_factory.mktemp("sp-ranks")
    for with_routing, fields in batches.items():
        torch.save(fields, root / f"batch-{int(with_routing)}.pt")
    for world in (2, 4):
        runs = []
        for name, (w, role, _, dense, with_routing, jobs) in CASES.items():
            if w != world:
                continue
            (root / name).mkdir()
            # The reference's size is left null: it follows the actor's, as verl's does.
            sp = SP_CRITIC if role == "critic" else SP_ACTOR
            runs.append(
                {
                    "role": role,
                    "overrides": _overrides(name) + [sp],
                    "jobs": jobs,
                    "out": str(root / name),
                    "batch": str(root / f"batch-{int(with_routing)}.pt"),
                    "model_path": dense_path if dense else model_path,
                }
            )
        spec = root / f"spec-{world}.json"
        spec.write_text(json.dumps({"world": world, "model_path": model_path, "runs": runs}))
        done = subprocess.run(
            [sys.executable, str(RANKS_SCRIPT), str(spec)],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 0, done.stderr[-6000:]
    return {name: root / name for name in CASES}


def _one_rank(case: str, path: str, fields: dict) -> dict:
    """The one-rank worker of `case` (no SP, no EP): stats on a copy of the batch, then one update."""
    world, role, extra, dense, _, jobs = CASES[case]
    extra = [o.replace("len_per_gpu=5", "len_per_gpu=10") for o in extra if o != EP2]
    cfg = load_config(None, BASE + extra + (DENSE if dense else []))
    plane = make_data_plane("memory")
    keys = [f"s{i}" for i in range(B)]
    meta = plane.kv_batch_put(keys, "p", fields)
    lp_meta = plane.kv_batch_put(keys, "lp", fields)
    if role == "ref":
        worker = ReferenceWorker(reference_settings(cfg, build_run_plan(cfg, "cpu")), model_path=path, data_plane=plane)
    else:
        worker = (_critic if role == "critic" else _actor)(cfg, model_path=path, data_plane=plane)
    out: dict = {}
    for job in jobs:
        if job == "grads_update":
            out["initial"] = {k: v.clone() for k, v in worker.model_state_dict().items()}
            out["grads"] = _capture_grads(worker)
            result = (worker.update_critic if role == "critic" else worker.update_actor)(meta.with_extra_info(**UPDATE))
            out["metrics"] = dict(result.extra_info)
            out["params"] = worker.model_state_dict()
        elif role == "critic":
            worker.compute_values(lp_meta)
            out["stats"] = dict(plane.kv_batch_get(keys, "lp", ["values"]).items())
        elif role == "ref":
            worker.compute_log_prob(
                lp_meta.with_extra_info(**LogProbCall(temperature=0.7, calculate_entropy=False).to_extra_info())
            )
            out["stats"] = dict(plane.kv_batch_get(keys, "lp", ["ref_log_prob"]).items())
        else:
            call = LogProbCall(temperature=0.7, calculate_entropy=True, calculate_sum_pi_squared=True).to_extra_info()
            result = worker.compute_log_prob(lp_meta.with_extra_info(**call))
            names = [n for n in ("old_log_probs", "entropy", "sum_pi_squared", "routed_experts") if n in result.fields]
            out["stats"] = dict(plane.kv_batch_get(keys, "lp", names).items())
            out["stats_metrics"] = dict(result.extra_info)
    return out


def _gathered_stats(folder: Path, world: int) -> dict[str, torch.Tensor]:
    """Every rank's outputs put back in key order (s0..s{B-1})."""
    parts = [torch.load(folder / f"stats_{r}.pt", weights_only=True) for r in range(world)]
    order = {k: i for i, k in enumerate(f"s{j}" for j in range(B))}
    assert all(p["sp_size"] == 2 for p in parts), "the ranks did not run sequence parallel"
    keys = [k for p in parts for k in p["keys"]]
    index = torch.tensor([order[k] for k in keys]).argsort()
    return {n: torch.cat([p[n] for p in parts])[index] for n in parts[0] if n not in ("keys", "sp_size")}


@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_gives_the_one_rank_results(
    model_path: str, dense_path: str, batches, ranks, case: str
) -> None:
    """Log-probs, entropy, Σπ², recorded routing and values, and the parameters after one update, at 1e-5."""
    world, role, _, dense, with_routing, jobs = CASES[case]
    want = _one_rank(case, dense_path if dense else model_path, batches[with_routing])
    folder = ranks[case]
    if "stats" in jobs:
        got = _gathered_stats(folder, world)
        assert got.keys() == want["stats"].keys()
        for name, value in want["stats"].items():
            if name == "routed_experts":  # ids: exactly, -1 at the same (unfed) places
                assert torch.equal(got[name].long(), value.long()), name
            else:
                torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        if "R2" in case:
            assert "routed_experts" in want["stats"], "the R2 case must record the forward's routing"
        if role == "actor":
            assert "sum_pi_squared" in want["stats"], "the actor's stats must include Σπ²"
    if "grads_update" in jobs:
        # The gradients themselves: Adam's first step moves a weight by about lr whatever its gradient's scale, so
        # equal parameters alone would not catch a gradient counted twice over the SP group.
        grads = torch.load(folder / "grads.pt", weights_only=True)
        assert grads.keys() == want["grads"].keys() and grads
        for k, g in want["grads"].items():
            torch.testing.assert_close(grads[k], g, atol=1e-5, rtol=1e-4, msg=lambda m: f"grad {k}: {m}")
        params = torch.load(folder / "params.pt", weights_only=True)
        _assert_same_params(params, want["params"], want["initial"])
        # Every metric counted once over each SP group: the token-weighted means are the one-rank ones.
        metrics = _metrics(folder, world)
        prefix = "critic" if role == "critic" else "actor"
        for name in ("pg_loss", "pg_clipfrac", "vf_clipfrac", "vpred_mean"):
            key = f"{prefix}/{name}@sum"
            if key not in want["metrics"]:
                continue
            count_key = key.replace("@sum", "@count")
            total = sum(m[key] for m in metrics if m.get(key) is not None)
            one = want["metrics"][key]
            if count_key in want["metrics"]:  # a token-weighted mean; else a sum (a loss already normalised)
                total /= sum(m[count_key] for m in metrics if m.get(key) is not None)
                one /= want["metrics"][count_key]
            assert abs(total - one) < 1e-5, (key, total, one)
            assert sum(m.get(key) is not None for m in metrics) == world // 2, "one report per SP group"


def test_sequence_parallel_size_is_refused_where_it_cannot_run() -> None:
    """The config names the key and the fix: a size that does not divide the ranks or the heads, padded forwards."""
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.ulysses_sequence_parallel_size: must divide"):
        load_config(None, BASE + [SP_ACTOR.replace("=2", "=3"), "trainer.num_cpu_workers=2"])
    with pytest.raises(ConfigError, match="tiny.num_kv_heads=2"):
        load_config(None, BASE + ["critic.ulysses_sequence_parallel_size=4", "trainer.num_cpu_workers=4"])
    with pytest.raises(ConfigError, match="use_remove_padding=true"):
        load_config(
            None,
            BASE
            + ["actor_rollout_ref.ref.ulysses_sequence_parallel_size=2", "trainer.num_cpu_workers=2"]
            + ["actor_rollout_ref.model.use_remove_padding=false"],
        )


def test_the_reference_follows_the_actors_size_unless_set() -> None:
    """verl's default: `ref.ulysses_sequence_parallel_size` null means the actor's; a set value is the reference's."""
    workers = ["trainer.num_cpu_workers=2", "actor_rollout_ref.ref.strategy=fsdp2"]
    cfg = load_config(None, BASE + workers + [SP_ACTOR])
    assert cfg.actor_rollout_ref.ref.ulysses_sequence_parallel_size is None
    assert reference_settings(cfg, build_run_plan(cfg, "cpu")).sequence_parallel_size == 2
    cfg = load_config(None, BASE + workers + [SP_ACTOR, SP_REF.replace("=2", "=1")])
    assert reference_settings(cfg, build_run_plan(cfg, "cpu")).sequence_parallel_size == 1
    # Followed, it is checked as the reference's own: a strategy without ranks to split over is refused by its key.
    with pytest.raises(ConfigError, match="actor_rollout_ref.ref.ulysses_sequence_parallel_size: splits sequences"):
        load_config(None, BASE + ["trainer.num_cpu_workers=2", SP_ACTOR, "actor_rollout_ref.ref.strategy=none"])
