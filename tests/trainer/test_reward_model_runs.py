"""Training runs with a reward model (reward_model.enable): synchronous and asynchronous, on a tiny reward model
saved to a directory; the step's reward is the declared sum of the model's score and the rule reward."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.models.reward_model import build_tiny_reward_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.run import run_training

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from reward_batches import MAYBE_YES, other_tokenizer, save_chain_judge  # noqa: E402


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, tok in (("same", build_char_tokenizer()), ("other", other_tokenizer())):
        path = tmp_path_factory.mktemp(f"rm-{name}")
        build_tiny_reward_model(tok, seed=5).save_pretrained(str(path))
        tok.save_pretrained(str(path))
        out[name] = path
    return out


def _run(tmp_path, tiny_run, extra: list[str]) -> tuple[list[dict], Path]:
    cfg = load_config(None, tiny_run + extra)
    run_training(cfg)
    run_dir = Path(cfg.trainer.default_local_dir)
    return [r for r in read_metrics_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0], run_dir


def _check_sum(rows: list[dict], model_weight: float, rule_weight: float) -> None:
    """Every step logs both parts, and its reward is their weighted sum (means over the batch)."""
    for r in rows:
        want = model_weight * r["reward/model_score"] + rule_weight * r["reward/rule_score"]
        assert r["reward/mean"] == pytest.approx(want, abs=1e-5), r["step"]
        assert r["reward/model_score_min"] <= r["reward/model_score"] <= r["reward/model_score_max"]
        assert r["reward/model_truncated_frac"] == 0.0


def test_a_synchronous_run_scores_with_the_reward_model(tmp_path, tiny_run, rm_dirs) -> None:
    extra = [
        "reward_model.enable=true",
        f"reward_model.model.path={rm_dirs['same']}",
        "reward_model.rule_weight=1.0",
        "reward_model.model_weight=0.5",
        "reward_model.micro_batch_size_per_gpu=3",
    ]
    rows, run_dir = _run(tmp_path, tiny_run, extra)
    assert [r["step"] for r in rows] == [1, 2]
    _check_sum(rows, 0.5, 1.0)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["use_reward_model"] and plan["reward_model_placement"] == "colocated"
    assert any(d.startswith("reward model:") for d in plan["decisions"])


def test_the_asynchronous_trainer_scores_with_a_reward_model_of_another_tokenizer(tmp_path, tiny_run, rm_dirs) -> None:
    extra = [
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.sampler.max_off_policy_threshold=1",
        "trainer.total_training_steps=3",
        "reward_model.enable=true",
        f"reward_model.model.path={rm_dirs['other']}",
        "reward_model.rule_weight=1.0",
        "reward_model.use_dynamic_bsz=true",
        "reward_model.forward_max_token_len_per_gpu=128",
    ]
    cfg = load_config(None, tiny_run + extra)
    assert build_run_plan(cfg, "cpu").reward_model_placement == "colocated"  # one process: beside the actor
    rows, _ = _run(tmp_path, tiny_run, extra)
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_sum(rows, 1.0, 1.0)
    # Scores of a model that reads the responses: not one number for every sample.
    assert any(r["reward/model_score_max"] > r["reward/model_score_min"] for r in rows)


def test_an_asynchronous_run_on_ray_places_the_reward_model_apart() -> None:
    cfg = load_config(
        None,
        [
            "trainer.v1.trainer_mode=separate_async",
            "trainer.num_cpu_workers=2",
            "reward_model.enable=true",
            "reward_model.model.path=/nowhere",
        ],
    )
    plan = build_run_plan(cfg, "cpu")
    assert plan.use_reward_model and plan.reward_model_placement == "separate"
    cfg.trainer.v1.trainer_mode = "sync"
    assert build_run_plan(cfg, "cpu").reward_model_placement == "colocated"


@pytest.mark.parametrize(
    "placement",
    [
        # Two ranks of their own, one fsdp2 process group between them, beside the actor's two.
        ["reward_model.placement=separate", "reward_model.num_workers=2", "reward_model.strategy=fsdp2"],
        # Sharded over the actor's two ranks, in their processes.
        ["reward_model.placement=colocated"],
    ],
    ids=["separate", "colocated"],
)
@pytest.mark.slow  # Ray and up to five worker processes: 5-7 minutes each on the shared 2-core machine
def test_a_run_on_ray_scores_with_the_reward_model(tmp_path, tiny_run, rm_dirs, placement) -> None:
    pytest.importorskip("ray")
    extra = [
        "trainer.num_cpu_workers=2",
        "ray.worker_cpus=0.25",  # a local Ray of 2 CPUs holds the actor's ranks, the reward worker and these
        "reward_model.enable=true",
        f"reward_model.model.path={rm_dirs['other']}",
        "reward_model.rule_weight=1.0",
        *placement,
    ]
    rows, run_dir = _run(tmp_path, tiny_run, extra)
    assert [r["step"] for r in rows] == [1, 2]
    _check_sum(rows, 1.0, 1.0)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["reward_model_placement"] == placement[0].split("=")[1]


def test_a_run_with_a_reward_model_and_a_judge_sums_all_three(tmp_path, tiny_run, rm_dirs) -> None:
    judge = save_chain_judge(tmp_path / "judge", MAYBE_YES)
    template = tmp_path / "template.txt"
    template.write_text("is {response} the answer to {question} ({ground_truth})? verdict:")
    extra = [
        "reward_model.enable=true",
        f"reward_model.model.path={rm_dirs['same']}",
        "reward_model.rule_weight=1.0",
        "reward_model.model_weight=0.5",
        "reward_model.judge.enable=true",
        f"reward_model.judge.model.path={judge}",
        f"reward_model.judge.prompt_template={template}",
        "reward_model.judge.parser=yes_no",
        "reward_model.judge.max_new_tokens=8",
        "reward_model.judge.max_retries=12",
        "reward_model.judge.weight=0.25",
    ]
    rows, run_dir = _run(tmp_path, tiny_run, extra)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/judge_score"] == 1.0 and r["reward/judge_unparsable_frac"] == 0.0
        want = 0.5 * r["reward/model_score"] + r["reward/rule_score"] + 0.25 * r["reward/judge_score"]
        assert r["reward/mean"] == pytest.approx(want, abs=1e-5)
    assert json.loads((run_dir / "plan.json").read_text())["use_judge"]
