"""Short training runs that sample with top-p, top-k or min-p: the trainer replays the rollout's mask (hf and vLLM).

Without the replay the trainer scores each token under the full softmax and every log-prob is off by the kept
mass (rollout_corr/kl about 0.2 at top_p=0.8 here); with it the gap is float32 rounding again.
"""

from __future__ import annotations

import json

import pytest

from conveyor.config import load_config
from conveyor.trainer.run import run_training

VLLM = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.model.tiny.num_heads=2",
    "actor_rollout_ref.model.tiny.num_kv_heads=2",
]
# The old-log-prob forward runs (rollout_is asks for it), and the importance weights are logged untruncated.
MEASURED = [
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=10.0",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # one update per step: the on-policy one
]
TOP_P, TOP_K, MIN_P = (
    "actor_rollout_ref.rollout.top_p=0.8",
    "actor_rollout_ref.rollout.top_k=5",
    "actor_rollout_ref.rollout.min_p=0.1",
)
# The untrained tiny model is near uniform: min_p=0.1 drops nothing there (the gap without the replay is 1e-8),
# 0.8 drops most of the vocabulary.
MIN_P_HIGH = "actor_rollout_ref.rollout.min_p=0.8"
OFF = "actor_rollout_ref.rollout.sampling_mask.replay=false"


def _steps(tiny_run: list[str], overrides: list[str], steps: int = 2) -> list[dict]:
    # A run directory of its own per run (several runs share one test's tmp_path).
    run_dir = f"{tiny_run[-1].split('=', 1)[1]}/{abs(hash(tuple(overrides)))}"
    cfg = load_config(
        None, tiny_run + [f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}"] + overrides
    )
    run_training(cfg)
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    out = [r for r in rows if "actor/pg_loss" in r]
    assert len(out) == steps
    return out


def _assert_replayed(rows: list[dict]) -> None:
    for r in rows:
        assert abs(r["rollout_corr/kl"]) < 1e-5, r["rollout_corr/kl"]
        assert abs(r["rollout_corr/rollout_is_mean"] - 1) < 1e-3, r["rollout_corr/rollout_is_mean"]


def _assert_gap(rows: list[dict]) -> None:
    for r in rows:
        assert r["rollout_corr/kl"] > 1e-2 and abs(r["rollout_corr/rollout_is_mean"] - 1) > 1e-2, r


@pytest.mark.parametrize("truncation", [[TOP_P], [TOP_K], [MIN_P_HIGH]], ids=["top_p", "top_k", "min_p"])
def test_hf_replays_the_mask_and_shows_the_gap_without(tiny_run, truncation) -> None:
    _assert_replayed(_steps(tiny_run, MEASURED + truncation))
    _assert_gap(_steps(tiny_run, MEASURED + truncation + [OFF]))


def test_hf_bypass_scores_the_rollouts_distribution(tiny_run) -> None:
    # Bypass mode (no old-log-prob forward): the first update's ratio is the trainer's log-prob against the
    # rollout's, both under the truncated distribution.
    bypass = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", TOP_P]
    assert all(abs(r["actor/ppo_kl"]) < 1e-5 for r in _steps(tiny_run, bypass))
    assert all(r["actor/ppo_kl"] > 1e-2 for r in _steps(tiny_run, bypass + [OFF]))


def test_vllm_replays_the_mask_and_shows_the_gap_without(tiny_run) -> None:
    # vLLM's CPU engine samples in float32 and reports its processed (truncated) log-probs; the fused head replays.
    _assert_replayed(
        _steps(tiny_run, VLLM + MEASURED + [TOP_P, TOP_K, MIN_P, "actor_rollout_ref.model.use_fused_kernels=true"])
    )
    _assert_gap(_steps(tiny_run, VLLM + MEASURED + [TOP_P, OFF]))
