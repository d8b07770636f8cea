"""Every registered rollout engine against one contract: fields, conventions, greedy tokens and log-probs.

Parametrised over `ROLLOUT_ENGINES`, each built through its registry entry (`EngineSpec.build`) over the
same saved tiny Qwen3-MoE, as the actor worker builds them. vLLM is its real CPU build (one engine serves
the module; it takes ~20-30 s to start on 2 cores); the model has 32-wide attention heads, the smallest
vLLM's CPU attention accepts. A new engine registered in `conveyor.rollout.base` joins every test here,
and so does one a plugin file registers: `CONFORMANCE_PLUGINS=my_engine.py pytest tests/rollout/test_conformance.py`
loads the files named (separated by the path separator) the way `trainer.plugins` does, before the tests are
parametrised.
Engines are built when a test first asks for one, so `-k my_engine` builds that engine and the reference only.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_hf_rollout import _teacher_forced_log_probs  # tests/rollout is on sys.path (rootdir import mode)

from conveyor.models.moe_routing import moe_info
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.plugins import load_plugins
from conveyor.rollout.base import ROLLOUT_ENGINES, EngineContext, GenerationOutput, SamplingParams, engine_spec
from conveyor.rollout.hf import HFEngine

PROMPTS = ["1+2=", "12+345=", "7*8=", "100-1=", "9+9=", "31+4="]
# float32 on both sides; what remains is the kernels' summation order. Measured on a 2-core x86 CPU:
# at most 1.2e-5 (48 rows x 8 tokens, temperatures 1 and 0.7, before and after perturbing every weight,
# 3 seeds). The bound leaves room for other CPUs' vector widths while staying far below what a wrong or
# skipped sync does (the greedy tokens themselves change).
LOGP_TOL = 1e-4
load_plugins([p for p in os.environ.get("CONFORMANCE_PLUGINS", "").split(os.pathsep) if p])
ENGINES = sorted(ROLLOUT_ENGINES)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _model(tok):
    return build_tiny_model(
        "qwen3_moe", tok, seed=0, hidden_size=64, num_heads=2, num_kv_heads=2, initializer_range=0.3
    )


@pytest.fixture(scope="module")
def built(tok, tmp_path_factory):
    """The trainer's model (saved, and in memory) and the registered engines over it, built from the registry."""
    path = tmp_path_factory.mktemp("engine-model")
    model = _model(tok).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    from conveyor.config.rollout import RolloutConfig

    rollout = RolloutConfig(max_num_seqs=32)

    class Engines(dict):
        """Each engine built on first use (a vLLM engine takes tens of seconds to start), then kept."""

        def __missing__(self, name: str):
            engine = engine_spec(name).build(
                EngineContext(
                    model_path=str(path),
                    model=model,
                    tokenizer=tok,
                    rollout=rollout,
                    model_dtype="float32",
                    trust_remote_code=False,
                    max_model_len=64,
                    seed=0,
                    rank=0,
                    world_size=1,
                    device=torch.device("cpu"),
                    moe=moe_info(model),
                )
            )
            engine.update_weights(model.state_dict().items(), version=0)
            self[name] = engine
            return engine

    engines = Engines()
    yield model, engines
    for engine in engines.values():
        engine.close()
    # vLLM made a one-rank process group in this process; closing it removes it for later tests.
    assert not torch.distributed.is_initialized()


def _prompts(tok, texts=PROMPTS):
    enc = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _greedy(engine, ids, mask, n=8, **params):
    return engine.generate(ids, mask, SamplingParams(max_new_tokens=n, do_sample=False, **params))


def _masked(out):
    return out["responses"] * out["response_mask"]


def _assert_same_greedy(a, b, *, log_probs: bool = True) -> None:
    """The same tokens and masks (and, with `log_probs`, the same scores within the kernels' tolerance)."""
    assert torch.equal(a["response_mask"], b["response_mask"]) and torch.equal(_masked(a), _masked(b))
    if log_probs:
        assert torch.allclose(a["rollout_log_probs"], b["rollout_log_probs"], atol=LOGP_TOL, rtol=0)


@pytest.mark.parametrize("name", ENGINES)
def test_every_engine_returns_the_same_fields_and_conventions(built, tok, name) -> None:
    model, engines = built
    engine = engines[name]
    ids, mask = _prompts(tok)
    out = engine.generate(
        ids, mask, SamplingParams(max_new_tokens=7, capture_routing=True), generator=torch.Generator().manual_seed(0)
    )
    assert isinstance(out, GenerationOutput)
    routing = engine.capabilities.returns_routing
    assert set(out) == {"responses", "response_mask", "rollout_log_probs"} | ({"routed_experts"} if routing else set())
    b, r = out["responses"].shape
    assert b == len(PROMPTS) and 1 <= r <= 7
    assert out["responses"].dtype == torch.long and out["response_mask"].dtype == torch.bool
    assert out["rollout_log_probs"].dtype == torch.float32 and out["rollout_log_probs"].shape == (b, r)
    m = out["response_mask"]
    # The mask is a prefix of each row; after it, pad tokens and log-prob 0.
    assert bool((m[:, 1:] <= m[:, :-1]).all())
    assert bool((out["responses"][~m] == tok.pad_token_id).all())
    assert bool((out["rollout_log_probs"][~m] == 0).all()) and bool((out["rollout_log_probs"][m] <= 0).all())
    # A row ends at EOS (kept in the response) or at the token limit.
    for row, mrow in zip(out["responses"], m):
        toks = row[mrow].tolist()
        assert tok.eos_token_id not in toks[:-1]
        assert toks[-1] == tok.eos_token_id or len(toks) == 7
    if routing:
        info = moe_info(model)
        routed = out["routed_experts"]
        assert routed.shape == (b, ids.shape[1] + r, info.num_layers, info.top_k)
        assert not routed.dtype.is_floating_point
        # -1 exactly where no token was fed: left pads, each row's last sampled token and what follows.
        lengths = m.sum(-1)
        fed = torch.cat([mask.bool(), torch.arange(r)[None] < (lengths[:, None] - 1)], dim=1)
        assert bool((routed[~fed] == -1).all()) and bool((routed[fed] >= 0).all())
        assert bool((routed[fed] < info.num_experts).all())


@pytest.mark.parametrize("name", ENGINES)
def test_greedy_tokens_are_equal_across_engines_on_the_same_weights(built, tok, name) -> None:
    model, engines = built
    ids, mask = _prompts(tok)
    ours = _greedy(engines["hf"], ids, mask)
    _assert_same_greedy(_greedy(engines[name], ids, mask), ours)


@pytest.mark.parametrize("name", ENGINES)
def test_sampled_log_probs_equal_the_trainer_forward_and_seeds_repeat(built, tok, name) -> None:
    model, engines = built
    engine = engines[name]
    ids, mask = _prompts(tok)
    ids, mask = ids.repeat(4, 1), mask.repeat(4, 1)
    params = SamplingParams(max_new_tokens=8, temperature=0.7)
    a = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(3))
    b = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(3))
    c = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])
    assert not torch.equal(a["responses"], c["responses"])
    # Under sampling (no truncation) the engine's log-probs are log_softmax(logits / T), the trainer's numbers.
    ref = _teacher_forced_log_probs(model, ids, mask, a, 0.7)[0] * a["response_mask"]
    assert float((a["rollout_log_probs"] - ref).abs().max()) < LOGP_TOL


@pytest.mark.parametrize("name", ENGINES)
def test_stop_sequences_end_a_row_where_it_first_writes_one(built, tok, name) -> None:
    _, engines = built
    engine = engines[name]
    assert engine.capabilities.stop_sequences
    ids, mask = _prompts(tok)
    free = _greedy(engine, ids, mask, n=12)
    # A two-token stop whose second token row 0 also writes earlier without the first (vLLM stops at single
    # ids: it stops there and must go on), and one token row 1 writes at step 2.
    row0 = free["responses"][0, : int(free["response_mask"][0].sum())].tolist()
    pairs = [
        row0[j - 1 : j + 1]
        for j in range(2, len(row0))
        if any(row0[k] == row0[j] and (k == 0 or row0[k - 1] != row0[j - 1]) for k in range(j))
    ]
    assert pairs, f"row 0 ({row0}) repeats no token after a different one; pick other prompts"
    pair, single = pairs[0], free["responses"][1, 2:3].tolist()
    out = _greedy(engine, ids, mask, n=12, stop_sequences=[pair, single])
    for row, full, rmask, fmask in zip(
        out["responses"].tolist(), free["responses"].tolist(), out["response_mask"], free["response_mask"]
    ):
        full = full[: int(fmask.sum())]
        ends = [t + len(s) for s in (pair, single) for t in range(len(full)) if full[t : t + len(s)] == s]
        n = min(ends) if ends else len(full)
        assert int(rmask.sum()) == n and row[:n] == full[:n]
    # Every engine agrees, token for token.
    want = _greedy(engines["hf"], ids, mask, n=12, stop_sequences=[pair, single])
    _assert_same_greedy(out, want, log_probs=False)


@pytest.mark.parametrize("name", [n for n in ENGINES if not engine_spec(n).capabilities("cpu").shares_trainer_modules])
def test_an_engine_with_its_own_weights_serves_the_updated_policy_after_a_sync(built, tok, name) -> None:
    model, engines = built
    engine = engines[name]
    ids, mask = _prompts(tok)
    before = _greedy(engine, ids, mask)
    # A real actor update: AdamW steps that make the model write '7' after every prompt.
    trained = _model(tok)
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
    # Before a sync the engine still serves the old policy: a missed sync shows.
    assert torch.equal(_masked(_greedy(engine, ids, mask)), _masked(before))
    seconds = engine.update_weights(trained.state_dict().items(), version=1)
    after = _greedy(engine, ids, mask)
    assert engine.weights_version == 1 and seconds < 30
    # The engine's greedy decode is the updated trainer's, token for token, with the trainer's log-probs ...
    ours = HFEngine(trained, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).generate(
        ids, mask, SamplingParams(max_new_tokens=8, do_sample=False)
    )
    _assert_same_greedy(after, ours, log_probs=False)
    assert bool((after["responses"][:, 0] == seven).all())
    recomputed = _teacher_forced_log_probs(trained, ids, mask, after, 1.0)[0] * after["response_mask"]
    assert float((after["rollout_log_probs"] - recomputed).abs().max()) < LOGP_TOL
    # ... and differs from what it served before (a sync that did nothing would fail above).
    assert not torch.equal(before["responses"], after["responses"])
    # Syncing the old weights back restores the old outputs exactly: the sync replaces, it does not accumulate.
    engine.update_weights(model.state_dict().items(), version=0)
    _assert_same_greedy(_greedy(engine, ids, mask), before)


@pytest.mark.parametrize("name", ENGINES)
def test_what_an_engine_does_not_declare_is_refused(built, tok, name) -> None:
    _, engines = built
    engine = engines[name]
    ids, mask = _prompts(tok)
    caps = engine.capabilities
    params = SamplingParams(max_new_tokens=2)
    if not caps.interruptible:
        with pytest.raises(ValueError, match="interrupted"):
            engine.generate(ids, mask, params, interrupt=lambda n: False)
    if not caps.shares_trainer_modules:
        with pytest.raises(ValueError, match="shards"):
            engine.generate(ids, mask, params, synced=lambda done: done)
