"""The reward-model worker against a separately loaded Hugging Face model: the same scores, whatever the batching,
the tokenizer or the number of fsdp2 ranks; and the declared rule that sums them with the rule reward."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reward_batches import other_tokenizer, put_batch, reference_scores, save_reward_model

from conveyor.config import ConfigError, load_config
from conveyor.data_plane import make_data_plane
from conveyor.models.reward_model import load_reward_model, save_value_head_model, sequence_scores
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.models.value_head import ValueModel
from conveyor.workers.ranks.reward_model import RewardModelWorker, reward_model_settings

RANKS_SCRIPT = Path(__file__).with_name("reward_model_ranks.py")


@pytest.fixture(scope="module")
def policy_tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def same_rm(tmp_path_factory, policy_tok) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("rm_same"), policy_tok, seed=1)


@pytest.fixture(scope="module")
def other_rm(tmp_path_factory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("rm_other"), other_tokenizer(), seed=2)


def _worker(path: Path, policy_tok, *overrides: str, world_size: int = 1, rank: int = 0):
    cfg = load_config(None, ["reward_model.enable=true", f"reward_model.model.path={path}", *overrides])
    dp = make_data_plane("memory")
    worker = RewardModelWorker(
        reward_model_settings(cfg), policy_tokenizer=policy_tok, data_plane=dp, rank=rank, world_size=world_size
    )
    return worker, dp


def _run(worker, dp, policy_tok) -> dict[str, torch.Tensor]:
    meta = put_batch(dp, policy_tok)
    out = worker.compute_rm_score(meta)
    assert {"rm_scores", "rm_model_score", "rm_rule_score"} <= set(out.fields)
    td = dp.kv_batch_get(
        keys=meta.keys,
        partition_id=meta.partition_id,
        select_fields=["rm_scores", "rm_model_score", "rm_rule_score", "response_mask"],
    )
    return {**dict(td.items()), "metrics": out.extra_info}


@pytest.mark.parametrize(
    "batching",
    [
        ["reward_model.micro_batch_size_per_gpu=1"],
        ["reward_model.micro_batch_size_per_gpu=4"],
        ["reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=60"],
    ],
    ids=["one-per-forward", "four-per-forward", "token-budget"],
)
def test_scores_equal_a_separately_loaded_model(same_rm, policy_tok, batching) -> None:
    worker, dp = _worker(same_rm, policy_tok, *batching)
    assert not worker.retokenize  # the policy's tokenizer: its ids are scored as they are
    got = _run(worker, dp, policy_tok)
    want = reference_scores(same_rm, policy_tok)
    assert want.std() > 0.05  # the samples score differently: a mix-up of rows would show
    torch.testing.assert_close(got["rm_model_score"], want, atol=1e-5, rtol=1e-5)


def test_the_reward_is_the_declared_weighted_sum_on_the_last_response_token(same_rm, policy_tok) -> None:
    worker, dp = _worker(same_rm, policy_tok, "reward_model.model_weight=0.5", "reward_model.rule_weight=2.0")
    got = _run(worker, dp, policy_tok)
    model, rule = got["rm_model_score"], got["rm_rule_score"]
    torch.testing.assert_close(rule, torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.5]))
    lengths = got["response_mask"].sum(-1)
    scores = got["rm_scores"]
    for i, n in enumerate(lengths.tolist()):
        if n == 0:  # an empty response has no token to carry its reward
            assert scores[i].abs().sum() == 0
            continue
        assert scores[i, n - 1] == pytest.approx(0.5 * float(model[i]) + 2.0 * float(rule[i]), abs=1e-6)
        assert scores[i].sum() == pytest.approx(float(scores[i, n - 1]), abs=1e-6)
    info = got["metrics"]
    assert info["reward/model_score@sum"] == pytest.approx(float(model.sum()), abs=1e-5)
    assert info["reward/rule_score@sum"] == pytest.approx(3.5)
    assert info["reward/model_score@count"] == 6


def test_a_reward_model_with_its_own_tokenizer_scores_the_re_tokenized_conversation(other_rm, policy_tok) -> None:
    worker, dp = _worker(other_rm, policy_tok, "reward_model.micro_batch_size_per_gpu=3")
    assert worker.retokenize
    got = _run(worker, dp, policy_tok)
    torch.testing.assert_close(got["rm_model_score"], reference_scores(other_rm, policy_tok, other_tokenizer()))


def test_max_length_keeps_the_end_of_a_long_sequence_and_counts_it(other_rm, policy_tok) -> None:
    worker, dp = _worker(other_rm, policy_tok, "reward_model.max_length=12")
    got = _run(worker, dp, policy_tok)
    want = reference_scores(other_rm, policy_tok, other_tokenizer(), max_length=12)
    torch.testing.assert_close(got["rm_model_score"], want)
    # Every rendered conversation but "u|9-5=\na|4\n" (11 tokens) is longer than 12 tokens.
    assert got["metrics"]["reward/model_truncated_frac@sum"] == 5


def test_a_causal_lm_with_a_value_head_scores_its_last_token(tmp_path, policy_tok) -> None:
    base = build_tiny_model("qwen3", policy_tok, seed=3)
    value = ValueModel.from_causal_lm(base)
    torch.nn.init.normal_(value.value_head.weight, std=1.0)
    save_value_head_model(value, base, tmp_path)
    policy_tok.save_pretrained(str(tmp_path))
    worker, dp = _worker(tmp_path, policy_tok)
    assert isinstance(worker.model, ValueModel)
    got = _run(worker, dp, policy_tok)
    loaded = load_reward_model(tmp_path)
    torch.testing.assert_close(loaded.value_head.weight, value.value_head.weight)
    want = reference_scores_value(value, policy_tok, dp)
    torch.testing.assert_close(got["rm_model_score"], want, atol=1e-5, rtol=1e-5)


def reference_scores_value(value: ValueModel, tok, dp) -> torch.Tensor:
    """The value model's value at the last token of each prompt + response, one unpadded row at a time."""
    td = dp.kv_batch_get(
        keys=dp.kv_list("p"), partition_id="p", select_fields=["prompts", "prompt_mask", "responses", "response_mask"]
    )
    out = []
    for i in range(len(td)):
        ids = (
            td["prompts"][i][td["prompt_mask"][i].bool()].tolist()
            + td["responses"][i][td["response_mask"][i].bool()].tolist()
        )
        ids_t = torch.tensor([ids])
        with torch.no_grad():
            out.append(float(sequence_scores(value, ids_t, torch.ones_like(ids_t))[0]))
    return torch.tensor(out)


def test_two_fsdp2_ranks_score_as_one_rank(tmp_path, same_rm, policy_tok) -> None:
    """Two gloo ranks under fsdp2 (shards filled from rank 0, uneven shares): the one-rank scores, row for row."""
    one, dp = _worker(same_rm, policy_tok, "reward_model.micro_batch_size_per_gpu=1")
    want = _run(one, dp, policy_tok)["rm_model_score"]
    spec = {"world": 2, "model_path": str(same_rm), "out": str(tmp_path)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, str(RANKS_SCRIPT), str(tmp_path / "spec.json")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = torch.zeros_like(want)
    for rank in range(2):
        part = torch.load(tmp_path / f"scores_{rank}.pt")
        assert part["strategy"] == "fsdp2" and part["sharded"]
        got[part["rows"]] = part["scores"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_config_errors_name_the_key(tmp_path, policy_tok, same_rm) -> None:
    with pytest.raises(ConfigError, match="reward_model.model.path"):
        load_config(None, ["reward_model.enable=true"])
    # A classifier of two labels is not a reward model.
    model = save_reward_model(tmp_path / "two", policy_tok, num_labels=2)
    with pytest.raises(ValueError, match="2 labels"):
        load_reward_model(model)
    (tmp_path / "lm").mkdir()
    build_tiny_model("qwen3", policy_tok).save_pretrained(str(tmp_path / "lm"))
    with pytest.raises(ValueError, match="reward_model.model.path"):
        load_reward_model(tmp_path / "lm")
    # The loaders' own advice names the actor's keys: the reward model's errors name its own.
    with pytest.raises(ValueError, match=r"^reward_model.model.path='/nowhere': .*set reward_model.model.path"):
        load_reward_model("/nowhere")
    with pytest.raises(ValueError, match=r"^reward_model.model.tokenizer_path=") as info:
        _worker(same_rm, policy_tok, f"reward_model.model.tokenizer_path={tmp_path / 'lm'}")
    assert "actor_rollout_ref" not in str(info.value)
