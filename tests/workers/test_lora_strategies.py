"""LoRA under fsdp2 on two gloo ranks against one rank: the same adapter step (also with R3), the same reference.

One spawn of two ranks (`strategy_ranks.py`) runs every case; the one-rank reference runs in this process on
the same batch, as in `test_strategies.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_strategies import BASE, R3, RANKS_SCRIPT, UPDATE, B, _actor, _batch, _metrics  # tests/workers on sys.path

from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.models.lora import is_adapter_key
from conveyor.trainer.setup import prepare_default_model

LORA = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj,experts]",
]
FSDP2 = ["actor_rollout_ref.actor.strategy=fsdp2"]
KL = ["actor_rollout_ref.actor.use_kl_loss=true"]
CASES = {"lora": (LORA, False), "lora-R3": (LORA + [R3], True)}


@pytest.fixture(scope="module")
def model_path() -> str:
    return prepare_default_model(load_config(None, BASE))


@pytest.fixture(scope="module")
def batches(model_path: str) -> dict[bool, dict[str, torch.Tensor]]:
    return {False: _batch(model_path), True: _batch(model_path, with_routing=True)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, model_path: str, batches) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-ranks")
    for with_routing, fields in batches.items():
        torch.save(fields, root / f"batch-{int(with_routing)}.pt")
    runs = {name: (overrides + FSDP2, routing, ["update"]) for name, (overrides, routing) in CASES.items()}
    runs["ref"] = (LORA + FSDP2 + KL, False, ["ref_log_prob"])
    spec_runs = []
    for name, (overrides, routing, jobs) in runs.items():
        (root / name).mkdir()
        spec_runs.append(
            {
                "role": "actor",
                "overrides": BASE + overrides,
                "jobs": jobs,
                "out": str(root / name),
                "batch": str(root / f"batch-{int(routing)}.pt"),
            }
        )
    (root / "spec.json").write_text(json.dumps({"world": 2, "model_path": model_path, "runs": spec_runs}))
    done = subprocess.run(
        [sys.executable, str(RANKS_SCRIPT), str(root / "spec.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {name: root / name for name in runs}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_two_ranks_take_the_one_rank_lora_step(model_path, batches, ranks, case) -> None:
    overrides, routing = CASES[case]
    cfg = load_config(None, BASE + overrides)
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put([f"s{i}" for i in range(B)], "p", batches[routing]).with_extra_info(**UPDATE)
    worker = _actor(cfg, model_path=model_path, data_plane=plane)
    initial = worker.model_state_dict()
    one = dict(worker.update_actor(meta).extra_info)
    want = worker.model_state_dict()
    assert want and all(is_adapter_key(k) for k in want)  # model_state_dict of a LoRA actor: its adapters
    assert any("experts" in k for k in want)
    got = torch.load(ranks[case] / "params.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert max(float((want[k] - initial[k]).abs().max()) for k in want) > 5e-5  # BASE's lr: Adam moves ~1e-4
    two = _metrics(ranks[case])
    assert sum(m["actor/pg_loss@sum"] for m in two) == pytest.approx(one["actor/pg_loss@sum"], rel=1e-5, abs=1e-7)
    assert two[0]["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-5)
    # The optimizer holds the adapters' moments alone, sharded over the two ranks.
    adapter_bytes = sum(v.numel() * v.element_size() for v in want.values())
    assert one["perf/optim_bytes_local"] == pytest.approx(2 * adapter_bytes + 8 * len(want), rel=0.01)
    for m in two:
        assert 0.4 <= m["perf/optim_bytes_local"] / one["perf/optim_bytes_local"] <= 0.6


def test_fsdp2_lora_reference_is_the_base_model(model_path, batches, ranks) -> None:
    from conveyor.workers.ranks.calls import LogProbCall

    # The base model alone, one rank, the same (Hugging Face) forward.
    cfg = load_config(None, BASE)
    plane = make_data_plane("memory")
    keys = [f"s{i}" for i in range(B)]
    meta = plane.kv_batch_put(keys, "p", batches[False])
    _actor(cfg, model_path=model_path, data_plane=plane).compute_log_prob(
        meta.with_extra_info(**LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info())
    )
    want = plane.kv_batch_get(keys, "p", ["old_log_probs"])["old_log_probs"]
    got = torch.cat([torch.load(ranks["ref"] / f"ref_log_probs_{r}.pt", weights_only=True) for r in range(2)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
