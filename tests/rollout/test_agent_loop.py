"""The multi-turn agent loop on a real tiny MoE model: masks, log-probs and routing against teacher forcing;
concurrent tools; tools that raise or time out."""

from __future__ import annotations

import threading

import pytest
import torch

from conveyor.algos.trajectory import response_span, segments, span_lengths
from conveyor.metrics.moe_load_balance import count_expert_assignments
from conveyor.models.lean import LeanForward
from conveyor.models.moe_routing import RoutingRecorder
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.agent_loop import AgentLoop, AgentLoopSettings, truncate_text
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFEngine
from conveyor.tools.base import make_tool
from conveyor.tools.formats import CallFormat, ToolCall

PROMPTS = ["1+2=", "12+345=", "7*8=", "100-1="]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model("qwen3_moe", tok, seed=0).eval()


def _echo(text: str) -> str:
    """A tool whose answer length varies with the call."""
    return "ab" * (len(text) % 3 + 1)


# A turn ends at a "7" or an "8" and calls `echo` with its text: with a random model, samples make 0, 1 or
# several calls, which is what alignment must survive.
DIGIT_CALLS = CallFormat(
    "digits",
    stop_texts=("7", "8"),
    parser=lambda turn: ToolCall("echo", text=turn) if turn.endswith(("7", "8")) else None,
)
# Every turn (ended early by any of many common characters) calls `slow`: many calls in one round.
ALWAYS = CallFormat(
    "always", stop_texts=tuple("0123456789abcdefghijklmnop"), parser=lambda turn: ToolCall("slow", text=turn)
)


def _prompts(tok, texts, repeat=1):
    enc = tok(texts * repeat, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _teacher_forced(model, ids, mask, out):
    """Log-probs of every response token and the routing of every position, from one forward over the stitched rows."""
    seq = torch.cat([ids, out["responses"]], dim=1)
    att = torch.cat([mask, response_span(out["response_mask"]).long()], dim=1)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), RoutingRecorder(model) as rec:
        logits = model(input_ids=seq, attention_mask=att, position_ids=pos).logits
        routing = rec.pop()
    p, r = ids.shape[1], out["responses"].shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : p + r - 1].float(), dim=-1)
    return logp.gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1), routing


@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_trajectories_align_with_a_teacher_forced_forward(engine, model, tok) -> None:
    rollout = HFEngine(
        model,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        lean=LeanForward(model) if engine == "lean" else None,
    )
    loop = AgentLoop(rollout, tok, {"echo": make_tool(_echo)}, DIGIT_CALLS)
    ids, mask = _prompts(tok, PROMPTS, repeat=3)
    out = loop.run(
        ids, mask, SamplingParams(max_new_tokens=40, capture_routing=True), generator=torch.Generator().manual_seed(3)
    )
    resp, model_mask, lp = out["responses"], out["response_mask"], out["rollout_log_probs"]
    routed = out["routed_experts"]
    p = ids.shape[1]
    assert routed.shape[:2] == (ids.shape[0], p + resp.shape[1]) and routed.dtype == torch.int16

    calls_per_sample = []
    for i in range(len(resp)):
        runs = segments(model_mask[i])
        tool_runs = [(a, b) for is_model, a, b in runs if not is_model]
        calls_per_sample.append(len(tool_runs))
        # Each tool run is the echo of the model run before it, and each call-making run ends at a stop digit.
        for (is_model, a, b), nxt in zip(runs, runs[1:]):
            if is_model:
                turn = tok.decode(resp[i, a:b].tolist(), skip_special_tokens=True)
                assert turn[-1] in "78"
                assert tok.decode(resp[i, nxt[1] : nxt[2]].tolist()) == _echo(turn)
        assert runs and runs[0][0] and runs[-1][0]  # starts and ends with the model's tokens
    assert {0, 1} <= set(calls_per_sample) and max(calls_per_sample) >= 2, calls_per_sample

    want_lp, want_routing = _teacher_forced(model, ids, mask, out)
    span = response_span(model_mask)
    # Log-probs: the sampler's equal teacher forcing on every model token; 0 on tool tokens and pads.
    torch.testing.assert_close(lp[model_mask], want_lp[model_mask], atol=2e-4, rtol=0)
    assert (lp[~model_mask] == 0).all()
    # Routing: prompt tokens and every model token but the last as teacher forcing; -1 on tool tokens,
    # the last model token, pads.
    last = span_lengths(model_mask) - 1
    known = torch.cat([mask.bool(), model_mask.clone()], dim=1)
    known[torch.arange(len(resp)), p + last] = False
    got = routed.long().sort(-1).values
    want = want_routing.long().sort(-1).values
    assert (got[known] == want[known]).all()
    assert (routed[~known] == -1).all()
    assert (routed[known] >= 0).all()
    # Load-balance counts see only model tokens whose routing is known: tool tokens are excluded.
    counts = count_expert_assignments(routed, model_mask, num_experts=model.config.num_experts)
    fed_model_tokens = int(known[:, p:].sum())
    assert int(counts.sum()) == fed_model_tokens * routed.shape[2] * routed.shape[3]
    # The trainer's forward (lean, over the span) agrees with the sampler too.
    logits, _ = LeanForward(model).response_logits(ids, mask, resp, span)
    trainer_lp = torch.log_softmax(logits.float(), -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(trainer_lp[model_mask], lp[model_mask], atol=2e-4, rtol=0)

    m = out["metrics"]
    n = len(resp)
    assert (
        m["rollout/multi_turn/tool_calls@sum"] == sum(calls_per_sample)
        and m["rollout/multi_turn/tool_calls@count"] == n
    )
    assert m["rollout/multi_turn/model_token_frac@sum"] == model_mask.sum()
    assert m["rollout/multi_turn/model_token_frac@count"] == span.sum()
    assert m["rollout/multi_turn/tool_errors@sum"] == 0


def test_turn_limits_and_budget(model, tok) -> None:
    rollout = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    ids, mask = _prompts(tok, PROMPTS, repeat=2)
    for settings, most in [(AgentLoopSettings(max_assistant_turns=1), 0), (AgentLoopSettings(max_user_turns=1), 1)]:
        loop = AgentLoop(rollout, tok, {"echo": make_tool(_echo)}, DIGIT_CALLS, settings)
        out = loop.run(ids, mask, SamplingParams(max_new_tokens=30), generator=torch.Generator().manual_seed(3))
        tools = [sum(1 for is_model, _, _ in segments(row) if not is_model) for row in out["response_mask"]]
        assert max(tools) <= most
        assert out["responses"].shape[1] <= 30


def test_tools_run_concurrently_across_samples(model, tok) -> None:
    lock, state = threading.Lock(), {"now": 0, "most": 0}
    # Two calls must be inside at once for either to pass: serial calls would time out here.
    barrier = threading.Barrier(2, timeout=20)

    def slow(text: str) -> str:
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        try:
            barrier.wait()
            return "ok"
        finally:
            with lock:
                state["now"] -= 1

    rollout = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    loop = AgentLoop(
        rollout,
        tok,
        {"slow": make_tool(slow)},
        ALWAYS,
        AgentLoopSettings(max_user_turns=1, tool_workers=4, tool_timeout_s=30),
    )
    ids, mask = _prompts(tok, PROMPTS)
    out = loop.run(ids, mask, SamplingParams(max_new_tokens=40), generator=torch.Generator().manual_seed(0))
    assert state["most"] >= 2
    assert out["metrics"]["rollout/multi_turn/tool_errors@sum"] == 0
    assert out["metrics"]["rollout/multi_turn/tool_calls@sum"] == 4


def test_a_tool_that_raises_or_times_out_answers_an_error_and_the_run_goes_on(model, tok) -> None:
    release = threading.Event()

    def boom(text: str) -> str:
        raise RuntimeError("boom")

    def hang(text: str) -> str:
        release.wait(30)
        return "late"

    rollout = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    ids, mask = _prompts(tok, PROMPTS[:2])
    try:
        for fn, expect in [(boom, "error: RuntimeError: boom"), (hang, "error: tool 'slow' timed out after 0.2s")]:
            # One worker: a call that hangs must give its slot up at its timeout, or the second would never run.
            loop = AgentLoop(
                rollout,
                tok,
                {"slow": make_tool(fn)},
                ALWAYS,
                AgentLoopSettings(max_user_turns=1, tool_timeout_s=0.2, max_tool_response_length=500, tool_workers=1),
            )
            out = loop.run(ids, mask, SamplingParams(max_new_tokens=60), generator=torch.Generator().manual_seed(0))
            m = out["metrics"]
            assert m["rollout/multi_turn/tool_errors@sum"] == 2
            assert m["rollout/multi_turn/tool_error_rate@sum"] / m["rollout/multi_turn/tool_error_rate@count"] == 1.0
            for row, rmask in zip(out["responses"], out["response_mask"]):
                tool = [(a, b) for is_model, a, b in segments(rmask) if not is_model]
                # The char tokenizer has no upper case: the message reads in lower case, unknown letters as <unk>.
                text = tok.decode(row[tool[0][0] : tool[0][1]].tolist(), skip_special_tokens=True)
                assert text == "".join(c for c in expect if c in "abcdefghijklmnopqrstuvwxyz0123456789 :.'")
    finally:
        release.set()


def test_generate_stops_a_row_at_a_stop_sequence(model, tok) -> None:
    rollout = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=10_000)  # EOS never sampled
    ids, mask = _prompts(tok, PROMPTS)
    free = rollout.generate(ids, mask, SamplingParams(max_new_tokens=12, do_sample=False))["responses"]
    stop = free[0, 3:5].tolist()  # two tokens row 0 writes at steps 3 and 4
    out = rollout.generate(ids, mask, SamplingParams(max_new_tokens=12, do_sample=False, stop_sequences=[stop]))
    for row, full, rmask in zip(out["responses"].tolist(), free.tolist(), out["response_mask"]):
        ends = [t + 2 for t in range(len(full) - 1) if full[t : t + 2] == stop]
        n = ends[0] if ends else len(full)
        assert int(rmask.sum()) == n and row[:n] == full[:n]
    with pytest.raises(ValueError, match="stop sequence is empty"):
        rollout.generate(ids, mask, SamplingParams(max_new_tokens=2, stop_sequences=[[]]))


def test_truncate_text_sides() -> None:
    assert truncate_text("abcdef", 10, "middle") == "abcdef"
    assert truncate_text("abcdefgh", 4, "left") == "...efgh"
    assert truncate_text("abcdefgh", 4, "right") == "abcd..."
    assert truncate_text("abcdefgh", 4, "middle") == "ab...gh"
