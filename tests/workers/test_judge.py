"""The generative judge: a tiny judge model built from config whose answers are known (a bigram chain written into
its weights), served by the hf engine; parsing, retries, the unparsable policy and the weighted sum."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reward_batches import ALWAYS_MAYES, MAYBE_YES, put_batch, save_chain_judge

from conveyor.config import ConfigError, load_config
from conveyor.data_plane import make_data_plane
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.workers.ranks.judge import JudgeWorker, UnparsableJudgementError, judge_settings, parse_judgement

TEMPLATE = "question: {question}\nresponse: {response}\ntruth: {ground_truth}\nverdict:"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("judge") / "template.txt"
    path.write_text(TEMPLATE)
    return path


def _worker(path: Path, template: Path, *overrides: str):
    cfg = load_config(
        None,
        [
            "reward_model.judge.enable=true",
            f"reward_model.judge.model.path={path}",
            f"reward_model.judge.prompt_template={template}",
            "reward_model.judge.parser=yes_no",
            "reward_model.judge.max_new_tokens=8",
            *overrides,
        ],
    )
    dp = make_data_plane("memory")
    tok = build_char_tokenizer()
    return JudgeWorker(judge_settings(cfg), policy_tokenizer=tok, data_plane=dp), dp, tok


def test_the_parsers() -> None:
    assert parse_judgement("fine. <score> 7.5 </score>", "tag") == 7.5
    assert parse_judgement("<grade>-2</grade><score>x</score>", "tag", "grade") == -2.0
    assert parse_judgement("score: 7", "tag") is None
    assert parse_judgement("Yes, it is.", "yes_no") == 1.0
    assert parse_judgement("no", "yes_no") == 0.0
    assert parse_judgement("yesterday nothing", "yes_no") is None


def test_unparsable_judgements_are_retried_then_scored_and_summed(tmp_path, template) -> None:
    judge, dp, tok = _worker(
        save_chain_judge(tmp_path / "j", MAYBE_YES),
        template,
        "reward_model.judge.max_retries=12",
        "reward_model.rule_weight=1.0",
        "reward_model.judge.weight=2.0",
        "reward_model.judge.micro_batch_size=4",  # two engine calls per attempt for the 6 samples
    )
    assert judge.judge([tok("x verdict:", add_special_tokens=False)["input_ids"]], attempt=0) == ["mayes"]
    meta = put_batch(dp, tok)
    out = judge.compute_judge_score(meta)
    td = dp.kv_batch_get(keys=meta.keys, partition_id="p", select_fields=["rm_judge_score", "rm_scores"])
    # Greedy says "mayes" for every sample; the resamples say "yes" half the time: all are parsed within 12 tries.
    assert td["rm_judge_score"].tolist() == [1.0] * 6
    info = out.extra_info
    assert info["reward/judge_unparsable_frac@sum"] == 0
    assert info["reward/judge_retries_per_sample@sum"] >= 6  # every sample was tried again at least once
    rule = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.5])
    torch.testing.assert_close(td["rm_scores"].sum(-1), (rule + 2.0) * (td["rm_scores"].sum(-1) != 0))


def test_a_judgement_that_stays_unparsable_is_counted_or_stops_the_run(tmp_path, template) -> None:
    path = save_chain_judge(tmp_path / "j", ALWAYS_MAYES)
    judge, dp, tok = _worker(
        path, template, "reward_model.judge.unparsable_score=-1.0", "reward_model.judge.max_retries=1"
    )
    meta = put_batch(dp, tok)
    out = judge.compute_judge_score(meta)
    scores = dp.kv_batch_get(keys=meta.keys, partition_id="p", select_fields=["rm_judge_score"])["rm_judge_score"]
    assert scores.tolist() == [-1.0] * 6
    assert out.extra_info["reward/judge_unparsable_frac@sum"] == 6
    assert out.extra_info["reward/judge_retries_per_sample@sum"] == 6
    judge, dp, tok = _worker(path, template, "reward_model.judge.on_unparsable=error")
    with pytest.raises(UnparsableJudgementError, match=r"sample 'p/p0/s0'.*'mayes'.*on_unparsable=score"):
        judge.compute_judge_score(put_batch(dp, tok))


def test_the_judge_never_takes_the_actors_weights_and_errors_name_keys(tmp_path, template) -> None:
    path = save_chain_judge(tmp_path / "j", ALWAYS_MAYES)
    judge, _, _ = _worker(path, template)
    # The hf engine samples from the judge's own module, loaded from its checkpoint (no weight endpoint exists).
    assert judge.engine.model is not None and not hasattr(judge, "receive_weights")
    with pytest.raises(ConfigError, match="reward_model.judge.model.path"):
        load_config(None, ["reward_model.judge.enable=true"])
    bad = tmp_path / "bad.txt"
    bad.write_text("rate {answer}")
    with pytest.raises(ValueError, match="reward_model.judge.prompt_template"):
        _worker(path, bad)
    bad.write_text("is {question} answered by {ground_truth}?")  # the response never shown
    with pytest.raises(ValueError, match="never shows the judge the response: put {response} in it"):
        _worker(path, bad)


@pytest.mark.slow  # a vLLM engine on the CPU: a minute or more to start
def test_a_judge_on_the_vllm_engine_answers_from_its_own_checkpoint(tmp_path, template) -> None:
    """vLLM builds from dummy weights; the judge loads its checkpoint into it once (random weights would not parse)."""
    pytest.importorskip("vllm")
    judge, dp, tok = _worker(
        save_chain_judge(tmp_path / "j", MAYBE_YES),
        template,
        "reward_model.judge.engine=vllm",
        "reward_model.judge.max_retries=12",
        "actor_rollout_ref.rollout.max_num_seqs=8",
    )
    try:
        meta = put_batch(dp, tok)
        out = judge.compute_judge_score(meta)
        scores = dp.kv_batch_get(keys=meta.keys, partition_id="p", select_fields=["rm_judge_score"])["rm_judge_score"]
        assert scores.tolist() == [1.0] * 6
        assert out.extra_info["reward/judge_unparsable_frac@sum"] == 0
    finally:
        judge.close()


def test_a_judge_whose_context_cannot_hold_its_template_is_refused_at_start(tmp_path, template, caplog) -> None:
    path = save_chain_judge(tmp_path / "j", ALWAYS_MAYES)
    # The template alone renders to about 50 tokens of the character tokenizer: 30 positions cannot hold it.
    with pytest.raises(ValueError, match=r"reward_model.judge.prompt_template: the judge's context is 30 tokens"):
        _worker(path, template, "actor_rollout_ref.rollout.max_model_len=30")
    # 80 hold the template and a judgement, but not the longest prompt and response too: said once, at start.
    with caplog.at_level("WARNING", logger="conveyor.workers.ranks.judge"):
        _worker(path, template, "actor_rollout_ref.rollout.max_model_len=80")
    assert any("cannot be judged" in r.getMessage() for r in caplog.records)
