"""Tests for the character-level tokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from conveyor.models.tokenizer import CHAT_TEMPLATE, DEFAULT_ALPHABET, SPECIAL_TOKENS, build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_special_token_ids(tok) -> None:
    assert (tok.pad_token, tok.eos_token, tok.bos_token, tok.unk_token) == ("<pad>", "<eos>", "<bos>", "<unk>")
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == len(SPECIAL_TOKENS) + len(DEFAULT_ALPHABET)


def test_each_character_is_one_token_in_alphabet_order(tok) -> None:
    # Hand-computed: ids are 4 + the character's index in the alphabet.
    alphabet = "0123456789+-=#ab "
    t = build_char_tokenizer(alphabet)
    assert t("12+3=15")["input_ids"] == [5, 6, 14, 7, 16, 5, 9]
    assert t("#### 1")["input_ids"] == [17, 17, 17, 17, 20, 5]
    assert t("ba")["input_ids"] == [19, 18]
    # No BOS/EOS is added: a prompt encodes to exactly its characters.
    assert len(tok("hello world")["input_ids"]) == len("hello world")


def test_default_alphabet_covers_gsm8k_style_answers(tok) -> None:
    text = "natalia sold 48 clips. 48/2 = 24.\n#### 72"
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_unknown_characters_map_to_unk_and_specials_are_recognised(tok) -> None:
    ids = tok("1A2<eos>")["input_ids"]
    assert ids == [tok.convert_tokens_to_ids("1"), 3, tok.convert_tokens_to_ids("2"), 1]
    assert tok.decode(ids, skip_special_tokens=True) == "12"
    assert tok.decode(ids) == "1<unk>2<eos>"


def test_pads_on_the_left(tok) -> None:
    enc = tok(["1+2=", "12+34="], padding=True, return_tensors="pt")
    assert tok.padding_side == "left"
    assert enc["input_ids"][0, :2].tolist() == [0, 0]
    assert enc["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]


def test_chat_template_concatenates_contents(tok) -> None:
    messages = [{"role": "system", "content": "add. "}, {"role": "user", "content": "1+2="}]
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template(messages, tokenize=False) == "add. 1+2="
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "add. 1+2="


def test_round_trip_through_save_pretrained(tok, tmp_path) -> None:
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "what is 12*3? #### 36\n"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    for name in ("pad_token", "eos_token", "bos_token", "unk_token"):
        assert getattr(loaded, name) == getattr(tok, name)
        assert getattr(loaded, name + "_id") == getattr(tok, name + "_id")
    assert loaded.padding_side == "left"
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded.model_max_length == tok.model_max_length == 512
    assert len(loaded) == len(tok)


def test_model_max_length_is_kept() -> None:
    assert build_char_tokenizer("ab", model_max_length=64).model_max_length == 64


@pytest.mark.parametrize(
    ("alphabet", "kwargs", "match"),
    [("", {}, "alphabet"), ("abca", {}, "repeats"), ("ab", {"model_max_length": 0}, "model_max_length")],
)
def test_bad_arguments_raise(alphabet, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_char_tokenizer(alphabet, **kwargs)
