"""The agent gateway on a real tiny MoE model: agents in other processes on the real `openai` client reproduce the
built-in tool loop token for token; sessions cut where a prompt stops extending; every refusal and failure."""

from __future__ import annotations

import sys

import pytest
import torch

from conveyor.algos.trajectory import response_span
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.agent_loop import AgentLoop, AgentLoopSettings
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.gateway import GatewayLoop, GatewaySettings
from conveyor.rollout.hf import HFEngine
from conveyor.tools import get_format, load_tools
from conveyor.user_code import import_user_code

import_user_code("tests/agent/digit_format.py", key="test")  # registers test_digit_calls, as the agents' --plugin does

PROMPTS = ["1+2=", "12+345=", "7*8=", "100-1="]
AGENT = (
    f"{sys.executable} examples/agents/arithmetic_agent.py --format test_digit_calls "
    "--plugin tests/agent/digit_format.py"
)


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
    return [
        {
            "agent_task": {
                "prompt": [{"role": "user", "content": p}],
                "data_source": "t",
                "ground_truth": "0",
                "extra_info": {},
            },
            "raw_prompt": p,
        }
        for p in prompts
    ]


def _batch(tok, prompts):
    enc = tok(prompts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _gateway(engine, tok, **kw):
    settings = GatewaySettings(**{"command": AGENT, "batch_wait_s": 120.0, **kw})
    return GatewayLoop(engine, tok, get_format("test_digit_calls"), settings)


def test_gateway_reproduces_the_builtin_tool_loop_bitwise(engine, tok) -> None:
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
