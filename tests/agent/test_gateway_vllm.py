"""The agent gateway on vLLM's CPU build: agents in other processes on the real `openai` client reproduce the
built-in tool loop's tokens and log-probs within vLLM's own determinism (the built-in loop run twice).

vLLM seeds each row's request from the rollout's generator, so the round rule's batches (the built-in loop's, in
session order) draw the same seeds; what can still differ is vLLM's numerics across batches. The bar is measured, not
assumed: the built-in loop against itself. vLLM returns no routed experts on the CPU (its V2 runner is CUDA-only), so
routing is compared on the hf engine only (test_gateway.py). The engine starts in ~10-30 s on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from gateway_cases import AGENT, PROMPTS

from conveyor.algos.trajectory import response_span
from conveyor.config.rollout import RolloutConfig
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.agent_loop import AgentLoop, AgentLoopSettings
from conveyor.rollout.base import EngineContext, SamplingParams, engine_spec
from conveyor.rollout.gateway import GatewayLoop, GatewaySettings
from conveyor.rollout.gateway.trajectory import session_task
from conveyor.tools import get_format, load_tools
from conveyor.user_code import import_user_code

pytest.importorskip("vllm")
import_user_code("tests/agent/digit_format.py", key="test")  # registers test_digit_calls, as the agents' --plugin does


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def engine(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("gateway-vllm-model")
    model = build_tiny_model("qwen3_moe", tok, seed=0, num_heads=2, num_kv_heads=2).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    context = EngineContext(
        model_path=str(path),
        model=model,
        tokenizer=tok,
        rollout=RolloutConfig(max_num_seqs=8),
        model_dtype="float32",
        trust_remote_code=False,
        max_model_len=128,
        seed=0,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
    )
    eng = engine_spec("vllm").build(context)
    eng.update_weights(model.state_dict().items(), version=0)
    yield eng
    eng.close()


def _rows(out, width: int) -> list:
    """[model-token mask, responses, log-probs] over the first `width` response columns, zero past each row's span."""
    span = response_span(out["response_mask"])
    pad = max(0, width - span.shape[1])
    span = torch.nn.functional.pad(span, (0, pad))[:, :width]
    got = []
    for name in ("response_mask", "responses", "rollout_log_probs"):
        x = torch.nn.functional.pad(out[name], (0, pad))[:, :width]
        got.append(torch.where(span, x, torch.zeros_like(x)))
    return got


def test_gateway_reproduces_the_builtin_tool_loop_within_vllms_own_determinism(engine, tok) -> None:
    prompts = PROMPTS * 2
    enc = tok(prompts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    params = SamplingParams(max_new_tokens=24)
    settings = AgentLoopSettings(max_assistant_turns=3, max_user_turns=2, max_tool_response_length=16)
    builtin = AgentLoop(
        engine, tok, load_tools("examples/tools/calculator.yaml"), get_format("test_digit_calls"), settings
    )
    refs = [builtin.run(ids, mask, params, generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    gw = GatewayLoop(engine, tok, get_format("test_digit_calls"), GatewaySettings(command=AGENT, batch_wait_s=120.0))
    tasks = [session_task([{"role": "user", "content": p}], "t", "0", {}, p) for p in prompts]
    try:
        out = gw.run(ids, mask, params, generator=torch.Generator().manual_seed(5), tasks=tasks)
    finally:
        gw.close()
    assert out.source_rows.tolist() == list(range(len(prompts)))  # every session extended itself: one row each
    assert refs[0].metrics["rollout/multi_turn/tool_calls@sum"] > 0 and out.metrics["rollout/agent/ok@sum"] == 8
    width = max(r["responses"].shape[1] for r in [*refs, out])
    first, second, mine = (_rows(r, width) for r in (refs[0], refs[1], out))
    # vLLM against itself: the bar. The same seeds must give the same tokens, or there is nothing to compare against.
    assert all(torch.equal(x, y) for x, y in zip(first[:2], second[:2])), "vLLM sampled other tokens for one seed"
    bar = float((first[2] - second[2]).abs().max())
    # The gateway against the built-in loop: the same tokens where the model sampled, log-probs within the bar.
    assert all(torch.equal(x, y) for x, y in zip(mine[:2], first[:2]))
    assert float((mine[2] - first[2]).abs().max()) <= bar
