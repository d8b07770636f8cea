"""`conveyor build-reward-models`: a small reward model that tells right answers from wrong ones better than chance,
a format judge, and two training steps of each example config that uses them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.cli import main
from conveyor.config import load_config
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.models.build_scorers import build_judge, build_reward_model, wrong_answer
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.tasks.synthetic import make_arithmetic_records
from conveyor.trainer.run import run_training

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """Both scorers, written by the command (a short reward-model training)."""
    out = tmp_path_factory.mktemp("reward_models")
    assert main(["build-reward-models", "--out", str(out), "--rm-steps", "150"]) == 0
    return out


def test_a_wrong_answer_is_never_the_right_one() -> None:
    rng = random.Random(0)
    for truth in ("0", "7", "11", "94", "131", "-5"):
        for _ in range(50):
            wrong = wrong_answer(truth, rng)
            assert wrong != truth and wrong.lstrip("-").isdigit()


def test_the_reward_model_tells_right_from_wrong_on_held_out_problems(tmp_path) -> None:
    train = make_arithmetic_records(400, seed=0, split="train")
    heldout = make_arithmetic_records(100, seed=1, split="test")
    report = build_reward_model(tmp_path / "rm", train, heldout, steps=150)
    assert report.heldout_pairs == 200
    assert report.heldout_accuracy > 0.55  # chance is 0.5: half the held-out answers are right
    assert (tmp_path / "rm" / "config.json").is_file() and (tmp_path / "rm" / "tokenizer.json").is_file()


def test_the_judge_says_yes_after_a_digit_and_no_otherwise(tmp_path) -> None:
    path = build_judge(tmp_path / "judge")
    tok = build_char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(path))
    template = (path / "template.txt").read_text()
    for response, want in (("94", "yes"), ("9", "yes"), ("", "no"), ("9a", "no"), ("=", "no")):
        text = template.format(question="70+24=", response=response)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == want, response


@pytest.mark.process  # a training run
@pytest.mark.parametrize("example", ["reward_model_tiny.yaml", "judge_tiny.yaml"])
def test_the_example_trains_two_steps_with_the_built_scorer(tmp_path, tiny_run, built, example) -> None:
    paths = {
        "reward_model_tiny.yaml": [f"reward_model.model.path={built / 'reward_model'}"],
        "judge_tiny.yaml": [
            f"reward_model.judge.model.path={built / 'judge'}",
            f"reward_model.judge.prompt_template={built / 'judge' / 'template.txt'}",
        ],
    }[example]
    cfg = load_config(EXAMPLES / example, tiny_run + paths)
    run_training(cfg)
    rows = [r for r in read_metrics_jsonl(Path(cfg.trainer.default_local_dir) / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    key = "reward/model_score" if example.startswith("reward_model") else "reward/judge_score"
    assert all(key in r for r in rows)
    if key == "reward/judge_score":
        assert all(r["reward/judge_unparsable_frac"] == 0.0 for r in rows)
