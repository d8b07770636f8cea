"""The vllm rollout against the real engine (vLLM's CPU build): outputs, log-probs and in-place weight sync.

One engine serves the module (it takes ~20-30 s to start on 2 cores). The tiny Qwen3-MoE has 32-wide
attention heads, the smallest vLLM's CPU attention accepts.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.hf import HFRollout
from conveyor.rollout.base import engine_spec
from conveyor.rollout.vllm import VLLMRollout
from test_hf_rollout import _teacher_forced_log_probs  # tests/rollout is on sys.path (rootdir import mode)

PROMPTS = ["1+2=", "12+345=", "7*8=", "100-1=", "9+9=", "31+4="]
# float32 on both sides; what remains is the kernels' summation order. Measured on a 2-core x86 CPU:
# at most 1.2e-5 (48 rows x 8 tokens, temperatures 1 and 0.7, before and after perturbing every weight,
# 3 seeds). The bound leaves room for other CPUs' vector widths while staying far below what a wrong or
# skipped sync does (the greedy tokens themselves change).
LOGP_TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def setup(tok, tmp_path_factory):
    """A saved tiny MoE checkpoint, the same model in memory (the trainer's copy) and a vLLM engine over it."""
    path = tmp_path_factory.mktemp("vllm-model")
    model = build_tiny_model("qwen3_moe", tok, seed=0, hidden_size=64, num_heads=2, num_kv_heads=2,
                             initializer_range=0.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    engine = VLLMRollout(str(path), hf_config=model.config, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, max_model_len=64, max_num_seqs=32, seed=0,
                         capture_routing=True)
    yield model, engine
    # vLLM made a one-rank process group in this process; later tests must find none.
    assert torch.distributed.is_initialized()
    engine.close()
    assert not torch.distributed.is_initialized() and engine.llm is None


def _prompts(tok, texts=PROMPTS):
    enc = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _teacher_forced(model, ids, mask, out, temperature=1.0):
    """log_softmax(logits / T) of the response tokens from one forward of the trainer's model (0 off the mask)."""
    return _teacher_forced_log_probs(model, ids, mask, out, temperature)[0] * out["response_mask"]


def _greedy(engine, ids, mask, n=8):
    return engine.generate(ids, mask, max_new_tokens=n, do_sample=False)


def _assert_same_greedy(a, b):
    assert torch.equal(a["response_mask"], b["response_mask"])
    assert torch.equal(a["responses"] * a["response_mask"], b["responses"] * b["response_mask"])


def test_outputs_have_the_hf_rollout_fields_and_conventions(setup, tok) -> None:
    model, engine = setup
    ids, mask = _prompts(tok)
    out = engine.generate(ids, mask, max_new_tokens=7, generator=torch.Generator().manual_seed(0),
                          capture_routing=True)
    # The CPU build cannot return routed experts: the key is absent, as for a dense model.
    assert not engine_spec("vllm").capabilities("cpu").returns_routing and set(out) == {"responses", "response_mask", "rollout_log_probs"}
    b, r = out["responses"].shape
    assert b == len(PROMPTS) and 1 <= r <= 7
    assert out["responses"].dtype == torch.long and out["response_mask"].dtype == torch.bool
    m = out["response_mask"]
    # The mask is a prefix of each row; after it, pad tokens and log-prob 0.
    assert bool((m[:, 1:] <= m[:, :-1]).all())
    assert bool((out["responses"][~m] == tok.pad_token_id).all())
    assert bool((out["rollout_log_probs"][~m] == 0).all()) and bool((out["rollout_log_probs"][m] <= 0).all())
    # A row ends at EOS (kept in the response, like the hf rollout) or at the token limit.
    for row, mrow in zip(out["responses"], m):
        toks = row[mrow].tolist()
        assert tok.eos_token_id not in toks[:-1]
        assert toks[-1] == tok.eos_token_id or len(toks) == 7


def test_greedy_equals_the_hf_rollout(setup, tok) -> None:
    model, engine = setup
    ids, mask = _prompts(tok)
    engine.sync_weights(model.state_dict().items(), version=0)
    ours = HFRollout(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).generate(
        ids, mask, max_new_tokens=8, do_sample=False)
    theirs = _greedy(engine, ids, mask)
    _assert_same_greedy(theirs, ours)
    assert torch.allclose(theirs["rollout_log_probs"], ours["rollout_log_probs"], atol=LOGP_TOL, rtol=0)


def test_sampled_log_probs_match_the_trainer_forward_and_seeds_repeat(setup, tok) -> None:
    model, engine = setup
    engine.sync_weights(model.state_dict().items(), version=0)
    ids, mask = _prompts(tok)
    ids, mask = ids.repeat(4, 1), mask.repeat(4, 1)
    kw = dict(max_new_tokens=8, temperature=0.7)
    a = engine.generate(ids, mask, generator=torch.Generator().manual_seed(3), **kw)
    b = engine.generate(ids, mask, generator=torch.Generator().manual_seed(3), **kw)
    c = engine.generate(ids, mask, generator=torch.Generator().manual_seed(4), **kw)
    assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])
    assert not torch.equal(a["responses"], c["responses"])
    # Under sampling (no truncation) the engine's log-probs are log_softmax(logits / T), the trainer's numbers.
    ref = _teacher_forced(model, ids, mask, a, temperature=0.7)
    assert float((a["rollout_log_probs"] - ref).abs().max()) < LOGP_TOL


def test_weight_sync_after_an_update_serves_the_new_policy(setup, tok) -> None:
    model, engine = setup
    ids, mask = _prompts(tok)
    engine.sync_weights(model.state_dict().items(), version=0)
    before = _greedy(engine, ids, mask)
    # A real actor update: AdamW steps that make the model write '7' after every prompt.
    trained = build_tiny_model("qwen3_moe", tok, seed=0, hidden_size=64, num_heads=2, num_kv_heads=2,
                               initializer_range=0.3)
    trained.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(trained.parameters(), lr=3e-3)
    seven = tok.convert_tokens_to_ids("7")
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    for _ in range(15):
        logits = trained(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, torch.full((len(ids),), seven))
        opt.zero_grad()
        loss.backward()
        opt.step()
    trained.eval()
    seconds = engine.sync_weights(trained.state_dict().items(), version=1)
    after = _greedy(engine, ids, mask)
    assert engine.weights_version == 1 and seconds < 30
    # The engine's greedy decode is the updated trainer's, token for token, with the trainer's log-probs ...
    ours = HFRollout(trained, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).generate(
        ids, mask, max_new_tokens=8, do_sample=False)
    _assert_same_greedy(after, ours)
    assert bool((after["responses"][:, 0] == seven).all())
    recomputed = _teacher_forced(trained, ids, mask, after)
    assert float((after["rollout_log_probs"] - recomputed).abs().max()) < LOGP_TOL
    # ... and differs from what it served before (a sync that did nothing would fail above).
    assert not torch.equal(before["responses"], after["responses"])
    # Syncing the old weights back restores the old outputs exactly: the sync replaces, it does not accumulate.
    engine.sync_weights(model.state_dict().items(), version=0)
    again = _greedy(engine, ids, mask)
    _assert_same_greedy(again, before)
    assert torch.allclose(again["rollout_log_probs"], before["rollout_log_probs"], atol=LOGP_TOL, rtol=0)


def test_stop_sequences_are_refused_with_what_to_do(setup, tok) -> None:
    _, engine = setup
    ids, mask = _prompts(tok)
    with pytest.raises(ValueError, match="rollout.name=hf"):
        engine.generate(ids, mask, max_new_tokens=4, stop_sequences=[[5, 6]])
