"""rollout.exact: the hf rollout's log-probs are the old-log-prob forward's, bitwise, on 1 and 2 fsdp2 ranks.

Run as a script (`python test_exact_mode.py SPEC.json`) it is the two gloo ranks of the fsdp2 case: each builds
the actor worker, samples its share of the prompts, runs the old-log-prob forward and writes what it compares.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.process  # training runs and gloo ranks

EXACT = [
    "actor_rollout_ref.rollout.exact=true",
    # The importance weights are computed (and logged untruncated), so actor/rollout_corr/probs_diff_max is too.
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=10.0",
]
R3 = "actor_rollout_ref.actor.router_replay.mode=R3"
# What the two-rank case runs on: the tiny MoE from config, the Hugging Face forward over the fsdp2 shards.
RANK_BASE = [
    "data.synthetic.num_train=64",
    "data.synthetic.num_val=8",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
    "trainer.num_cpu_workers=2",
]
PROMPTS = 7  # the ranks get 4 and 3


def _steps(tiny_run: list[str], overrides: list[str], steps: int = 2) -> list[dict]:
    from conveyor.config import load_config
    from conveyor.trainer.run import run_training

    run_dir = f"{tiny_run[-1].split('=', 1)[1]}/{abs(hash(tuple(overrides)))}"
    cfg = load_config(
        None, tiny_run + [f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}"] + overrides
    )
    run_training(cfg)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "actor/pg_loss" in r]


@pytest.mark.parametrize("replay", [[], [R3]], ids=["no-replay", "R3"])
def test_exact_gives_zero_gap_on_one_rank(tiny_run, replay) -> None:
    rows = _steps(tiny_run, EXACT + replay)
    assert len(rows) == 2
    for r in rows:
        assert r["actor/rollout_corr/probs_diff_max"] == 0.0
        assert r["rollout_corr/log_prob_abs_diff/max"] == 0.0 and r["rollout_corr/kl"] == 0.0
    # Without it the decode loop's own log-probs differ from the forward's by float rounding: the check above is
    # not vacuous.
    plain = _steps(tiny_run, EXACT[1:] + replay)
    assert max(r["rollout_corr/log_prob_abs_diff/max"] for r in plain) > 0.0


def test_exact_is_refused_where_it_cannot_hold(tiny_run) -> None:
    from conveyor.config import load_config
    from conveyor.config.fields import ConfigError
    from conveyor.trainer.plan import build_run_plan

    refused = {
        "rollout.name": ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.tiny.num_heads=2"],
        "rollout.dtype": ["actor_rollout_ref.rollout.dtype=bfloat16"],
        "bypass_mode": ["algorithm.rollout_correction.bypass_mode=true"],
    }
    for name, overrides in refused.items():
        cfg = load_config(None, tiny_run + ["actor_rollout_ref.rollout.exact=true"] + overrides)
        with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.exact") as err:
            build_run_plan(cfg, "cpu")
        assert "\n" not in str(err.value), name
    plan = build_run_plan(load_config(None, tiny_run + ["actor_rollout_ref.rollout.exact=true"]), "cpu")
    assert plan.old_log_probs == "forward"
    assert any("rollout.exact" in line for line in plan.decisions)


def test_exact_gives_zero_gap_on_two_fsdp2_ranks(tmp_path) -> None:
    from conveyor.config import load_config
    from conveyor.trainer.setup import prepare_default_model

    model_path = prepare_default_model(load_config(None, RANK_BASE))
    # The float32 head under fsdp2's bf16 compute, through the fused head, as a third run of the same ranks.
    fp32_head = [
        "actor_rollout_ref.model.lm_head_fp32=true",
        "actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16",
        "actor_rollout_ref.model.use_fused_kernels=true",
    ]
    runs = {"fsdp2": [], "fsdp2-R3": [R3], "fsdp2-fp32-head": fp32_head}
    spec = {"model_path": model_path, "runs": {k: RANK_BASE + EXACT + v for k, v in runs.items()}, "out": str(tmp_path)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, __file__, str(tmp_path / "spec.json")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for name in runs:
        results = [json.loads((tmp_path / f"{name}_{rank}.json").read_text()) for rank in range(2)]
        assert [r["rows"] for r in results] == [4, 3]
        for r in results:
            assert r["tokens"] > 0 and r["bitwise"] and r["probs_diff_max"] == 0.0, (name, r)
            # The engine's own numbers were replaced: they were the decode loop's, not the forward's.
            assert r["replaced"], (name, r)


def _rank(rank: int, spec: dict, port: int) -> None:
    """One of the two ranks: every run's generation and old-log-prob forward on this rank's share of the prompts."""
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.protocol import KVBatchMeta
    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.placement.group import split_for_ranks
    from conveyor.workers.ranks.actor import PolicyWorker
    from conveyor.workers.ranks.calls import GenerateCall, LogProbCall
    from conveyor.workers.ranks.settings import actor_settings

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=5))
    for name, overrides in spec["runs"].items():
        cfg = load_config(None, overrides)
        plan = build_run_plan(cfg, "cpu")
        plane = make_data_plane("memory")
        worker = PolicyWorker(
            actor_settings(cfg, plan), model_path=spec["model_path"], data_plane=plane, rank=rank, world_size=2
        )
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(2, 7, (PROMPTS,), generator=gen)
        prompts = torch.randint(3, 30, (PROMPTS, 6), generator=gen)
        mask = (torch.arange(6)[None, :] >= 6 - lengths[:, None]).long()  # left-padded
        keys = [f"s{i}" for i in range(PROMPTS)]
        plane.kv_batch_put(keys, "p", {"prompts": prompts * mask, "prompt_mask": mask})
        share = split_for_ranks(KVBatchMeta(keys, "p", ["prompts", "prompt_mask"], [{} for _ in keys], {}), 2)[rank]
        call = GenerateCall(
            max_new_tokens=5,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            do_sample=True,
            seed=1,
            capture_routing=plan.rollout_captures_routing,
            pad_to_max_new_tokens=False,
        )
        out = worker.generate_sequences(KVBatchMeta(share.keys, "p", share.fields, share.tags, call.to_extra_info()))
        decoded = plane.kv_batch_get(share.keys, "p", ["rollout_log_probs"])["rollout_log_probs"].clone()
        lp = LogProbCall(temperature=1.0, calculate_entropy=True).to_extra_info()
        worker.compute_log_prob(KVBatchMeta(out.keys, "p", out.fields, out.tags, lp))
        got = plane.kv_batch_get(share.keys, "p", ["old_log_probs", "rollout_log_probs", "response_mask"])
        m = got["response_mask"].bool()
        old, roll = got["old_log_probs"][m], got["rollout_log_probs"][m]
        result = {
            "rows": len(share.keys),
            "tokens": int(m.sum()),
            "bitwise": bool(torch.equal(old, roll)),
            "probs_diff_max": float((old.exp() - roll.exp()).abs().max()),
            "replaced": bool(not torch.equal(decoded[m], roll)),
        }
        (Path(spec["out"]) / f"{name}_{rank}.json").write_text(json.dumps(result))
        worker.close()
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(_rank, args=(json.loads(Path(sys.argv[1]).read_text()), free_port), nprocs=2, join=True)
