"""Smoke test of benchmarks/e2e_vs_trl.py: a tiny conveyor-vs-TRL pair runs end to end; its helpers compute the right
figures."""

from __future__ import annotations

import math
import statistics
from types import ModuleType

import pytest
from benchmark_scripts import load_script


def load_benchmark() -> ModuleType:
    """Import benchmarks/e2e_vs_trl.py as a module."""
    return load_script("e2e_vs_trl")


# No warm start and a small task keep the model build and both runs to seconds.
TINY_TASK = [
    "--set",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
    "--set",
    "data.synthetic.num_train=64",
    "--set",
    "data.synthetic.num_val=8",
]
TINY = [
    "--steps",
    "2",
    "--pairs",
    "1",
    "--warmup",
    "1",
    "--batch",
    "2",
    "--n",
    "2",
    "--max-new-tokens",
    "3",
    "--threads",
    "1",
    *TINY_TASK,
]


@pytest.mark.slow
def test_main_tiny_pair(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("trl")
    result = load_benchmark().main(TINY)
    out = capsys.readouterr().out
    assert result["settings"]["batch"] == 2 and result["settings"]["n"] == 2
    assert result["threads"] == {"conveyor": 1, "trl": 1}
    for side in ("conveyor", "trl"):
        (run,) = result["runs"][side]
        assert run["side"] == side
        assert len(run["step_s"]) == len(run["cpu_s"]) == len(run["tokens"]) == len(run["reward"]) == 2
        assert all(0 < c for c in run["cpu_s"])
        # Rewards are the arithmetic task's scores: means over the batch, in [0, 1].
        assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in run["reward"])
        # Every sample generates between 1 and --max-new-tokens tokens (EOS included).
        assert all(2 * 2 * 1 <= t <= 2 * 2 * 3 for t in run["tokens"])
        s = run["summary"]
        assert s["timed_steps"] == 1
        assert math.isclose(s["steps_per_s"], 1 / run["step_s"][1])
        assert math.isclose(s["tokens_per_s"], run["tokens"][1] / run["step_s"][1])
        assert math.isclose(s["cpu_steps_per_s"], 1 / run["cpu_s"][1])
        assert s["peak_rss_mib"] > 50  # a process with torch loaded
    (pair,) = result["pairs"]
    c, t = result["runs"]["conveyor"][0]["summary"], result["runs"]["trl"][0]["summary"]
    assert math.isclose(pair["steps_ratio"], c["steps_per_s"] / t["steps_per_s"])
    assert math.isclose(pair["cpu_steps_ratio"], c["cpu_steps_per_s"] / t["cpu_steps_per_s"])
    assert math.isclose(pair["median_step_ratio"], t["median_step_ms"] / c["median_step_ms"])
    assert result["median_steps_ratio"] == pair["steps_ratio"]
    assert len(result["reward_curves"]["conveyor"]) == len(result["reward_curves"]["trl"]) == 2
    assert set(result["runs"]["conveyor"][0]["stage_s"]) >= {"gen", "update_actor"}
    for text in (
        "ratio c/t",
        "median over pairs of the ratio conveyor/TRL",
        "reward per step",
        "target median steps/s ratio",
    ):
        assert text in out, text


def test_summarize_run_leaves_out_the_warmup_steps() -> None:
    run = {
        "step_s": [5.0, 0.5, 0.25, 0.25],
        "cpu_s": [4.0, 0.2, 0.2, 0.2],
        "tokens": [100.0, 40.0, 30.0, 30.0],
        "reward": [0.0, 0.2, 0.4, 0.6],
        "peak_rss_bytes": 3 * 2**20,
    }
    s = load_benchmark().summarize_run(run, warmup=1)
    assert s["timed_steps"] == 3
    assert s["steps_per_s"] == pytest.approx(3 / 1.0)
    assert s["tokens_per_s"] == pytest.approx(100 / 1.0)
    assert s["cpu_steps_per_s"] == pytest.approx(3 / 0.6)
    assert s["median_step_ms"] == pytest.approx(250.0)
    assert s["peak_rss_mib"] == pytest.approx(3.0)
    assert s["mean_reward"] == pytest.approx(0.3)


def test_reward_check_compares_second_halves_within_two_standard_errors() -> None:
    bench = load_benchmark()
    # One run per side: second halves conveyor [0.5, 0.7] (mean 0.6), TRL [0.6, 0.6] (mean 0.6, no spread).
    check = bench.reward_check([[0.0, 0.1, 0.5, 0.7]], [[0.0, 0.1, 0.6, 0.6]])
    assert check["from_step"] == 3 and check["basis"] == "steps"
    assert check["difference"] == pytest.approx(0.0)
    # se(conveyor) = stdev([0.5, 0.7]) / sqrt(2) = 0.1414.../1.4142... = 0.1
    assert check["tolerance"] == pytest.approx(0.2)
    assert check["no_worse"]
    worse = bench.reward_check([[0.9, 0.9, 0.1, 0.1]], [[0.0, 0.0, 0.5, 0.5]])
    assert worse["difference"] == pytest.approx(-0.4) and worse["tolerance"] == 0.0 and not worse["no_worse"]


def test_reward_check_over_several_runs_uses_the_spread_of_their_late_rewards() -> None:
    bench = load_benchmark()
    # Late rewards: conveyor runs 0.4 and 0.6 (mean 0.5, se 0.1); TRL runs 0.8 and 0.8 (no spread).
    conveyor = [[0.0, 0.0, 0.4, 0.4], [0.0, 0.0, 0.6, 0.6]]
    trl = [[0.0, 0.0, 0.8, 0.8], [0.0, 0.0, 0.8, 0.8]]
    check = bench.reward_check(conveyor, trl)
    assert check["basis"] == "runs"
    assert check["conveyor_late"] == pytest.approx(0.5) and check["trl_late"] == pytest.approx(0.8)
    assert check["tolerance"] == pytest.approx(0.2)
    assert not check["no_worse"]  # 0.3 below, more than two standard errors
    close = bench.reward_check([[0.0, 0.0, 0.55, 0.55], [0.0, 0.0, 0.75, 0.75]], trl)
    assert close["difference"] == pytest.approx(-0.15) and close["no_worse"]


def test_shared_config_makes_one_optimizer_step_per_batch() -> None:
    bench = load_benchmark()
    cfg = bench.shared_config(
        bench.parse_args(
            [
                "--batch",
                "4",
                "--n",
                "3",
                "--max-new-tokens",
                "5",
                "--lr",
                "0.01",
                "--steps",
                "7",
                "--seed",
                "3",
                *TINY_TASK,
            ]
        )
    )
    arr = cfg.actor_rollout_ref
    assert cfg.data.train_batch_size == 4 and arr.rollout.n == 3 and cfg.data.max_response_length == 5
    assert arr.actor.ppo_mini_batch_size == 4 and arr.actor.ppo_epochs == 1
    assert arr.actor.ppo_micro_batch_size_per_gpu == 12
    assert arr.actor.optim.lr == 0.01 and arr.rollout.temperature == 1.0
    assert cfg.trainer.total_training_steps == 7 and cfg.trainer.seed == 3
    from conveyor.trainer.plan import build_run_plan

    plan = build_run_plan(cfg, "cpu")
    assert not plan.use_reference and not plan.use_critic
    assert arr.model.tiny.warmstart_steps == 0 and cfg.transfer_queue.backend == "memory"


def test_ordered_prompts_follow_the_trainer_order() -> None:
    from conveyor.tasks.dataset import PromptDataset
    from conveyor.trainer.setup import load_prompt_records

    bench = load_benchmark()
    cfg = bench.shared_config(bench.parse_args(["--batch", "5", *TINY_TASK]))
    records = bench.ordered_prompt_records(cfg, steps=3)
    data = PromptDataset(load_prompt_records(cfg)[0], seed=cfg.data.seed)
    assert records == data.next_batch(5) + data.next_batch(5) + data.next_batch(5)


def test_score_recorder_scores_with_the_registered_reward() -> None:
    recorder = load_benchmark().ScoreRecorder()
    scores = recorder(
        prompts=["23+45="] * 3,
        completions=["68", "60", "x"],
        completion_ids=[[1, 2, 3], [1, 2], [1]],
        data_source=["synthetic/arithmetic"] * 3,
        ground_truth=["68"] * 3,
    )
    # Exact: 1.0; "60" vs "68": one of two right-aligned digits right, 0.5 * 1/2; not a number: 0.
    assert scores == [1.0, 0.25, 0.0]
    assert recorder.rewards == [pytest.approx(statistics.fmean([1.0, 0.25, 0.0]))]
    assert recorder.tokens == [6.0]


@pytest.mark.parametrize(
    "bad",
    [
        ["--steps", "0"],
        ["--steps", "2", "--warmup", "2"],
        ["--pairs", "0"],
        ["--batch", "0"],
        ["--lr", "0"],
        ["--threads", "-1"],
    ],
)
def test_bad_flags_are_rejected(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        load_benchmark().parse_args(bad)
