"""The agent gateway on a real tiny MoE model: agents in other processes on the real `openai` client reproduce the
built-in tool loop token for token; sessions cut where a prompt stops extending; every refusal and failure."""

from __future__ import annotations

import sys
import time

import pytest
import torch
from gateway_cases import AGENT, PROMPTS

from conveyor.algos.trajectory import response_span
from conveyor.models.moe_routing import RoutingRecorder
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.agent_loop import AgentLoop, AgentLoopSettings
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.gateway import GatewayLoop, GatewaySettings
from conveyor.rollout.gateway.trajectory import session_task
from conveyor.rollout.hf import HFEngine
from conveyor.tools import get_format, load_tools
from conveyor.user_code import import_user_code

import_user_code("tests/agent/digit_format.py", key="test")  # registers test_digit_calls, as the agents' --plugin does


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model("qwen3_moe", tok, seed=0).eval()


@pytest.fixture(scope="module")
def engine(model, tok):
    return HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def _tasks(prompts):
    return [session_task([{"role": "user", "content": p}], "t", "0", {}, p) for p in prompts]


def _batch(tok, prompts):
    enc = tok(prompts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _gateway(engine, tok, **kw):
    settings = GatewaySettings(**{"command": AGENT, "batch_wait_s": 120.0, **kw})
    return GatewayLoop(engine, tok, get_format("test_digit_calls"), settings)


def test_gateway_reproduces_the_builtin_tool_loop_bitwise(engine, tok, monkeypatch) -> None:
    monkeypatch.setattr(engine, "weights_version", 3)  # as a sync labels the weights it brings
    prompts = PROMPTS * 2
    ids, mask = _batch(tok, prompts)
    params = SamplingParams(max_new_tokens=24, capture_routing=True)
    tools = load_tools("examples/tools/calculator.yaml")
    settings = AgentLoopSettings(max_assistant_turns=3, max_user_turns=2, max_tool_response_length=16)
    ref = AgentLoop(engine, tok, tools, get_format("test_digit_calls"), settings).run(
        ids, mask, params, generator=torch.Generator().manual_seed(5)
    )
    gw = _gateway(engine, tok)
    try:
        out = gw.run(ids, mask, params, generator=torch.Generator().manual_seed(5), tasks=_tasks(prompts))
    finally:
        gw.close()
    assert out.source_rows.tolist() == list(range(len(prompts)))  # every session extended itself: one row each
    assert torch.equal(out.prompts, ids) and torch.equal(out.prompt_mask, mask.bool())
    span = response_span(ref["response_mask"])
    width = span.shape[1]
    assert span.sum(-1).tolist() == response_span(out["response_mask"]).sum(-1).tolist()
    assert int(ref["response_mask"].sum()) > 0 and ref.metrics["rollout/multi_turn/tool_calls@sum"] > 0
    for name in ("responses", "response_mask", "rollout_log_probs"):
        a = ref[name][:, :width]
        b = torch.nn.functional.pad(out[name], (0, max(0, width - out[name].shape[1])))[:, :width]
        zero = torch.zeros_like(a)
        assert torch.equal(torch.where(span, a, zero), torch.where(span, b, zero)), name
    p = ids.shape[1]
    known = torch.cat([mask.bool(), span], dim=1)[:, :, None, None]
    ra = ref["routed_experts"][:, : p + width]
    rb = torch.nn.functional.pad(out["routed_experts"], (0, 0, 0, 0, 0, p + width), value=-1)[:, : p + width]
    assert torch.equal(torch.where(known, ra, -1), torch.where(known, rb, -1))
    m = out.metrics
    assert m["rollout/agent/ok@sum"] == len(prompts) and m["rollout/agent/reward_source_rule@sum"] == len(prompts)
    assert torch.isnan(out.sample_fields["agent_reward"]).all()
    for row, calls in enumerate(out.sample_fields["agent_calls"]):  # each call as it happened, in order
        model = int(out["response_mask"][row].sum())
        assert sum(c["completion_tokens"] for c in calls) == model and all(c["version"] == 3 for c in calls)
        assert calls[0]["prompt_tokens"] == int(mask[row].sum())
    # Each token's policy version, as the built-in rollout's replica writes it (every column: the weights' version).
    versions = out.sample_fields["token_policy_version"]
    assert versions.shape == out["responses"].shape and versions.dtype == torch.long
    builtin = torch.full(ref["response_mask"].shape, 3, dtype=torch.long)[:, :width]
    mine = torch.nn.functional.pad(versions, (0, max(0, width - versions.shape[1])), value=3)[:, :width]
    assert torch.equal(torch.where(span, mine, 0), torch.where(span, builtin, 0))
    assert bool((versions == 3).all())


def test_each_token_carries_the_version_of_the_call_that_fed_or_sampled_it(engine, tok, monkeypatch) -> None:
    import openai

    monkeypatch.setattr(engine, "weights_version", 3)
    got: list = []

    def agent(base_url: str, api_key: str, task: dict) -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        first = client.completions.create(model="x", prompt=task["prompt"][0]["content"], max_tokens=4)
        ext = first.model_extra["conveyor"]
        got.append(ext)
        engine.weights_version = 4  # new weights between two calls of the session (the engine is idle now)
        extended = ext["prompt_token_ids"] + ext["completion_token_ids"] + tok.encode("7=", add_special_tokens=False)
        got.append(client.completions.create(model="x", prompt=extended, max_tokens=4).model_extra["conveyor"])

    gw = GatewayLoop(engine, tok, get_format("hash"), GatewaySettings(callable=agent, batch_wait_s=5.0))
    out = _run(gw, tok, ["1+2="], max_new=16)
    assert out.source_rows.tolist() == [0]  # the second call extended the first: one sample
    first, second = (len(g["completion_token_ids"]) for g in got)
    fed = len(got[1]["prompt_token_ids"]) - len(got[0]["prompt_token_ids"]) - first  # the call's new context
    versions = out.sample_fields["token_policy_version"][0].tolist()
    n = first + fed + second
    assert versions[:n] == [3] * first + [4] * (fed + second)
    assert versions[n:] == [4] * (len(versions) - n)  # padding: the newest
    assert [c["version"] for c in out.sample_fields["agent_calls"][0]] == [3, 4]


def _run(gw, tok, prompts, max_new=12, seed=0, capture=False):
    ids, mask = _batch(tok, prompts)
    params = SamplingParams(max_new_tokens=max_new, capture_routing=capture)
    try:
        return gw.run(ids, mask, params, generator=torch.Generator().manual_seed(seed), tasks=_tasks(prompts))
    finally:
        gw.close()


def test_requests_are_checked_and_refused_with_openai_errors(engine, tok) -> None:
    import httpx
    import openai

    seen: dict[str, object] = {}

    def agent(base_url: str, api_key: str, task: dict) -> float:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        root = base_url.removesuffix("/v1")
        msgs = task["prompt"]
        seen["models"] = [m.id for m in client.models.list().data]
        with httpx.Client() as http:
            auth = {"Authorization": f"Bearer {api_key}"}
            url = f"{base_url}/chat/completions"
            seen["no_key"] = http.post(url, json={"messages": msgs}).status_code
            seen["wrong_key"] = http.post(
                url, json={"messages": msgs}, headers={"Authorization": "Bearer x"}
            ).status_code
            other = base_url.replace(root.rsplit("/", 1)[-1], "s-nobody")
            seen["unknown"] = http.post(f"{other}/chat/completions", json={"messages": msgs}, headers=auth).status_code
            bad = http.post(url, content=b"{not json", headers=auth)
            seen["malformed"] = bad.status_code
            for field, value in [
                ("n", 2),
                ("frequency_penalty", 0.5),
                ("top_logprobs", 3),
                ("tool_choice", "required"),
                ("logit_bias", {"5": 1}),
                ("frobnicate", 1),
            ]:
                r = http.post(url, json={"messages": msgs, field: value}, headers=auth)
                seen[field] = (r.status_code, r.json()["error"]["param"])
            r = http.post(url, json={"messages": msgs, "max_tokens": 10_000}, headers=auth)
            seen["huge_prompt"] = http.post(
                url, json={"messages": [{"role": "user", "content": "1" * 200}]}, headers=auth
            ).json()["error"]["type"]
            seen["reward_bad"] = http.post(f"{root}/reward", json={"reward": "high"}, headers=auth).status_code
        reply = client.chat.completions.create(
            model="x", messages=msgs, max_tokens=5, temperature=0.1, seed=3, logprobs=True
        )
        seen["overridden"] = reply.model_extra["conveyor"]["overridden"]
        seen["logprobs"] = [t.logprob for t in reply.choices[0].logprobs.content]
        seen["ids"] = reply.model_extra["conveyor"]["completion_token_ids"]
        chunks = list(client.chat.completions.create(model="x", messages=msgs, max_tokens=3, stream=True))
        seen["stream"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        seen["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        text = client.completions.create(model="x", prompt=[5, 6, 7], max_tokens=2, logprobs=0)
        seen["completion_ids"] = text.model_extra["conveyor"]["prompt_token_ids"]
        return 1.0

    from conveyor.rollout.gateway import loop as gateway_loop

    gw = GatewayLoop(engine, tok, get_format("hash"), GatewaySettings(callable=agent, batch_wait_s=0.05))
    out = _run(gw, tok, ["1+2="])
    assert seen["models"] == ["conveyor-policy"]
    assert (seen["no_key"], seen["wrong_key"], seen["unknown"], seen["malformed"]) == (401, 401, 404, 400)
    for field in ("n", "frequency_penalty", "top_logprobs", "tool_choice", "logit_bias", "frobnicate"):
        assert seen[field] == (400, field)
    assert seen["huge_prompt"] == "context_length_exceeded"
    assert seen["reward_bad"] == 400
    assert seen["overridden"] == ["temperature", "seed"]
    assert len(seen["logprobs"]) == len(seen["ids"]) > 0 and all(lp <= 0 for lp in seen["logprobs"])
    assert isinstance(seen["stream"], str) and seen["finish"] in ("stop", "length")
    assert seen["completion_ids"] == [5, 6, 7]
    m = out.metrics
    assert m["rollout/agent/ok@sum"] == 1 and m["rollout/agent/reward_source_return@sum"] == 1
    assert m["rollout/agent/bad_requests@sum"] == 9 and m["rollout/agent/context_exceeded@sum"] == 1
    assert m["rollout/agent/unauthorized@sum"] == 2 and m["rollout/agent/unknown_session@sum"] == 1
    assert out.sample_fields["agent_reward"].tolist() == [1.0] * 4  # four calls from the task's own prompt: 4 samples
    assert gateway_loop.GatewayLoop.needs_tasks


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_failing_agents_are_counted_scored_and_leave_no_process(engine, tok, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AGENT_PID_DIR", str(tmp_path))
    base = f"{sys.executable} tests/agent/gateway_agents.py"
    prompts = ["1+2="] * 3
    results = {}
    for name, kw in [
        ("crash", {}),
        ("hang", {"timeout_s": 10.0, "term_grace_s": 0.5}),  # room to start (and ignore SIGTERM) on a busy machine
        ("daemon", {}),
        ("stdout_reward", {"failure_reward": None}),
    ]:
        gw = _gateway(engine, tok, command=f"{base} {name}", batch_wait_s=0.2, **kw)
        results[name] = _run(gw, tok, prompts)
    crash = results["crash"].metrics
    assert crash["rollout/agent/exit_nonzero@sum"] == 3 and crash["rollout/agent/reward_source_failure@sum"] == 3
    assert results["crash"].sample_fields["agent_reward"].tolist() == [0.0] * 3
    hang = results["hang"].metrics
    assert hang["rollout/agent/killed@sum"] == 3  # it ignored SIGTERM
    assert int(results["hang"]["response_mask"].sum()) > 0  # what it sampled before it hung is kept
    assert results["daemon"].metrics["rollout/agent/ok@sum"] == 3
    assert results["stdout_reward"].sample_fields["agent_reward"].tolist() == [0.75] * 3
    pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 6  # 3 hung agents, 3 daemons their agents left behind
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)]


def test_64_concurrent_sessions(engine, tok) -> None:
    import openai

    def agent(base_url: str, api_key: str, task: dict) -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        msgs = list(task["prompt"])
        for _ in range(2):
            reply = client.chat.completions.create(model="x", messages=msgs, max_tokens=3)
            msgs += [
                reply.choices[0].message.model_dump(exclude_none=True, include={"role", "content"}),
                {"role": "user", "content": "1"},
            ]

    gw = GatewayLoop(engine, tok, get_format("hash"), GatewaySettings(callable=agent, batch_wait_s=5.0))
    prompts = [f"{i}+{i}=" for i in range(64)]
    out = _run(gw, tok, prompts, max_new=16)
    m = out.metrics
    assert m["rollout/agent/ok@sum"] == 64 and m["rollout/agent/calls_per_session@sum"] == 128
    # The second call's prompt extends the first's only where the model ended without EOS (the template renders no
    # EOS between turns): those sessions made two samples.
    ends_eos = len(out.source_rows) - 64
    assert 0 <= ends_eos <= 64 and m["rollout/agent/samples_per_session@sum"] == 64 + ends_eos


# Like Qwen3's: earlier assistant turns are rendered without their thinking, and the generation prompt opens a
# <think> block, so a turn after an answer never extends the prompt that answer was sampled from.
THINKING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}A:{{ m['content'].split('</think>')[-1] }}|"
    "{%- else -%}U:{{ m['content'] }}|{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}A:<think>{%- endif -%}"
)


def test_a_template_that_strips_thinking_cuts_sessions_and_each_sample_is_what_was_sampled() -> None:
    import openai

    from conveyor.models.tokenizer import DEFAULT_ALPHABET

    tok = build_char_tokenizer(DEFAULT_ALPHABET + "<>|_")
    tok.chat_template = THINKING_TEMPLATE
    model = build_tiny_model("qwen3_moe", tok, seed=1).eval()
    eng = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    calls: dict[str, list] = {}

    def agent(base_url: str, api_key: str, task: dict) -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        mine = calls.setdefault(task["prompt"][0]["content"], [])
        msgs = list(task["prompt"])

        def record(reply):
            ext = reply.model_extra["conveyor"]
            mine.append((ext["prompt_token_ids"], ext["completion_token_ids"]))

        for turn in range(3):
            reply = client.chat.completions.create(model="x", messages=msgs, max_tokens=4)
            record(reply)
            if turn == 1:  # the same turn continued as raw text: extends the prompt it was sampled from
                text = tok.decode(mine[-1][0] + mine[-1][1]) + "|U:7=|A:<think>"
                record(client.completions.create(model="x", prompt=text, max_tokens=3))
            msgs += [
                {"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": f"{turn}+1="},
            ]

    gw = GatewayLoop(eng, tok, get_format("hash"), GatewaySettings(callable=agent, batch_wait_s=5.0))
    prompts = ["U:1+2=|A:<think>", "U:12+34=|A:<think>"]
    ids, mask = _batch(tok, prompts)
    params = SamplingParams(max_new_tokens=48, capture_routing=True)
    tasks = [
        session_task([{"role": "user", "content": c}], "t", "0", {}, p) for c, p in zip(["1+2=", "12+34="], prompts)
    ]
    try:
        out = gw.run(ids, mask, params, generator=torch.Generator().manual_seed(0), tasks=tasks)
    finally:
        gw.close()
    # Breaks: every chat turn after the first (thinking stripped); the raw continuation extends its turn unless that
    # turn ended with EOS (which the continuation's text does not hold).
    expected = []
    for content in ["1+2=", "12+34="]:
        turn2 = calls[content][1][1]
        expected.append(3 + (turn2[-1:] == [tok.eos_token_id]))
    rows = out.source_rows.tolist()
    assert [rows.count(0), rows.count(1)] == expected
    # Each row, teacher-forced through the model, gives the log-probs it was sampled with; its tokens are its last
    # call's prompt and completion.
    seq = torch.cat([out.prompts, out["responses"]], dim=1)
    span = response_span(out["response_mask"])
    att = torch.cat([out.prompt_mask.long(), span.long()], dim=1)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), RoutingRecorder(model) as rec:
        logits = model(input_ids=seq, attention_mask=att, position_ids=pos).logits
        routing = rec.pop()
    known = out["routed_experts"] >= 0  # every recorded expert is the one a teacher-forced forward routes to
    assert known.any() and torch.equal(out["routed_experts"][known], routing.to(torch.int16)[known])
    p, r = out.prompts.shape[1], out["responses"].shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : p + r - 1].float(), dim=-1)
    logp = logp.gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)
    m = out["response_mask"].bool()
    torch.testing.assert_close(logp[m], out["rollout_log_probs"][m], atol=2e-4, rtol=0)
    for i, src in enumerate(rows):
        tokens = out.prompts[i][out.prompt_mask[i]].tolist() + out["responses"][i][span[i]].tolist()
        sampled = [pr + co for pr, co in calls[["1+2=", "12+34="][src]]]
        assert tokens in sampled  # the sample ends with one of its session's calls, token for token
    assert out.prompts.shape[1] == ids.shape[1] and (out.prompt_mask.sum(-1) <= ids.shape[1]).all()


def test_padding_a_row_gives_its_padding_the_newest_version() -> None:
    from conveyor.workers.ranks.generation import pad_responses

    fields = {
        "responses": torch.tensor([[5, 6, 7]]),
        "response_mask": torch.tensor([[True, False, True]]),
        "rollout_log_probs": torch.zeros(1, 3),
        "token_policy_version": torch.tensor([[3, 4, 4]]),
    }
    out = pad_responses(fields, 5, pad_token_id=0)
    assert out["responses"].tolist() == [[5, 6, 7, 0, 0]]
    assert out["token_policy_version"].tolist() == [[3, 4, 4, 4, 4]]  # padding: the row's newest
