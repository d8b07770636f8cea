"""Tests for PromptEncoder: the prompt fields of a batch, the same whoever renders them and whatever share."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conveyor.tasks.prompts import PromptEncoder, sample_keys, uid_of
from conveyor.tasks.synthetic import ARITHMETIC_ALPHABET, make_arithmetic_records


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    chars = sorted(set(ARITHMETIC_ALPHABET))
    tok = Tokenizer(
        models.WordLevel({"<pad>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


def test_a_shares_fields_are_the_rows_of_the_whole_batchs(tokenizer) -> None:
    records = make_arithmetic_records(5, seed=3)
    records[1] = {**records[1], "prompt": [{"role": "user", "content": "7+1="}]}  # a shorter prompt: left padding
    uids = [f"batch-2/p{i}" for i in range(5)]
    keys = sample_keys(uids, 3)
    assert keys[:4] == ["batch-2/p0/s0", "batch-2/p0/s1", "batch-2/p0/s2", "batch-2/p1/s0"]
    assert [uid_of(k) for k in keys] == [u for u in uids for _ in range(3)]
    encoder = PromptEncoder(tokenizer, max_prompt_length=32, truncation="error")
    whole, lengths = encoder.fields(records, uids, [i for i in range(5) for _ in range(3)])
    width = whole["prompts"].shape[1]
    assert (
        lengths[3] == 4
        and lengths[3] < width
        and whole["prompt_mask"][3].tolist()[: width - 4] == [False] * (width - 4)
    )
    by_uid = dict(zip(uids, records))
    # Another process's encoder, over a share in any order, padded to the batch's width: the same rows.
    share = [7, 0, 13, 4]
    fields, share_lengths = PromptEncoder(tokenizer, 32, "error").for_keys([keys[i] for i in share], by_uid, width)
    assert share_lengths == [lengths[i] for i in share]
    for name, value in fields.items():
        expected = (
            whole[name][torch.tensor(share)] if isinstance(value, torch.Tensor) else [whole[name][i] for i in share]
        )
        assert torch.equal(value, expected) if isinstance(value, torch.Tensor) else value == expected, name
    assert fields["uid"] == [uids[2], uids[0], uids[4], uids[1]]
    assert fields["ground_truth"] == [str(records[i]["reward_model"]["ground_truth"]) for i in (2, 0, 4, 1)]


def test_too_long_prompts_are_cut_or_refused_naming_the_prompt(tokenizer) -> None:
    (record,) = make_arithmetic_records(1, seed=0)
    text = record["prompt"][0]["content"]
    ids = PromptEncoder(tokenizer, 64, "error").encode([record])[1][0]
    assert len(ids) == len(text)
    assert PromptEncoder(tokenizer, 3, "left").encode([record])[1][0] == ids[-3:]
    assert PromptEncoder(tokenizer, 64, "error").longest([record]) == len(text)
    assert PromptEncoder(tokenizer, 3, "error").longest([record]) == 3
    with pytest.raises(ValueError, match="data.max_prompt_length=3"):
        PromptEncoder(tokenizer, 3, "error").encode([record])
