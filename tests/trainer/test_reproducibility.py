"""Same seeds on the same machine give the same run: warm start, rollouts, updates, validation, MoE routing counts."""

from __future__ import annotations

import json

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.trainer.run import run_training

# Wall-clock and memory readings differ from run to run by nature; every other metric must not.
_MEASURED = ("timing_s/", "timing_cpu_s/", "perf/", "gen_time_s")


def _run(
    tmp_path, monkeypatch, name: str, tiny_run: list[str], extra: list[str], cache: str | None = None
) -> tuple[list[dict], list[dict]]:
    """A short run with its own model cache (so the warm start is built again) unless given one; metrics, expert
    loads."""
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / f"cache-{cache or name}"))
    run_dir = tmp_path / name
    run_training(
        load_config(
            None,
            tiny_run
            + [
                f"trainer.default_local_dir={run_dir}",
                "actor_rollout_ref.model.tiny.warmstart_steps=30",
                "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
                "trainer.total_training_steps=3",
                "trainer.save_freq=0",
                *extra,
            ],
        )
    )
    metrics = [
        {k: v for k, v in r.items() if not any(m in k for m in _MEASURED)}
        for r in read_metrics_jsonl(run_dir / "metrics.jsonl")
    ]
    loads = [json.loads(line) for line in (run_dir / "moe_expert_load.jsonl").read_text().splitlines()]
    return metrics, loads


def test_same_seeds_give_the_same_metrics_and_another_seed_does_not(tmp_path, monkeypatch, tiny_run):
    tiny_run = [o for o in tiny_run if not o.startswith("trainer.default_local_dir=")]
    seeds = ["actor_rollout_ref.model.tiny.seed=3", "trainer.seed=5"]
    first, first_loads = _run(tmp_path, monkeypatch, "a", tiny_run, seeds)
    second, second_loads = _run(tmp_path, monkeypatch, "b", tiny_run, seeds)
    assert [r["step"] for r in first] == [0, 1, 2, 3]
    assert {"val/accuracy", "reward/mean", "actor/pg_loss", "actor/grad_norm", "rollout/moe/max_vio/max"} <= set(
        first[0]
    ) | set(first[1])
    # Bit for bit, not approximately: the same machine runs the same float operations in the same order.
    assert first == second
    assert first_loads == second_loads and len(first_loads) == 3

    other, _ = _run(
        tmp_path, monkeypatch, "c", tiny_run, ["actor_rollout_ref.model.tiny.seed=3", "trainer.seed=6"], cache="a"
    )
    assert other[0] == first[0]  # the same model and warm start validate alike before any update
    assert other[1:] != first[1:]  # another sampling seed draws other responses
