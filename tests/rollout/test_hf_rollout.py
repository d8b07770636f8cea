"""Tests for the HF rollout engine: shapes, EOS handling, padding, log-probs, sampling and routing capture."""

from __future__ import annotations

import pytest
import torch

from conveyor.algos.logprob import logprobs_from_logits
from conveyor.algos.sampling_mask import Truncation
from conveyor.models.moe_routing import RoutingRecorder, moe_info
from conveyor.models.tiny import TINY_ARCHS, build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFEngine, _filter_top_k_top_p, _sample, _Sampler

MOE_ARCHS = [a for a in TINY_ARCHS if a != "qwen3"]
PROMPTS = ["1+2=", "12+345=", "7*8=", "100-1="]
NEVER_EOS = 10_000  # outside the vocabulary: rows only stop at max_new_tokens


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def models(tok):
    # A wider init than the default makes the logits peaked enough that greedy
    # choices are far from ties, so padded and unpadded runs agree exactly.
    return {arch: build_tiny_model(arch, tok, seed=0, initializer_range=0.3).eval() for arch in TINY_ARCHS}


def _prompts(tok, texts=PROMPTS):
    enc = tok(texts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _engine(model, tok, eos=None):
    return HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id if eos is None else eos)


def _teacher_forced_log_probs(model, ids, mask, out, temperature, truncation=None):
    """log_softmax(truncate(logits / T)) at the response tokens, from one forward over prompt + response."""
    seq = torch.cat([ids, out["responses"]], dim=1)
    att = torch.cat([mask, out["response_mask"].long()], dim=1)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=att, position_ids=pos).logits
    p, r = ids.shape[1], out["responses"].shape[1]
    logits = logits[:, p - 1 : p + r - 1]
    # The trainer's function, replaying the rollout's mask as the trainer does.
    return logprobs_from_logits(logits, out["responses"], temperature=temperature, truncation=truncation), logits


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_shapes_dtypes_and_full_length(arch, models, tok) -> None:
    ids, mask = _prompts(tok)
    out = _engine(models[arch], tok, eos=NEVER_EOS).generate(
        ids, mask, SamplingParams(max_new_tokens=5), generator=torch.Generator().manual_seed(0)
    )
    assert set(out) == {"responses", "response_mask", "rollout_log_probs"}
    assert out["responses"].shape == (4, 5) and out["responses"].dtype == torch.long
    assert out["response_mask"].shape == (4, 5) and out["response_mask"].dtype == torch.bool
    assert out["rollout_log_probs"].shape == (4, 5) and out["rollout_log_probs"].dtype == torch.float32
    assert out["response_mask"].all()
    assert (out["rollout_log_probs"] < 0).all()
    assert ((out["responses"] >= 0) & (out["responses"] < len(tok))).all()
    # Outputs are ordinary tensors: callers may edit them in place.
    assert not out["responses"].is_inference()
    out["responses"][0, 0] = 0


def test_eos_stops_rows_and_masks_after_it(models, tok) -> None:
    model = models["qwen3_moe"]
    ids, mask = _prompts(tok)
    free = _engine(model, tok, eos=NEVER_EOS).generate(ids, mask, SamplingParams(max_new_tokens=8, do_sample=False))[
        "responses"
    ]
    # Pick as EOS the token row 0 emits at step 2 (if it also appeared earlier, the first one counts).
    eos = int(free[0, 2])
    out = _engine(model, tok, eos=eos).generate(ids, mask, SamplingParams(max_new_tokens=8, do_sample=False))
    # Expected by hand from the free run: each row cut after its first `eos`, pad after.
    stops = []
    for row in free.tolist():
        stops.append(row.index(eos) + 1 if eos in row else len(row))
    steps = max(stops)
    assert out["responses"].shape == (4, steps)
    for b, stop in enumerate(stops):
        assert out["responses"][b, :stop].tolist() == free[b, :stop].tolist()
        assert out["responses"][b, stop:].eq(tok.pad_token_id).all()
        assert out["response_mask"][b].tolist() == [True] * stop + [False] * (steps - stop)
        assert out["rollout_log_probs"][b, stop:].eq(0).all()
        assert out["rollout_log_probs"][b, :stop].lt(0).all()
    assert stops[0] <= 3


def test_stops_as_soon_as_every_row_is_done(models, tok) -> None:
    model = models["qwen3"]
    ids, mask = _prompts(tok)
    free = _engine(model, tok, eos=NEVER_EOS).generate(ids, mask, SamplingParams(max_new_tokens=1, do_sample=False))[
        "responses"
    ]
    # Alone in its batch, a row whose first greedy token is the EOS ends the loop after one step.
    for b in range(ids.shape[0]):
        out = _engine(model, tok, eos=int(free[b, 0])).generate(
            ids[b : b + 1], mask[b : b + 1], SamplingParams(max_new_tokens=10, do_sample=False)
        )
        assert out["responses"].shape == (1, 1)
        assert out["response_mask"].tolist() == [[True]]


def test_synced_decoding_rides_along_until_every_rank_is_done(models, tok) -> None:
    """A rank that is done keeps stepping while another is not: its rows stay finished, masked and unchanged."""
    model = models["qwen3_moe"]
    ids, mask = _prompts(tok)
    free = _engine(model, tok, eos=NEVER_EOS).generate(ids, mask, SamplingParams(max_new_tokens=8, do_sample=False))[
        "responses"
    ]
    eos = int(free[0, 2])
    rows = [b for b in range(len(free)) if eos in free[b, :6].tolist()]  # every row here finishes early
    ids, mask = ids[rows], mask[rows]
    engine = _engine(model, tok, eos=eos)
    alone = engine.generate(ids, mask, SamplingParams(max_new_tokens=8, do_sample=False, capture_routing=True))
    steps = alone["responses"].shape[1]
    assert steps < 8, "the batch must finish early for the other rank's extra steps to show"
    asked: list[bool] = []

    def other_rank_needs(extra: int):
        # Stands in for the collective: another rank is still decoding for `extra` more steps.
        def synced(done: bool) -> bool:
            asked.append(done)
            return done and len(asked) >= steps + extra

        return synced

    out = engine.generate(
        ids, mask, SamplingParams(max_new_tokens=8, do_sample=False, capture_routing=True), synced=other_rank_needs(2)
    )
    assert out["responses"].shape == (len(rows), steps + 2) and asked[steps - 1 :] == [True] * 3
    assert torch.equal(out["responses"][:, :steps], alone["responses"])
    assert out["responses"][:, steps:].eq(tok.pad_token_id).all() and not out["response_mask"][:, steps:].any()
    assert torch.equal(out["response_mask"][:, :steps], alone["response_mask"])
    assert torch.equal(out["rollout_log_probs"][:, :steps], alone["rollout_log_probs"])
    assert torch.equal(out["routed_experts"][:, : ids.shape[1] + steps], alone["routed_experts"])
    with pytest.raises(ValueError, match="do not combine"):
        engine.generate(ids, mask, SamplingParams(max_new_tokens=2), synced=lambda d: d, interrupt=lambda n: False)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_left_padding_gives_the_unpadded_greedy_continuation(arch, models, tok) -> None:
    model = models[arch]
    ids, mask = _prompts(tok)
    assert (mask == 0).any()  # the batch really is left-padded
    engine = _engine(model, tok, eos=NEVER_EOS)
    batched = engine.generate(ids, mask, SamplingParams(max_new_tokens=6, do_sample=False))
    for b, text in enumerate(PROMPTS):
        one_ids, one_mask = _prompts(tok, [text])
        alone = engine.generate(one_ids, one_mask, SamplingParams(max_new_tokens=6, do_sample=False))
        assert batched["responses"][b].tolist() == alone["responses"][0].tolist()
        torch.testing.assert_close(batched["rollout_log_probs"][b], alone["rollout_log_probs"][0], atol=1e-5, rtol=0)


def test_position_ids_count_real_tokens_only(models, tok) -> None:
    # Rotary models are blind to a constant shift of positions, so the outputs
    # alone cannot show this; the trainer computes positions this way, so the
    # rollout must feed the same ones.
    model = models["qwen3_moe"]
    ids, mask = _prompts(tok)
    seen = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["position_ids"].clone()), with_kwargs=True
    )
    try:
        _engine(model, tok, eos=NEVER_EOS).generate(ids, mask, SamplingParams(max_new_tokens=4, do_sample=False))
    finally:
        handle.remove()
    assert len(seen) == 4  # prefill + 3 decode steps (the last token is never fed)
    lengths = mask.sum(-1)
    expected_prefill = torch.stack([torch.arange(ids.shape[1]) - (ids.shape[1] - n) for n in lengths]).clamp(min=0)
    assert torch.equal(seen[0], expected_prefill)
    for t, pos in enumerate(seen[1:]):
        assert torch.equal(pos, (lengths + t).unsqueeze(-1))


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 0.9)])
def test_rollout_log_probs_match_a_teacher_forced_forward(arch, temperature, top_k, top_p, models, tok) -> None:
    model = models[arch]
    ids, mask = _prompts(tok)
    # A real EOS so that some rows may stop early and exercise the masking.
    out = _engine(model, tok).generate(
        ids,
        mask,
        SamplingParams(max_new_tokens=6, temperature=temperature, top_k=top_k, top_p=top_p),
        generator=torch.Generator().manual_seed(1),
    )
    truncation = Truncation.of(top_k, top_p)
    expected, logits = _teacher_forced_log_probs(model, ids, mask, out, temperature, truncation)
    m = out["response_mask"]
    # Scored under the distribution sampled from: softmax(logits / T) after top-k / top-p, which the trainer replays.
    torch.testing.assert_close(out["rollout_log_probs"][m], expected[m], atol=1e-5, rtol=0)
    assert out["rollout_log_probs"][~m].eq(0).all()
    if top_k > 0:
        rank = (logits > logits.gather(-1, out["responses"].unsqueeze(-1))).sum(-1)
        assert (rank[m] < top_k).all()


def test_greedy_log_probs_use_temperature_one(models, tok) -> None:
    model = models["mixtral"]
    ids, mask = _prompts(tok)
    out = _engine(model, tok).generate(ids, mask, SamplingParams(max_new_tokens=4, do_sample=False, temperature=0.3))
    expected, logits = _teacher_forced_log_probs(model, ids, mask, out, 1.0)
    m = out["response_mask"]
    torch.testing.assert_close(out["rollout_log_probs"][m], expected[m], atol=1e-5, rtol=0)
    assert torch.equal(out["responses"][m], logits.argmax(-1)[m])


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_top_k_one_equals_greedy(arch, models, tok) -> None:
    ids, mask = _prompts(tok)
    engine = _engine(models[arch], tok)
    greedy = engine.generate(ids, mask, SamplingParams(max_new_tokens=6, do_sample=False))
    top1 = engine.generate(
        ids, mask, SamplingParams(max_new_tokens=6, top_k=1), generator=torch.Generator().manual_seed(5)
    )
    for key in ("responses", "response_mask"):
        assert torch.equal(top1[key], greedy[key]), key
    # Top-1 keeps one token: it was sampled with probability 1, and is scored so.
    assert top1["rollout_log_probs"].eq(0).all()


def test_seeded_generator_is_deterministic(models, tok) -> None:
    ids, mask = _prompts(tok)
    engine = _engine(models["olmoe"], tok, eos=NEVER_EOS)
    runs = [
        engine.generate(ids, mask, SamplingParams(max_new_tokens=8), generator=torch.Generator().manual_seed(s))
        for s in (3, 3, 4)
    ]
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key
    assert not torch.equal(runs[0]["responses"], runs[2]["responses"])


def _truncated_tempered(logits, temperature, top_k, top_p):
    """The sampling distribution by hand: tempered softmax, top-k, then the smallest most-likely set reaching top_p."""
    probs = torch.softmax(logits / temperature, dim=-1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(probs.argsort(descending=True).tolist()):
        # top_p 1.0 truncates nothing: a float sum of the probabilities may reach 1.0 before the last tokens.
        if (top_k > 0 and rank >= top_k) or (top_p < 1.0 and mass >= top_p):
            break
        keep[token] = True
        mass += float(probs[token])
    expected = torch.where(keep, probs, torch.zeros_like(probs))
    return expected / expected.sum(), keep


def _assert_frequencies(tokens, expected, keep) -> None:
    n = tokens.numel()
    freq = torch.bincount(tokens, minlength=expected.numel()).float() / n
    assert freq[~keep].sum() == 0  # nothing outside the truncated set
    se = (expected * (1 - expected) / n).sqrt()
    assert ((freq - expected).abs() <= 5 * se + 1e-3).all(), (freq, expected)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.5, 3, 1.0), (0.6, 0, 1.0), (1.5, 0, 0.8), (1.0, 4, 0.5)]
)
def test_sampler_follows_the_truncated_tempered_distribution(temperature, top_k, top_p, models, tok) -> None:
    ids, _ = _prompts(tok, ["1+2="])
    with torch.no_grad():
        logits = models["qwen3_moe"](input_ids=ids).logits[0, -1]
    n = 20000
    sampler = _Sampler(temperature, top_k, top_p, True, torch.Generator().manual_seed(0))
    tokens, logp = sampler(logits.expand(n, -1))
    expected, keep = _truncated_tempered(logits, temperature, top_k, top_p)
    _assert_frequencies(tokens, expected, keep)
    # Scored under the distribution it sampled from: the truncated, renormalised tempered softmax.
    torch.testing.assert_close(logp[0].exp(), expected, atol=1e-6, rtol=1e-5)
    assert bool(torch.isneginf(logp[0][~keep]).all())


def test_generate_samples_from_the_truncated_tempered_distribution(models, tok) -> None:
    model = models["qwen3_moe"]
    n, temperature, top_k = 2000, 0.5, 3
    ids, mask = _prompts(tok, ["1+2="])
    out = _engine(model, tok).generate(
        ids.expand(n, -1),
        mask.expand(n, -1),
        SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k),
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    expected, keep = _truncated_tempered(logits, temperature, top_k, 1.0)
    _assert_frequencies(out["responses"][:, 0], expected, keep)


def test_filter_top_k_top_p_by_hand() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    inf = float("-inf")

    def kept(top_k, top_p):
        return (_filter_top_k_top_p(logits, top_k, top_p) != inf)[0].tolist()

    assert kept(0, 0.6) == [True, True, False, False]  # 0.5 < 0.6, 0.5 + 0.3 reaches it
    assert kept(0, 0.85) == [True, True, True, False]
    assert kept(0, 0.1) == [True, False, False, False]  # the top token is always kept
    assert kept(2, 1.0) == [True, True, False, False]
    assert kept(3, 0.6) == [True, True, False, False]
    shuffled = logits[:, [2, 0, 3, 1]]
    assert (_filter_top_k_top_p(shuffled, 0, 0.6) != inf)[0].tolist() == [False, True, False, True]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routed_experts_match_a_teacher_forced_forward(arch, models, tok) -> None:
    model = models[arch]
    info = moe_info(model)
    ids, mask = _prompts(tok)
    free = _engine(model, tok, eos=NEVER_EOS).generate(ids, mask, SamplingParams(max_new_tokens=6, do_sample=False))[
        "responses"
    ]
    # An EOS that row 0 emits at step 1, so rows end at different steps.
    out = _engine(model, tok, eos=int(free[0, 1])).generate(
        ids,
        mask,
        SamplingParams(max_new_tokens=6, do_sample=False, capture_routing=True),
        generator=torch.Generator().manual_seed(2),
    )
    routed = out["routed_experts"]
    p, r = ids.shape[1], out["responses"].shape[1]
    assert routed.shape == (4, p + r, info.num_layers, info.top_k) and routed.dtype == torch.int16
    assert routed.is_contiguous() and not routed.is_inference()

    # Where -1 must be: prompt pads, each row's last sampled token, and everything after it.
    resp_len = out["response_mask"].sum(-1)
    known = torch.zeros(4, p + r, dtype=torch.bool)
    known[:, :p] = mask.bool()
    for b in range(4):
        known[b, p : p + int(resp_len[b]) - 1] = True
    assert (resp_len < r).any()  # some row ended early
    assert torch.equal((routed >= 0).all(-1).all(-1), known)
    assert torch.equal((routed == -1).all(-1).all(-1), ~known)

    seq = torch.cat([ids, out["responses"]], dim=1)
    att = torch.cat([mask, out["response_mask"].long()], dim=1)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), RoutingRecorder(model) as rec:
        model(input_ids=seq, attention_mask=att, position_ids=pos)
        expected = rec.pop()
    assert torch.equal(routed[known], expected[known])


def test_capture_routing_on_a_dense_model_omits_the_key(models, tok) -> None:
    ids, mask = _prompts(tok)
    out = _engine(models["qwen3"], tok).generate(ids, mask, SamplingParams(max_new_tokens=3, capture_routing=True))
    assert "routed_experts" not in out


def test_training_mode_is_restored_and_no_grad_leaks(models, tok) -> None:
    model = models["qwen3_moe"]
    ids, mask = _prompts(tok)
    model.train()
    try:
        out = _engine(model, tok).generate(ids, mask, SamplingParams(max_new_tokens=3))
        assert model.training
        assert not out["rollout_log_probs"].requires_grad
    finally:
        model.eval()
    _engine(model, tok).generate(ids, mask, SamplingParams(max_new_tokens=2))
    assert not model.training


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2, "temperature": 0.0}, "temperature"),
        ({"max_new_tokens": 2, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 2, "top_k": -2}, "top_k"),
    ],
)
def test_bad_arguments_raise(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_inputs_raise(models, tok) -> None:
    ids, mask = _prompts(tok)
    engine = _engine(models["qwen3"], tok)
    with pytest.raises(ValueError, match="attention_mask"):
        engine.generate(ids, mask[:, 1:], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(ids[0], mask[0], SamplingParams(max_new_tokens=2))
    empty_row = mask.clone()
    empty_row[1] = 0
    with pytest.raises(ValueError, match="all zeros"):
        engine.generate(ids, empty_row, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="pad prompts on the left"):
        engine.generate(ids, mask.flip(-1), SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="pad_token_id"):
        HFEngine(models["qwen3"], pad_token_id=None, eos_token_id=1)


def test_greedy_ignores_temperature_zero(models, tok) -> None:
    ids, mask = _prompts(tok)
    engine = _engine(models["qwen3"], tok)
    a = engine.generate(ids, mask, SamplingParams(max_new_tokens=3, do_sample=False, temperature=0.0))
    b = engine.generate(ids, mask, SamplingParams(max_new_tokens=3, do_sample=False))
    assert torch.equal(a["responses"], b["responses"])


def test_inverse_cdf_sampling_never_picks_a_zero_probability_token_and_follows_the_weights() -> None:
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([_sample(probs, gen) for _ in range(20_000)])  # (N, 3)
    assert set(draws[:, 0].tolist()) == {1, 3}
    assert (draws[:, 1] == 0).all() and (draws[:, 2] == 4).all()
    share = (draws[:, 0] == 3).float().mean().item()
    assert abs(share - 0.8) < 0.015  # about 5 standard errors


# --------------------------------------------------------------------------- partial rollouts (interrupt)
def _rollout(engine, model, tok, eos=None):
    """The hf rollout over the Hugging Face forward ("hf") or over `LeanForward` ("lean", Qwen3 models)."""
    from conveyor.models.lean import LeanForward

    hf = _engine(model, tok, eos)
    if engine == "hf":
        return hf
    return HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=hf.eos_token_id, lean=LeanForward(model))


def _loading_at(switch: int, model, new_state):
    """An interrupt that loads `new_state` into `model` after `switch` sampled tokens, and says so."""

    def interrupt(sampled: int) -> bool:
        if sampled == switch:
            model.load_state_dict(new_state)
            return True
        return False

    return interrupt


ENGINES = [(arch, "hf") for arch in TINY_ARCHS] + [("qwen3", "lean"), ("qwen3_moe", "lean")]


@pytest.mark.parametrize(("arch", "engine"), ENGINES)
def test_an_interrupted_and_resumed_greedy_generation_equals_an_uninterrupted_one(arch, engine, models, tok) -> None:
    model = models[arch]
    ids, mask = _prompts(tok)
    free = _engine(model, tok, eos=NEVER_EOS).generate(ids, mask, SamplingParams(max_new_tokens=8, do_sample=False))[
        "responses"
    ]
    rollout = _rollout(engine, model, tok, eos=int(free[0, 2]))  # row 0 ends at step 2, the others run on
    params = SamplingParams(max_new_tokens=8, do_sample=False, capture_routing=True)
    whole = rollout.generate(ids, mask, params)
    calls = []

    def interrupt(sampled: int) -> bool:
        calls.append(sampled)
        return sampled in (1, 3, 4)  # resume from a prefix three times, once right after row 0 finished

    resumed = rollout.generate(ids, mask, params, interrupt=interrupt)
    r = whole["responses"].shape[1]
    assert r == 8 and calls == list(range(1, r))
    assert torch.equal(resumed["responses"], whole["responses"])
    assert torch.equal(resumed["response_mask"], whole["response_mask"])
    # The resumed cache comes from one prefill instead of step-by-step decoding: the same values up to
    # float rounding.
    torch.testing.assert_close(resumed["rollout_log_probs"], whole["rollout_log_probs"], atol=1e-5, rtol=0)
    if arch in MOE_ARCHS:
        assert torch.equal(resumed["routed_experts"], whole["routed_experts"])
    else:
        assert "routed_experts" not in resumed


@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_after_a_weight_change_mid_generation_tokens_log_probs_and_routing_follow_the_new_weights(
    engine, models, tok
) -> None:
    old = models["qwen3_moe"]
    model = build_tiny_model("qwen3_moe", tok, seed=0, initializer_range=0.3).eval()
    new_state = build_tiny_model("qwen3_moe", tok, seed=1, initializer_range=0.3).state_dict()
    ids, mask = _prompts(tok)
    rollout = _rollout(engine, model, tok, eos=NEVER_EOS)
    switch = 3

    interrupt = _loading_at(switch, model, new_state)

    out = rollout.generate(
        ids,
        mask,
        SamplingParams(max_new_tokens=7, do_sample=True, capture_routing=True),
        generator=torch.Generator().manual_seed(0),
        interrupt=interrupt,
    )
    # Each token's log-prob is that of the weights that sampled it: the old ones before the switch, the
    # new ones after, each as a teacher-forced forward over the final sequence computes it.
    before, _ = _teacher_forced_log_probs(old, ids, mask, out, 1.0)
    after, _ = _teacher_forced_log_probs(model, ids, mask, out, 1.0)
    torch.testing.assert_close(out["rollout_log_probs"][:, :switch], before[:, :switch], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["rollout_log_probs"][:, switch:], after[:, switch:], atol=1e-5, rtol=0)
    assert (before[:, switch:] - after[:, switch:]).abs().max() > 0.1  # the two really differ
    # Routing stays aligned with its tokens: every fed position holds the routing of the cache the later
    # tokens were sampled from, which after the switch is the new weights' routing of the whole prefix,
    # what R3 replays and the load-balance metrics count.
    seq = torch.cat([ids, out["responses"]], dim=1)
    att = torch.cat([mask, out["response_mask"].long()], dim=1)
    with torch.no_grad(), RoutingRecorder(model) as rec:
        model(input_ids=seq, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0))
        expected = rec.pop()
    known = (out["routed_experts"] >= 0).all(-1).all(-1)
    p = ids.shape[1]
    assert torch.equal(known[:, :p], mask.bool()) and bool(known[:, p : p + 6].all())
    assert torch.equal(out["routed_experts"][known], expected[known].to(torch.int16))
    with torch.no_grad(), RoutingRecorder(old) as rec:
        old(input_ids=seq, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0))
        stale = rec.pop()
    assert not torch.equal(stale[known], expected[known])  # the old weights route differently


def test_keeping_the_kv_across_a_weight_change_decodes_the_new_weights_over_the_old_weights_cache(tok) -> None:
    old = build_tiny_model("qwen3", tok, seed=0, initializer_range=0.3).eval()
    model = build_tiny_model("qwen3", tok, seed=0, initializer_range=0.3).eval()
    new_state = build_tiny_model("qwen3", tok, seed=1, initializer_range=0.3).state_dict()
    ids, mask = _prompts(tok)
    rollout = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=NEVER_EOS, in_flight_kv="keep")
    switch = 3

    interrupt = _loading_at(switch, model, new_state)

    params = SamplingParams(max_new_tokens=7, do_sample=True)
    out = rollout.generate(ids, mask, params, generator=torch.Generator().manual_seed(0), interrupt=interrupt)
    # The reference: the old weights' cache of the prompt and the tokens fed before the switch (all but the last
    # one sampled), then the new weights over the rest of the sequence on top of it.
    seq = torch.cat([ids, out["responses"]], dim=1)
    att = torch.cat([mask, out["response_mask"].long()], dim=1)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    cut = ids.shape[1] + switch - 1
    with torch.no_grad():
        cache = old(input_ids=seq[:, :cut], attention_mask=att[:, :cut], position_ids=pos[:, :cut]).past_key_values
        logits = model(
            input_ids=seq[:, cut:-1], attention_mask=att[:, :-1], position_ids=pos[:, cut:-1], past_key_values=cache
        ).logits
    want = torch.log_softmax(logits.float(), -1).gather(-1, out["responses"][:, switch:, None])[..., 0]
    before, _ = _teacher_forced_log_probs(old, ids, mask, out, 1.0)
    torch.testing.assert_close(out["rollout_log_probs"][:, :switch], before[:, :switch], atol=1e-5, rtol=0)
    torch.testing.assert_close(out["rollout_log_probs"][:, switch:], want, atol=1e-5, rtol=0)
    # Not what recomputing the cache gives: the kept keys and values are the old weights'.
    recomputed, _ = _teacher_forced_log_probs(model, ids, mask, out, 1.0)
    assert (recomputed[:, switch:] - want).abs().max() > 0.01
    with pytest.raises(ValueError, match="in_flight_kv"):
        HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=NEVER_EOS, in_flight_kv="drop")


@pytest.mark.parametrize("impl", ["hf", "lean"])
def test_router_margins_match_a_teacher_forced_forward_where_the_routing_is_known(impl, models, tok) -> None:
    from conveyor.models.lean import LeanForward
    from conveyor.models.moe_routing import RouterStatsRecorder

    model = models["qwen3_moe"]
    ids, mask = _prompts(tok)
    free = _engine(model, tok, eos=NEVER_EOS).generate(ids, mask, SamplingParams(max_new_tokens=6, do_sample=False))
    lean = LeanForward(model) if impl == "lean" else None
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=int(free["responses"][0, 1]), lean=lean)
    params = SamplingParams(max_new_tokens=6, do_sample=False, capture_routing=True)
    assert "router_margins" not in engine.generate(ids, mask, params)  # asked for routing only
    out = engine.generate(ids, mask, params.replace(capture_router_margins=True))
    margins, routed = out["router_margins"], out["routed_experts"]
    assert margins.shape == routed.shape[:3] and margins.dtype == torch.float32
    known = (routed >= 0).all(-1)
    assert torch.equal(~torch.isnan(margins), known)  # NaN exactly where the routing is unknown

    seq = torch.cat([ids, out["responses"]], dim=1)
    att = torch.cat([mask, out["response_mask"].long()], dim=1)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), RouterStatsRecorder(model, att.bool().flatten()) as rec:
        model(input_ids=seq, attention_mask=att, position_ids=pos)
    expected = rec.result().margin.view(*seq.shape, -1)
    assert bool((margins[known] >= 0).all())
    torch.testing.assert_close(margins[known], expected[known], atol=1e-5, rtol=1e-4)
