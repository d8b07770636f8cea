"""The supervised warm start stops at the training accuracy it is asked for, read off its own logits."""

from __future__ import annotations

import pytest
import torch

from conveyor.models.router_control import RouterTap
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.tasks.dataset import render_prompt
from conveyor.tasks.synthetic import make_arithmetic_records
from conveyor.trainer.warmstart import supervised_warmstart


def _greedy_accuracy(model, tok, records) -> float:
    texts = [render_prompt(r, tok) for r in records]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
        )
    answers = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(a.strip() == r["reward_model"]["ground_truth"] for a, r in zip(answers, records)) / len(records)


def _tiny(tok, arch: str = "qwen3", **sizes):
    """A one-layer tiny model of `arch` for these tests (hidden 32); `sizes` overrides the rest."""
    kwargs = {"intermediate_size": 64, **sizes}
    return build_tiny_model(
        arch,
        tok,
        seed=0,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=16,
        **kwargs,
    )


def test_warm_start_stops_once_its_training_exact_match_reaches_the_target():
    tok = build_char_tokenizer()
    records = make_arithmetic_records(40, seed=0, max_operand=9)

    def model():
        return _tiny(tok)

    stopped = model()
    losses = supervised_warmstart(
        stopped, tok, records, steps=600, lr=1e-2, batch_size=32, until_accuracy=0.5, accuracy_window=5
    )
    assert 5 <= len(losses) < 600
    # The logits' exact match is greedy decoding's: the stopped model decodes about that well.
    assert 0.3 <= _greedy_accuracy(stopped, tok, records) < 1.0
    # Without a target, all the steps run.
    assert (
        len(supervised_warmstart(model(), tok, records, steps=len(losses) + 3, lr=1e-2, batch_size=32))
        == len(losses) + 3
    )
    with pytest.raises(ValueError, match=r"until_accuracy must be in \[0, 1\]"):
        supervised_warmstart(model(), tok, records, steps=1, lr=1e-2, until_accuracy=1.5)


def test_the_load_balancing_loss_spreads_the_warm_start_over_the_experts():
    tok = build_char_tokenizer()
    records = make_arithmetic_records(64, seed=0, max_operand=9)

    def model(arch: str = "qwen3_moe"):
        return _tiny(tok, arch, intermediate_size=32, num_experts=4, top_k=2)

    def balance_loss(m) -> float:
        enc = tok([render_prompt(r, tok) for r in records], return_tensors="pt", padding=True, add_special_tokens=False)
        tap = RouterTap(m, keep_logits=True, count=False)
        with torch.no_grad(), tap.active(enc["attention_mask"]):
            m(**enc)
        return float(tap.aux_loss(2))

    plain, balanced = model(), model()
    supervised_warmstart(plain, tok, records, steps=30, lr=1e-2, batch_size=16)
    supervised_warmstart(balanced, tok, records, steps=30, lr=1e-2, batch_size=16, aux_loss_coef=1.0)
    # 2.0 is a perfectly balanced top-2 router; the loss term pulls the routers toward it.
    assert balance_loss(balanced) < balance_loss(plain) - 0.05
    with pytest.raises(ValueError, match="aux_loss_coef"):
        supervised_warmstart(model("qwen3"), tok, records, steps=1, lr=1e-2, aux_loss_coef=1.0)


def test_the_load_balancing_loss_can_count_the_answer_tokens_only():
    """`aux_loss_tokens="answer"` balances the routing of the tokens a rollout generates, not the prompts'."""
    from conveyor.trainer.warmstart import _encode_pairs

    tok = build_char_tokenizer()
    records = make_arithmetic_records(64, seed=0, max_operand=9)

    def model():
        return _tiny(tok, "qwen3_moe", intermediate_size=32, num_experts=8, top_k=2)

    pairs = _encode_pairs(tok, records)
    width = max(len(p.prompt) + len(p.answer) for p in pairs)
    ids = torch.full((len(pairs), width), tok.pad_token_id, dtype=torch.long)
    answer = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (p, a, *_) in enumerate(pairs):
        ids[i, width - len(p) - len(a) :] = torch.tensor(p + a)
        answer[i, width - len(a) :] = 1
    attention = (ids != tok.pad_token_id).long()

    def answer_max_vio(m) -> float:
        tap = RouterTap(m, keep_logits=False, count=True)
        with torch.no_grad(), tap.active(answer):
            m(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0))
        load = tap.pop_load()[0]
        return float(load.max() / load.mean() - 1)

    common = {"steps": 40, "lr": 1e-2, "batch_size": 16, "aux_loss_coef": 3.0}
    everywhere, answers = model(), model()
    supervised_warmstart(everywhere, tok, records, **common)
    supervised_warmstart(answers, tok, records, aux_loss_tokens="answer", **common)
    # Counting only the answers spreads their routing further than the same weight over every token does.
    assert answer_max_vio(answers) < answer_max_vio(everywhere) - 0.2
    with pytest.raises(ValueError, match="aux_loss_tokens must be 'all' or 'answer'"):
        supervised_warmstart(model(), tok, records, steps=1, lr=1e-2, aux_loss_coef=1.0, aux_loss_tokens="prompt")


def test_runs_whose_lengths_differ_do_not_share_a_cached_tiny_model() -> None:
    """The cached tiny model's positions follow the data's lengths, so the cache key does too."""
    import json
    from pathlib import Path

    from conveyor.config import load_config
    from conveyor.trainer.setup import prepare_default_model

    base = ["actor_rollout_ref.model.tiny.warmstart_steps=0", "actor_rollout_ref.model.tiny.hidden_size=32"]
    short = prepare_default_model(load_config(None, base + ["data.max_response_length=8"]))
    long = prepare_default_model(load_config(None, base + ["data.max_response_length=64"]))
    assert short != long
    positions = {p: json.loads((Path(p) / "config.json").read_text())["max_position_embeddings"] for p in (short, long)}
    cfg = load_config(None, base + ["data.max_response_length=64"])
    assert positions[long] >= cfg.data.max_prompt_length + 64 > positions[short]


def test_a_vlm_warm_start_reads_the_images_at_transformers_own_positions(tmp_path) -> None:
    """The warm start of a tiny Qwen2.5-VL feeds each record's pixels and the M-RoPE positions transformers would
    compute itself (same logits), its loss falls, and `warm_start_tiny_vlm` writes a checkpoint with its processor."""
    from conveyor.models.loading import load_model_config
    from conveyor.models.tiny_vlm import build_tiny_image_processor, build_tiny_vlm, build_vlm_tokenizer
    from conveyor.models.vision import VisionProcessor
    from conveyor.tasks.visual import make_visual_sum_records
    from conveyor.trainer.warmstart import _encode_pairs, _vision_inputs, warm_start_tiny_vlm

    tok = build_vlm_tokenizer()
    model = build_tiny_vlm("qwen2_5_vl", tok, seed=0)
    vision = VisionProcessor(build_tiny_image_processor("qwen2_5_vl"), tok, model.config)
    records = make_visual_sum_records(24, seed=0)
    records.append({**records[0], "images": [], "prompt": [{"role": "user", "content": "1+22="}]})  # no image
    pairs = _encode_pairs(tok, records[-3:], vision)
    width = max(len(p.prompt + p.answer) for p in pairs)
    ids = torch.full((3, width), tok.pad_token_id)
    attn = torch.zeros((3, width), dtype=torch.long)
    for i, p in enumerate(pairs):
        ids[i, width - len(p.prompt + p.answer) :] = torch.tensor(p.prompt + p.answer)
        attn[i, width - len(p.prompt + p.answer) :] = 1
    ours = _vision_inputs(pairs, attn, vision)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=attn, **ours).logits
        pixels = {k: v for k, v in ours.items() if k != "position_ids"}
        types = (ids == model.config.image_token_id).int()
        own = model(input_ids=ids, attention_mask=attn, mm_token_type_ids=types, **pixels).logits
    assert torch.allclose(got[attn.bool()], own[attn.bool()], atol=1e-5)
    losses = supervised_warmstart(model, tok, records, steps=40, lr=3e-3, batch_size=16, vision=vision)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 / 2
    path, losses = warm_start_tiny_vlm("qwen2_5_vl", tmp_path / "vlm", steps=2, until_accuracy=0.0)
    assert len(losses) == 2 and (path / "preprocessor_config.json").is_file()
    assert load_model_config(str(path)).vision_config is not None
