"""The lean forward against the Hugging Face forward it stands in for: logits, gradients, routing, replay, samples."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from conveyor.models.lean import LeanForward, _group_rows, resolve_forward_impl, unsupported_reason
from conveyor.models.moe_routing import MoELayer, RoutingRecorder, moe_info, moe_layers, replay_routing
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFEngine

LEAN_ARCHS = ["qwen3_moe", "qwen3"]
# Shaped like released Qwen3 models, built from transformers configs here (see `_shaped_config`).
SHAPED = ["qwen3_head_dim", "qwen3_moe_head_dim", "qwen3_moe_mlp_only_layers", "qwen3_moe_sparse_step"]
MODELS = LEAN_ARCHS + SHAPED
MOE_MODELS = [name for name in MODELS if "moe" in name]
TEXTS = ["1+2=", "12+345=", "7*8=", "100-1=", "9-9="]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _shaped_config(name: str, tok) -> PretrainedConfig:
    """A tiny config with what released Qwen3 checkpoints have and `tiny_config` does not.

    Every one has head_dim 32 with hidden 64 and 4 heads (hidden / heads = 16), as every released
    Qwen3 sets head_dim apart from hidden / heads. The MoE ones add mixed dense and sparse layers:
    `mlp_only_layers` (sparse, dense, sparse) and `decoder_sparse_step` 2 (dense, sparse, dense,
    sparse, without top-k renormalisation).
    """
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.3,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    moe = dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)
    configs = {
        "qwen3_head_dim": lambda: Qwen3Config(num_hidden_layers=2, **common),
        "qwen3_moe_head_dim": lambda: Qwen3MoeConfig(num_hidden_layers=2, norm_topk_prob=True, **moe, **common),
        "qwen3_moe_mlp_only_layers": lambda: Qwen3MoeConfig(
            num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True, **moe, **common
        ),
        "qwen3_moe_sparse_step": lambda: Qwen3MoeConfig(
            num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False, **moe, **common
        ),
    }
    return configs[name]()


def _build(name: str, tok) -> nn.Module:
    # A wide init (0.3) makes the logits peaked, so greedy choices are far from ties.
    if name in LEAN_ARCHS:
        return build_tiny_model(name, tok, seed=0, initializer_range=0.3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(_shaped_config(name, tok))


@pytest.fixture(scope="module")
def models(tok):
    return {name: _build(name, tok) for name in MODELS}


def test_the_shaped_models_have_the_shapes_they_are_named_for(models):
    sparse = {name: ["Sparse" in type(layer.mlp).__name__ for layer in models[name].model.layers] for name in SHAPED}
    assert sparse == {
        "qwen3_head_dim": [False, False],
        "qwen3_moe_head_dim": [True, True],
        "qwen3_moe_mlp_only_layers": [True, False, True],
        "qwen3_moe_sparse_step": [False, True, False, True],
    }
    for name in SHAPED:
        config, attn = models[name].config, models[name].model.layers[0].self_attn
        assert attn.head_dim == 32 != config.hidden_size // config.num_attention_heads
        assert attn.q_proj.out_features == config.num_attention_heads * 32
        assert unsupported_reason(models[name]) is None


def _batch(tok, n: int = 3, order: str = "grouped", seed: int = 0):
    """Prompts of TEXTS sampled n times each, with random right-padded responses of lengths 1..5."""
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    prompts, pmask = enc["input_ids"], enc["attention_mask"].bool()
    index = torch.arange(len(TEXTS)).repeat_interleave(n)
    if order in ("shuffled", "uneven"):
        index = index[torch.randperm(len(index), generator=torch.Generator().manual_seed(seed))]
    if order == "uneven":  # prompts with different numbers of rows: the per-row attention layout
        index = index[1:]
    prompts, pmask = prompts[index], pmask[index]
    gen = torch.Generator().manual_seed(seed)
    width = 5
    responses = torch.randint(4, len(tok), (len(index), width), generator=gen)
    lengths = torch.randint(1, width + 1, (len(index),), generator=gen)
    lengths[0] = width  # one row uses every column
    rmask = torch.arange(width)[None] < lengths[:, None]
    responses = responses.masked_fill(~rmask, tok.pad_token_id)
    return prompts, pmask, responses, rmask


def _hf_response_logits(model, prompts, pmask, responses, rmask):
    ids = torch.cat([prompts, responses], dim=1)
    att = torch.cat([pmask, rmask], dim=1).long()
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False, logits_to_keep=responses.shape[1] + 1
    )
    return out.logits[:, :-1]


def _loss(logits, responses, rmask):
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, responses[..., None])[..., 0]
    return -(logp * rmask).sum()


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(grads, ref_grads, model):
    # Every parameter: a gradient the lean forward misses or misroutes shows up here.
    assert set(ref_grads) == {name for name, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == set(ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("order", ["grouped", "shuffled", "uneven"])
def test_logits_and_gradients_match_the_hf_forward(models, tok, arch, order):
    model = models[arch].train()
    prompts, pmask, responses, rmask = _batch(tok, order=order)
    lean = LeanForward(model)

    model.zero_grad()
    ref = _hf_response_logits(model, prompts, pmask, responses, rmask)
    _loss(ref, responses, rmask).backward()
    ref_grads = _grads(model)

    model.zero_grad()
    got, routing = lean.response_logits(prompts, pmask, responses, rmask)
    _loss(got, responses, rmask).backward()

    assert got.shape == ref.shape
    assert routing is None
    torch.testing.assert_close(got[rmask], ref[rmask], rtol=1e-4, atol=1e-4)
    _assert_same_grads(_grads(model), ref_grads, model)


def test_a_one_column_response_and_all_distinct_prompts(models, tok):
    model = models["qwen3_moe"].eval()
    prompts, pmask, responses, rmask = _batch(tok, n=1)
    responses, rmask = responses[:, :1], rmask[:, :1]
    with torch.no_grad():
        ref = _hf_response_logits(model, prompts, pmask, responses, rmask)
        got, _ = LeanForward(model).response_logits(prompts, pmask, responses, rmask)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", MOE_MODELS)
@pytest.mark.parametrize("order", ["shuffled", "uneven"])
def test_routing_record_matches_the_hf_forward_at_every_fed_token(models, tok, arch, order):
    model = models[arch].eval()
    prompts, pmask, responses, rmask = _batch(tok, order=order)
    info = moe_info(model)
    with torch.no_grad():
        with RoutingRecorder(model) as rec:
            _hf_response_logits(model, prompts, pmask, responses, rmask)
            ref = rec.pop()
        _, got = LeanForward(model).response_logits(prompts, pmask, responses, rmask, record_routing=True)
    assert got.shape == (len(prompts), prompts.shape[1] + responses.shape[1], info.num_layers, info.top_k)
    assert got.dtype == torch.int16
    # Fed tokens: the prompt's real ones and every response token but a row's last.
    fed = torch.cat([pmask, rmask[:, 1:], torch.zeros(len(prompts), 1, dtype=torch.bool)], dim=1)
    assert (got[fed] >= 0).all() and (got[~fed] == -1).all()
    same = (got.long().sort(-1).values == ref.long().sort(-1).values).all(-1).all(-1)
    assert same[fed].float().mean() > 0.99  # equal up to a near-tie flipped by float rounding


@pytest.mark.parametrize("arch", MOE_MODELS)
@pytest.mark.parametrize("order", ["shuffled", "uneven"])
def test_replay_matches_the_hf_replay_and_keeps_the_router_trainable(models, tok, arch, order):
    model = models[arch].train()
    prompts, pmask, responses, rmask = _batch(tok, order=order)
    info = moe_info(model)
    batch, seq = len(prompts), prompts.shape[1] + responses.shape[1]
    # A routing the router would not choose: experts (e, e+3) rotating with position; -1 on one row.
    base = (torch.arange(seq).view(1, seq, 1, 1) + torch.tensor([0, 3]).view(1, 1, 1, 2)) % info.num_experts
    routed = base.expand(batch, seq, info.num_layers, 2).clone()
    routed[1, :] = -1

    model.zero_grad()
    with replay_routing(model, routed):
        ref = _hf_response_logits(model, prompts, pmask, responses, rmask)
    _loss(ref, responses, rmask).backward()
    ref_grads = _grads(model)

    model.zero_grad()
    got, own = LeanForward(model).response_logits(
        prompts, pmask, responses, rmask, routed_experts=routed, record_routing=True
    )
    _loss(got, responses, rmask).backward()
    torch.testing.assert_close(got[rmask], ref[rmask], rtol=1e-4, atol=1e-4)
    _assert_same_grads(_grads(model), ref_grads, model)
    for layer in moe_layers(model):
        assert layer.router.weight.grad.abs().sum() > 0
    fed = own >= 0
    replayed = routed.expand_as(own) >= 0
    assert torch.equal(own[fed & replayed], routed.to(own.dtype)[fed & replayed])


def test_replay_shape_errors_say_what_is_expected(models, tok):
    model = models["qwen3_moe"]
    prompts, pmask, responses, rmask = _batch(tok)
    bad = torch.zeros(len(prompts), prompts.shape[1] + responses.shape[1] + 1, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="first two dimensions must match"):
        LeanForward(model).response_logits(prompts, pmask, responses, rmask, routed_experts=bad)


@pytest.mark.parametrize("arch", MODELS)
def test_greedy_rollout_matches_the_hf_rollout(models, tok, arch):
    model = models[arch].eval()
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    ids = enc["input_ids"].repeat_interleave(3, 0)
    mask = enc["attention_mask"].repeat_interleave(3, 0)
    kwargs = SamplingParams(max_new_tokens=5, do_sample=False, capture_routing=arch in MOE_MODELS)
    ref = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).generate(ids, mask, kwargs)
    got = HFEngine(
        model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, lean=LeanForward(model)
    ).generate(ids, mask, kwargs)
    assert torch.equal(got["responses"], ref["responses"])
    assert torch.equal(got["response_mask"], ref["response_mask"])
    torch.testing.assert_close(got["rollout_log_probs"], ref["rollout_log_probs"], rtol=1e-4, atol=1e-5)
    if kwargs.capture_routing:
        assert torch.equal(got["routed_experts"] >= 0, ref["routed_experts"] >= 0)
        agree = (got["routed_experts"].sort(-1).values == ref["routed_experts"].sort(-1).values).all(-1)
        assert agree.float().mean() > 0.99


def test_rows_that_finish_early_leave_the_cache_without_changing_the_others(models, tok):
    model = models["qwen3_moe"]
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"].repeat_interleave(2, 0), enc["attention_mask"].repeat_interleave(2, 0)
    never = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=10_000).generate(
        ids, mask, SamplingParams(max_new_tokens=6, do_sample=False)
    )
    # An EOS that some rows emit at their second token and others later or never.
    eos = int(never["responses"][0, 1])
    kwargs = SamplingParams(max_new_tokens=6, do_sample=False, capture_routing=True)
    ref = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=eos).generate(ids, mask, kwargs)
    got = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=eos, lean=LeanForward(model)).generate(
        ids, mask, kwargs
    )
    lengths = ref["response_mask"].sum(-1)
    assert lengths.min() < lengths.max(), "the test needs rows of different lengths"
    assert torch.equal(got["responses"], ref["responses"])
    assert torch.equal(got["response_mask"], ref["response_mask"])
    torch.testing.assert_close(got["rollout_log_probs"], ref["rollout_log_probs"], rtol=1e-4, atol=1e-5)
    assert torch.equal(got["routed_experts"] >= 0, ref["routed_experts"] >= 0)


def test_sampled_rollout_log_probs_are_what_the_lean_training_forward_computes(models, tok):
    model = models["qwen3_moe"].eval()
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"].repeat_interleave(4, 0), enc["attention_mask"].repeat_interleave(4, 0)
    lean = LeanForward(model)
    gen = torch.Generator().manual_seed(3)
    out = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, lean=lean).generate(
        ids, mask, SamplingParams(max_new_tokens=6, temperature=0.7), generator=gen
    )
    with torch.no_grad():
        logits, _ = lean.response_logits(ids, mask, out["responses"], out["response_mask"])
    logp = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, out["responses"][..., None])[..., 0]
    logp = logp * out["response_mask"]
    torch.testing.assert_close(logp, out["rollout_log_probs"], rtol=1e-4, atol=1e-5)


def test_decode_refuses_to_run_past_its_cache(models, tok):
    model = models["qwen3"]
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    lean = LeanForward(model)
    _, state = lean.prefill(enc["input_ids"], enc["attention_mask"], 1)
    lean.decode(state, torch.full((len(TEXTS),), 5))
    with pytest.raises(ValueError, match="cache is full"):
        lean.decode(state, torch.full((len(TEXTS),), 5))


def test_group_rows_finds_equal_rows_in_any_order():
    rows = torch.tensor([[1, 2, 3], [4, 5, 6], [1, 2, 3], [-1, 2, 3], [4, 5, 6], [1, 2, 3]])
    inv, rep = _group_rows(rows)
    assert int(inv.max()) + 1 == 3 and len(rep) == 3
    assert torch.equal(rows[rep][inv], rows)
    for i in range(len(rows)):
        for j in range(len(rows)):
            assert (inv[i] == inv[j]) == torch.equal(rows[i], rows[j])


def test_group_rows_falls_back_to_sorting_rows_when_hashes_collide(monkeypatch):
    rows = torch.tensor([[1, 2], [3, 4], [1, 2], [5, 6]])
    real_randint = torch.randint
    # Zero hash weights: every row hashes to 0, so only the exactness check can tell them apart.
    monkeypatch.setattr(torch, "randint", lambda *a, **k: torch.zeros_like(real_randint(*a, **k)))
    inv, rep = _group_rows(rows)
    assert int(inv.max()) + 1 == 3
    assert torch.equal(rows[rep][inv], rows)


def test_which_models_the_lean_forward_runs(tok, caplog):
    assert unsupported_reason(build_tiny_model("qwen3_moe", tok)) is None
    mixtral = build_tiny_model("mixtral", tok)
    assert "MixtralForCausalLM" in unsupported_reason(mixtral)
    with caplog.at_level(logging.INFO, logger="conveyor.models.lean"):
        assert resolve_forward_impl("auto", mixtral) is None
    _assert_logged_once(caplog, "MixtralForCausalLM")
    assert resolve_forward_impl("hf", build_tiny_model("qwen3", tok)) is None
    assert isinstance(resolve_forward_impl("auto", build_tiny_model("qwen3", tok)), LeanForward)
    with pytest.raises(ValueError, match="forward_impl=lean cannot run this model.*set it to auto or hf"):
        resolve_forward_impl("lean", mixtral)
    checkpointed = build_tiny_model("qwen3", tok)
    # transformers 5 renamed gradient_checkpointing_enable (which now warns).
    enable = (
        getattr(checkpointed, "activation_checkpointing_enable", None) or checkpointed.gradient_checkpointing_enable
    )
    enable()
    assert "gradient checkpointing" in unsupported_reason(checkpointed)


def test_bfloat16_logits_stay_close_to_the_hf_forward(tok):
    model = build_tiny_model("qwen3_moe", tok, seed=0, initializer_range=0.3, dtype=torch.bfloat16).eval()
    prompts, pmask, responses, rmask = _batch(tok, order="shuffled")
    with torch.no_grad():
        ref = _hf_response_logits(model, prompts, pmask, responses, rmask).float()
        got, _ = LeanForward(model).response_logits(prompts, pmask, responses, rmask)
    assert got.dtype == torch.bfloat16
    # bfloat16 keeps 8 bits of mantissa: the two orders of summation differ by a few ulps.
    torch.testing.assert_close(got.float()[rmask], ref[rmask], rtol=0.05, atol=0.1)


def _assert_logged_once(caplog, reason: str) -> None:
    records = [r for r in caplog.records if r.name == "conveyor.models.lean"]
    assert len(records) == 1 and records[0].levelno >= logging.INFO
    assert "forward_impl=auto uses the Hugging Face forward" in records[0].getMessage()
    assert reason in records[0].getMessage()


class _UnknownSparseBlock(nn.Module):
    """A sparse block moe_routing does not know: its routing could be neither recorded nor replayed alike."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.gate, self.experts = block.gate, block.experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        _, weights, ids = self.gate(flat)
        return self.experts(flat, ids, weights).view_as(hidden)


def _with_unknown_block(model):
    model.model.layers[1].mlp = _UnknownSparseBlock(model.model.layers[1].mlp)


def _with_differing_qk_eps(model):
    model.model.layers[0].self_attn.k_norm.variance_epsilon *= 10


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_with_unknown_block, "layer 1: _UnknownSparseBlock is not a sparse MoE block"),
        (_with_differing_qk_eps, "layer 0: q_norm and k_norm differ in eps"),
    ],
)
def test_auto_falls_back_to_hf_and_logs_why_when_a_layer_is_outside_the_lean_forward(tok, caplog, change, reason):
    model = build_tiny_model("qwen3_moe", tok)
    change(model)
    assert reason in unsupported_reason(model)
    with caplog.at_level(logging.INFO, logger="conveyor.models.lean"):
        assert resolve_forward_impl("auto", model) is None
    _assert_logged_once(caplog, reason)
    with pytest.raises(ValueError, match=reason):
        resolve_forward_impl("lean", model)


def test_the_lean_forward_routes_with_the_models_own_router_module(tok):
    # A router whose rule differs from every stock one (the k least likely experts): a lean
    # forward with its own copy of the routing math would diverge from the Hugging Face forward.
    model = build_tiny_model("qwen3_moe", tok, seed=0, initializer_range=0.3).eval()
    for layer in moe_layers(model):
        router = layer.router

        def bottom_k(hidden, router=router):
            logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
            ids = torch.topk(-logits, router.top_k, dim=-1).indices
            return logits, torch.softmax(logits, dim=-1).gather(-1, ids), ids

        router.forward = bottom_k
    prompts, pmask, responses, rmask = _batch(tok, order="shuffled")
    with torch.no_grad():
        with RoutingRecorder(model) as rec:
            ref = _hf_response_logits(model, prompts, pmask, responses, rmask)
            ref_routing = rec.pop()
        got, routing = LeanForward(model).response_logits(prompts, pmask, responses, rmask, record_routing=True)
    torch.testing.assert_close(got[rmask], ref[rmask], rtol=1e-4, atol=1e-4)
    fed = routing >= 0
    assert fed.any()
    assert torch.equal(routing[fed], ref_routing[fed])


def test_the_lean_forward_and_the_hf_hooks_replay_through_one_function(models, tok, monkeypatch):
    model = models["qwen3_moe_mlp_only_layers"].eval()
    calls = []
    replay = MoELayer.replay

    def counted(self, output, recorded):
        calls.append(self.router)
        return replay(self, output, recorded)

    monkeypatch.setattr(MoELayer, "replay", counted)
    prompts, pmask, responses, rmask = _batch(tok)
    info = moe_info(model)
    routed = torch.zeros(
        len(prompts), prompts.shape[1] + responses.shape[1], info.num_layers, info.top_k, dtype=torch.long
    )
    routed[..., 1] = 1
    routers = [layer.router for layer in moe_layers(model)]
    with torch.no_grad():
        with replay_routing(model, routed):
            _hf_response_logits(model, prompts, pmask, responses, rmask)
        assert calls == routers
        LeanForward(model).response_logits(prompts, pmask, responses, rmask, routed_experts=routed)
    assert calls == routers * 2
