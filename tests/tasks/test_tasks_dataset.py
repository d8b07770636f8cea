"""Tests for PromptDataset (epochs, resume), render_prompt and check_prompt_length."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conveyor.tasks.dataset import PromptDataset, check_prompt_length, render_prompt
from conveyor.tasks.synthetic import ARITHMETIC_ALPHABET, make_arithmetic_records


def _records(n: int) -> list[dict]:
    return [
        {
            "data_source": "synthetic/arithmetic",
            "prompt": [{"role": "user", "content": f"{i}+0="}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]


def _ids(batch: list[dict]) -> list[int]:
    return [r["extra_info"]["index"] for r in batch]


def test_each_epoch_is_a_permutation_and_epochs_differ() -> None:
    ds = PromptDataset(_records(12), seed=0)
    assert len(ds) == 12
    e0 = _ids(ds.next_batch(12))
    assert ds.epoch == 0 and ds.position == 12
    e1 = _ids(ds.next_batch(12))
    assert ds.epoch == 1
    assert sorted(e0) == sorted(e1) == list(range(12))
    assert e0 != e1
    assert e0 != list(range(12))  # shuffled, not in file order


def test_determinism_and_seed_plus_epoch_rule() -> None:
    a = PromptDataset(_records(10), seed=5)
    b = PromptDataset(_records(10), seed=5)
    c = PromptDataset(_records(10), seed=6)
    seq_a = [_ids(a.next_batch(3)) for _ in range(9)]
    seq_b = [_ids(b.next_batch(3)) for _ in range(9)]
    assert seq_a == seq_b
    # Epoch e is shuffled with seed + e, so seed 5's second epoch is seed 6's first.
    flat_a = [i for batch in seq_a for i in batch]
    assert flat_a[10:20] == _ids(c.next_batch(10))
    assert flat_a[:10] != flat_a[10:20]


def test_without_shuffle_every_epoch_is_the_file_order() -> None:
    """data.shuffle=false: records come in the order they were given, epoch after epoch."""
    records = [{"i": i} for i in range(5)]
    ds = PromptDataset(records, seed=3, shuffle=False)
    assert [r["i"] for r in ds.next_batch(12)] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert [r["i"] for r in PromptDataset(records, seed=3).next_batch(5)] != [0, 1, 2, 3, 4]


def test_batch_crossing_an_epoch_boundary() -> None:
    ds = PromptDataset(_records(10), seed=1)
    ref = PromptDataset(_records(10), seed=1)
    e0, e1 = _ids(ref.next_batch(10)), _ids(ref.next_batch(10))
    assert _ids(ds.next_batch(4)) == e0[:4]
    assert _ids(ds.next_batch(4)) == e0[4:8]
    assert _ids(ds.next_batch(4)) == e0[8:] + e1[:2]
    assert ds.state_dict()["epoch"] == 1 and ds.state_dict()["position"] == 2
    # A batch bigger than the dataset spans several epochs.
    big = PromptDataset(_records(3), seed=0)
    assert len(big.next_batch(7)) == 7 and big.epoch == 2 and big.position == 1


@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 7])
def test_resume_equals_uninterrupted(k: int) -> None:
    records = _records(10)
    uninterrupted = PromptDataset(records, seed=3)
    expected = [_ids(uninterrupted.next_batch(4)) for _ in range(k + 6)]

    first = PromptDataset(records, seed=3)
    for _ in range(k):
        first.next_batch(4)
    # The state must survive a trip through a checkpoint file.
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptDataset(records, seed=3)
    resumed.load_state_dict(state)
    assert [_ids(resumed.next_batch(4)) for _ in range(6)] == expected[k:]


def test_resume_at_exact_epoch_end() -> None:
    records = _records(8)
    full = PromptDataset(records, seed=0)
    expected = _ids(full.next_batch(8)) + _ids(full.next_batch(8))
    first = PromptDataset(records, seed=0)
    first.next_batch(8)
    assert first.state_dict() == {"epoch": 0, "position": 8, "seed": 0, "num_records": 8}
    resumed = PromptDataset(records, seed=0)
    resumed.load_state_dict(first.state_dict())
    assert _ids(resumed.next_batch(8)) == expected[8:]


def test_state_mismatch_is_an_error() -> None:
    ds = PromptDataset(_records(5), seed=0)
    ds.next_batch(2)
    state = ds.state_dict()
    with pytest.raises(ValueError, match=r"num_records=5 but this dataset has 6"):
        PromptDataset(_records(6), seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seed=0 but this dataset has seed=1"):
        PromptDataset(_records(5), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"position=9"):
        PromptDataset(_records(5), seed=0).load_state_dict({"epoch": 0, "position": 9})
    with pytest.raises(ValueError, match=r"lacks key\(s\) \['position'\]"):
        PromptDataset(_records(5), seed=0).load_state_dict({"epoch": 0})


def test_batches_are_copies() -> None:
    ds = PromptDataset(_records(2), seed=0)
    batch = ds.next_batch(2)
    batch[0]["prompt"][0]["content"] = "changed"
    batch[1]["extra_info"]["index"] = -1
    later = ds.next_batch(2)
    assert sorted(_ids(later)) == [0, 1]
    assert all(r["prompt"][0]["content"] != "changed" for r in later)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="records is empty"):
        PromptDataset([], seed=0)
    with pytest.raises(ValueError, match="seed must be an int"):
        PromptDataset(_records(2), seed=None)  # type: ignore[arg-type]
    ds = PromptDataset(_records(2), seed=0)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            ds.next_batch(bad)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def char_tokenizer() -> PreTrainedTokenizerFast:
    chars = sorted(set(ARITHMETIC_ALPHABET + "<>/abcdefghijklmnopqrstuvwxyz \n"))
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_render_without_template_is_the_bare_expression(char_tokenizer: PreTrainedTokenizerFast) -> None:
    rec = {"prompt": [{"role": "user", "content": "23+45="}]}
    assert render_prompt(rec) == "23+45="
    assert char_tokenizer.chat_template is None
    assert render_prompt(rec, char_tokenizer) == "23+45="
    multi = {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]}
    assert render_prompt(multi) == "be brief\n1+1="
    (synthetic,) = make_arithmetic_records(1, seed=0)
    assert render_prompt(synthetic, char_tokenizer) == synthetic["prompt"][0]["content"]


def test_render_with_chat_template(char_tokenizer: PreTrainedTokenizerFast) -> None:
    tok = PreTrainedTokenizerFast(tokenizer_object=char_tokenizer.backend_tokenizer, unk_token="<unk>")
    tok.chat_template = _TEMPLATE
    rec = {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "23+45="}]}
    assert render_prompt(rec, tok) == "<system>be brief</system>\n<user>23+45=</user>\n<assistant>"


def test_render_rejects_non_message_prompt() -> None:
    with pytest.raises(ValueError, match=r"record\['prompt'\] must be a list of chat messages"):
        render_prompt({"prompt": "23+45="})
    with pytest.raises(ValueError, match=r"record\['prompt'\]"):
        render_prompt({"prompt": [{"role": "user"}]})


def test_check_prompt_length_modes() -> None:
    ids = [10, 11, 12, 13, 14]
    assert check_prompt_length(ids, 5, "error") == ids
    assert check_prompt_length(ids, 8, "left") == ids
    assert check_prompt_length(ids, 3, "left") == [12, 13, 14]
    assert check_prompt_length(ids, 3, "right") == [10, 11, 12]
    out = check_prompt_length(ids, 5, "right")
    assert out == ids and out is not ids
    with pytest.raises(ValueError) as info:
        check_prompt_length(ids, 4, "error")
    msg = str(info.value)
    assert "5 tokens" in msg and "data.max_prompt_length=4" in msg and "data.truncation=left" in msg


def test_check_prompt_length_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"data.truncation must be one of \('error', 'left', 'right'\), got 'middle'"):
        check_prompt_length([1], 4, "middle")
    with pytest.raises(ValueError, match="data.max_prompt_length must be a positive int"):
        check_prompt_length([1], 0, "left")
