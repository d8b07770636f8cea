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


# --------------------------------------------------------------------------- broken or code-shipping checkpoints
def _copy(checkpoint, tmp_path, name: str):
    import shutil

    _, _, path = checkpoint
    return shutil.copytree(path, tmp_path / name)


def _edit_config(path, **changes) -> None:
    import json

    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, **changes}))


def test_auto_map_of_a_known_model_type_loads_the_builtin_class_without_running_code(
    checkpoint, tmp_path, caplog
) -> None:
    from conveyor.models.loading import load_model_config

    path = _copy(checkpoint, tmp_path, "known")
    marker = tmp_path / "ran"
    (path / "custom_moe.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    _edit_config(path, auto_map={"AutoConfig": "custom_moe.Cfg", "AutoModelForCausalLM": "custom_moe.Model"})
    with caplog.at_level(logging.WARNING, logger="conveyor.models.loading"):
        model = load_causal_lm(path)
        config = load_model_config(path)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and type(config).__name__ == "Qwen3MoeConfig"
    assert "actor_rollout_ref.model.trust_remote_code=true" in caplog.text
    assert not marker.exists()


def test_auto_map_of_an_unknown_model_type_names_the_key_and_runs_nothing(checkpoint, tmp_path) -> None:
    from conveyor.models.loading import load_model_config

    path = _copy(checkpoint, tmp_path, "custom")
    marker = tmp_path / "ran"
    (path / "custom_lm.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    _edit_config(
        path,
        model_type="conveyor_unknown_lm",
        auto_map={"AutoConfig": "custom_lm.Cfg", "AutoModelForCausalLM": "custom_lm.Model"},
    )
    for load in (load_causal_lm, load_model_config):
        with pytest.raises(ValueError, match=r"auto_map.*set actor_rollout_ref\.model\.trust_remote_code=true$"):
            load(path)
    assert not marker.exists()


def test_a_tokenizer_that_ships_code_names_the_key(tmp_path) -> None:
    import json

    # A tokenizer directory of its own (tokenizer_path): no model type to fall back on, only the shipped code.
    marker = tmp_path / "ran"
    (tmp_path / "custom_tok.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "ConveyorCustomTokenizer", "auto_map": {"AutoTokenizer": ["custom_tok.Tok", None]}}
        )
    )
    path = tmp_path
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.trust_remote_code=true") as info:
        load_tokenizer(path)
    assert "\n" not in str(info.value) and not marker.exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        ("bad_json", r"config\.json' is not valid JSON \(line 1, column 2"),
        ("json_list", r"config\.json' holds a JSON list"),
        ("no_weights", r"has no weights .*actor_rollout_ref\.model\.path"),
        ("cut_weights", r"model\.safetensors' is cut short \(\d+ bytes; its header describes \d+\)"),
        ("tiny_weights", r"model\.safetensors' is cut short \(4 bytes"),
        ("missing_shard", r"model-00002-of-00002\.safetensors' is missing"),
    ],
)
def test_a_damaged_checkpoint_is_one_line_naming_the_file(checkpoint, tmp_path, damage: str, message: str) -> None:
    import json

    path = _copy(checkpoint, tmp_path, damage)
    weights = path / "model.safetensors"
    if damage == "bad_json":
        (path / "config.json").write_text("{'single': 'quotes'}")
    elif damage == "json_list":
        (path / "config.json").write_text("[1, 2]")
    elif damage == "no_weights":
        weights.unlink()
    elif damage == "cut_weights":
        weights.write_bytes(weights.read_bytes()[:-1])
    elif damage == "tiny_weights":
        weights.write_bytes(b"\x00\x01\x02\x03")
    else:
        weights.rename(path / "model-00001-of-00002.safetensors")
        index = {
            "metadata": {},
            "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
        }
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=message) as info:
        load_causal_lm(path)
    assert "\n" not in str(info.value)


def test_a_directory_without_tokenizer_files_names_the_tokenizer_key(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint, tmp_path, "no_tok")
    for p in path.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            p.unlink()
    with pytest.raises(ValueError, match=r"no tokenizer in .*actor_rollout_ref\.model\.tokenizer_path"):
        load_tokenizer(path)
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot load the tokenizer in .*actor_rollout_ref\.model\.tokenizer_path"):
        load_tokenizer(path)


def test_a_sequence_classifier_is_refused_where_a_causal_lm_is_loaded(tmp_path) -> None:
    # Loaded as a causal LM, its LM head would be random: a student distilled towards noise, a policy sampling it.
    from transformers import AutoModelForSequenceClassification

    tok = build_char_tokenizer()
    lm = build_tiny_model("qwen3", tok, seed=0)
    lm.config.tie_word_embeddings = False
    cls_config = lm.config.__class__.from_dict({**lm.config.to_dict(), "num_labels": 1})
    cls_config.architectures = ["Qwen3ForSequenceClassification"]
    classifier = AutoModelForSequenceClassification.from_config(cls_config)
    classifier.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    with pytest.raises(
        ValueError,
        match=r"holds no weights for a language-model head \(lm_head.weight: it is a "
        r"Qwen3ForSequenceClassification checkpoint\)",
    ):
        load_causal_lm(tmp_path / "rm")
    body = load_causal_lm(tmp_path / "rm", lm_head=False)  # a critic reads only the body
    assert body.model.embed_tokens.weight.shape[0] == len(tok)
    lm.save_pretrained(tmp_path / "lm")
    load_causal_lm(tmp_path / "lm")  # a causal LM with its own head loads as before
