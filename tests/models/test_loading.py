"""Tests for loading and saving local checkpoints."""

from __future__ import annotations

import logging

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from conveyor.models.loading import load_causal_lm, load_tokenizer, resolve_dtype, save_pretrained_checkpoint
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = build_char_tokenizer()
    model = build_tiny_model("qwen3_moe", tok, seed=3)
    path = save_pretrained_checkpoint(model, tok, tmp_path_factory.mktemp("ckpt") / "nested" / "tiny")
    return model, tok, path


def test_round_trip_gives_same_logits_and_ids(checkpoint) -> None:
    model, tok, path = checkpoint
    assert (path / "config.json").is_file()
    loaded = load_causal_lm(path)
    loaded_tok = load_tokenizer(path)
    text = ["12+30=", "7*8="]
    enc = tok(text, padding=True, return_tensors="pt")
    assert loaded_tok(text, padding=True, return_tensors="pt")["input_ids"].tolist() == enc["input_ids"].tolist()
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    assert next(loaded.parameters()).dtype == torch.float32
    model.eval()
    loaded.eval()
    with torch.no_grad():
        expected = model(**enc).logits
        got = loaded(**enc).logits
    assert torch.equal(got, expected)


def test_dtype_and_attn_implementation(checkpoint) -> None:
    _, _, path = checkpoint
    loaded = load_causal_lm(path, dtype="bf16", attn_implementation="eager")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.config._attn_implementation == "eager"


def test_missing_path_names_path_and_key(tmp_path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"nope.*actor_rollout_ref\.model\.path"):
        load_causal_lm(missing)
    with pytest.raises(ValueError, match=r"nope.*actor_rollout_ref\.model\.path"):
        load_tokenizer(missing)


def test_directory_without_config_names_path_and_key(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"config\.json.*actor_rollout_ref\.model\.path"):
        load_causal_lm(tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        load_causal_lm(tmp_path / "weights.bin")


def _tokenizer_without_pad(tmp_path, *, eos: bool):
    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1, "a": 2}, unk_token="<unk>"))
    kwargs = {"eos_token": "<eos>"} if eos else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **kwargs)
    tok.save_pretrained(tmp_path)
    return tmp_path


def test_tokenizer_without_pad_uses_eos_and_warns(tmp_path, caplog) -> None:
    path = _tokenizer_without_pad(tmp_path, eos=True)
    with caplog.at_level(logging.WARNING, logger="conveyor.models.loading"):
        tok = load_tokenizer(path)
    assert tok.pad_token == "<eos>" and tok.pad_token_id == 1
    assert any("no pad token" in r.getMessage() for r in caplog.records)


def test_tokenizer_without_pad_or_eos_raises(tmp_path) -> None:
    path = _tokenizer_without_pad(tmp_path, eos=False)
    with pytest.raises(ValueError, match="add a pad token"):
        load_tokenizer(path)


def test_padding_side_override(checkpoint) -> None:
    _, _, path = checkpoint
    assert load_tokenizer(path).padding_side == "left"
    assert load_tokenizer(path, padding_side="right").padding_side == "right"
    with pytest.raises(ValueError, match="padding_side"):
        load_tokenizer(path, padding_side="middle")


def test_resolve_dtype() -> None:
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("torch.float16") is torch.float16
    assert resolve_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float8")
