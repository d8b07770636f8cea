"""Packed forwards equal padded ones: log-probs, entropy, values, gradients and MoE routing, for every tiny model."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.algos.logprob import logprobs_and_entropy
from conveyor.models.moe_routing import RoutingRecorder, moe_info, replay_routing
from conveyor.models.packing import (
    PACKED_ATTENTION,
    PackedRows,
    enable_packing,
    packing_unsupported_reason,
    resolve_remove_padding,
)
from conveyor.models.tiny import TINY_ARCHS, tiny_config
from conveyor.models.value_head import ValueModel

B, P, R, V = 5, 6, 7, 48


def _model(arch: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(arch, vocab_size=V, **overrides)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def _batch(tool_tokens: bool = False) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of ragged lengths (one row a single token, one empty)."""
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(1, V, (B, P), generator=gen)
    prompt_mask = torch.ones(B, P, dtype=torch.bool)
    prompt_mask[0, :2] = prompt_mask[2, :5] = False
    responses = torch.randint(1, V, (B, R), generator=gen)
    lengths = torch.tensor([7, 3, 1, 0, 5])
    span = torch.arange(R)[None] < lengths[:, None]
    mask = span.clone()
    if tool_tokens:  # a multi-turn row: tokens 1-2 of row 0 came from a tool (context, not trained on)
        mask[0, 1:3] = False
    prompts[~prompt_mask] = 0
    responses[~span] = 0
    return {"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses, "response_mask": mask, "span": span}


def _inputs(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.cat([batch["prompts"], batch["responses"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["span"]], 1).long()
    return ids, attention, (attention.cumsum(-1) - 1).clamp(min=0)


def _padded_log_probs(model, batch, routed=None, record=False):
    ids, attention, positions = _inputs(batch)
    recorder = RoutingRecorder(model) if record else None
    ctx = replay_routing(model, routed) if routed is not None else torch.enable_grad()
    with ctx, recorder if recorder else torch.enable_grad():
        logits = model(
            input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False, logits_to_keep=R + 1
        ).logits[:, :-1]
        own = recorder.pop() if recorder else None
    lp, ent = logprobs_and_entropy(logits, batch["responses"], True, temperature=0.7)
    return lp * batch["response_mask"], ent * batch["response_mask"], own


def _packed_log_probs(model, batch, routed=None, record=False):
    ids, attention, positions = _inputs(batch)
    packed = PackedRows.from_masks(attention, batch["span"])
    recorder = RoutingRecorder(model) if record else None
    ctx = replay_routing(model, packed.pack(routed)) if routed is not None else torch.enable_grad()
    with ctx, recorder if recorder else torch.enable_grad():
        logits = model(**packed.model_kwargs(ids, positions), use_cache=False, logits_to_keep=packed.predict).logits
        own = packed.unpack(recorder.pop(), -1) if recorder else None
    targets = batch["responses"][packed.rows, packed.cols][None]
    lp, ent = logprobs_and_entropy(logits, targets, True, temperature=0.7)
    mask = batch["response_mask"]
    return packed.responses(lp[0], R) * mask, packed.responses(ent[0], R) * mask, own


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tool_tokens", [False, True])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_packed_log_probs_entropy_and_gradients_equal_the_padded_ones(arch: str, tool_tokens: bool) -> None:
    padded = _model(arch)
    packed = copy.deepcopy(padded)
    enable_packing(packed)
    assert packing_unsupported_reason(padded) is None
    batch = _batch(tool_tokens)
    results = {}
    for name, model, fn in (("padded", padded, _padded_log_probs), ("packed", packed, _packed_log_probs)):
        lp, ent, _ = fn(model, batch)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results[name] = (lp, ent, _grads(model))
    (lp0, ent0, g0), (lp1, ent1, g1) = results["padded"], results["packed"]
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert float(lp0.detach().abs().sum()) > 0  # the rows have response tokens: the comparison is not of zeros


@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS if a != "qwen3"])
def test_packed_routing_is_recorded_and_replayed_per_token(arch: str) -> None:
    """Recording: each packed token's experts are the padded forward's; replay: given routing, the same outputs."""
    padded = _model(arch)
    packed = copy.deepcopy(padded)
    enable_packing(packed)
    batch = _batch()
    _, _, want = _padded_log_probs(padded, batch, record=True)
    _, _, got = _packed_log_probs(packed, batch, record=True)
    _, attention, _ = _inputs(batch)
    fed = attention.bool()[:, :, None, None].expand_as(want)
    assert torch.equal(got[fed].long(), want[fed].long())
    assert bool((got[~fed] == -1).all())
    # Replay routing other than the model's own (random top-k sets): outputs and gradients still agree.
    info = moe_info(padded)
    gen = torch.Generator().manual_seed(5)
    routed = torch.rand(B, P + R, info.num_layers, info.num_experts, generator=gen).argsort(-1)[..., : info.top_k]
    lp0, _, _ = _padded_log_probs(padded, batch, routed=routed)
    lp0.sum().backward()
    lp1, _, _ = _packed_log_probs(packed, batch, routed=routed)
    lp1.sum().backward()
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    g0, g1 = _grads(padded), _grads(packed)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    # The replayed routing was used: the replayed forward differs from the model's own.
    own, _, _ = _packed_log_probs(packed, batch)
    assert not torch.allclose(own, lp1, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_packed_values_equal_the_padded_ones(arch: str) -> None:
    causal = _model(arch)
    padded = ValueModel.from_causal_lm(causal)
    torch.nn.init.normal_(padded.value_head.weight, std=0.5)  # a zero head would compare zeros
    packed_model = copy.deepcopy(padded)
    enable_packing(packed_model.backbone)
    batch = _batch()
    ids, attention, positions = _inputs(batch)
    want = padded(ids, attention, positions)[:, P - 1 : P + R - 1] * batch["response_mask"]
    rows = PackedRows.from_masks(attention, batch["span"])
    got = packed_model(rows.pack(ids), None, rows.pack(positions), **rows.bounds())
    got = rows.responses(got[0, rows.predict], R) * batch["response_mask"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float(want.detach().abs().sum()) > 0


def test_a_packed_model_runs_padded_forwards_and_generation_as_sdpa_does() -> None:
    """Setting the packed implementation changes nothing for a forward that has a padding mask (the rollout's)."""
    model = _model("qwen3_moe")
    packed = copy.deepcopy(model)
    enable_packing(packed)
    assert packed.config._attn_implementation == PACKED_ATTENTION
    ids, attention, positions = _inputs(_batch())
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
        got = packed(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    assert torch.equal(got, want)
    prompt = torch.randint(1, V, (2, 4), generator=torch.Generator().manual_seed(0))
    kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(packed.generate(prompt, **kw), model.generate(prompt, **kw))


def test_packing_is_refused_where_attention_crosses_what_it_can_keep_apart() -> None:
    """A sliding-window model runs padded under null and is an error naming the key under true."""
    model = _model("qwen3", sliding_window=4, use_sliding_window=True)
    assert "sliding-window" in packing_unsupported_reason(model)
    assert resolve_remove_padding(None, model, "k") is False
    assert resolve_remove_padding(False, _model("qwen3"), "k") is False
    with pytest.raises(ValueError, match="k=true cannot pack.*set k=false"):
        resolve_remove_padding(True, model, "k")


def test_packed_rows_layout() -> None:
    """Real tokens in row order, sequence bounds, and each response token's predicting position."""
    batch = _batch()
    ids, attention, positions = _inputs(batch)
    rows = PackedRows.from_masks(attention, batch["span"])
    lengths = attention.sum(-1)
    assert rows.cu_seq_lens.tolist() == [0, *lengths.cumsum(0).tolist()]
    packed_ids = rows.pack(ids)[0]
    assert packed_ids.numel() == int(lengths.sum())
    # Row 1 (full prompt of 6, 3 response tokens): its first response token is predicted by its last prompt token.
    start = int(rows.cu_seq_lens[1])
    first = int(((rows.rows == 1) & (rows.cols == 0)).nonzero())
    assert int(rows.predict[first]) == start + 5 and int(packed_ids[start + 6]) == int(batch["responses"][1, 0])
    assert torch.equal(rows.unpack(rows.pack(ids), -1)[attention.bool()], ids[attention.bool()])
