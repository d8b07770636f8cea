"""The agent gateway with a vision-language policy: agents on the real `openai` client, in processes of their own,
send the task's images as `image_url` parts (data URLs) and get the built-in tool loop's tokens bit for bit; the rows
carry the images the trainer's forward needs, and what the gateway cannot place is refused."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch
from gateway_cases import AGENT
from tensordict import TensorDict

from conveyor.algos.trajectory import response_span
from conveyor.models.loading import load_causal_lm, load_tokenizer
from conveyor.models.tiny_vlm import load_image_processor, save_tiny_vlm
from conveyor.models.vision import VisionBatch, VisionProcessor
from conveyor.rollout.agent_loop import AgentLoop, AgentLoopSettings
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.gateway import GatewayLoop, GatewaySettings
from conveyor.rollout.gateway.trajectory import session_task
from conveyor.rollout.hf import HFEngine
from conveyor.tasks.prompts import PromptEncoder
from conveyor.tasks.visual import make_visual_sum_records
from conveyor.tools import get_format, load_tools
from conveyor.user_code import import_user_code
from conveyor.workers.ranks.forward import padded_kwargs, sequence_inputs

import_user_code("tests/agent/digit_format.py", key="test")  # registers test_digit_calls, as the agents' --plugin does


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny Qwen2.5-VL, its tokenizer, the hf engine over it and its VisionProcessor."""
    path = save_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("vlm") / "qwen2_5_vl")
    model, tok = load_causal_lm(path), load_tokenizer(path, padding_side="left")
    vision = VisionProcessor(load_image_processor(path), tok, model.config)
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return model, tok, engine, vision


def _batch(tok, vision, n: int = 4, seed: int = 0):
    """`n` visual-sum prompts (the last one text only) as stage 1 makes them for an agent run: their fields (the
    messages in OpenAI's shape, images as data URLs, the prompts padded to data.max_prompt_length = 24), their
    VisionBatch and each one's task."""
    records = make_visual_sum_records(n - 1, seed=seed, split="train")
    records.append({**records[0], "images": [], "prompt": [{"role": "user", "content": "1+2="}]})
    encoder = PromptEncoder(tok, 24, "error", vision=vision, agent_images=True)
    fields, _ = encoder.fields(records, [f"p{i}" for i in range(n)], range(n))
    assert fields["prompts"].shape[1] == 24  # room for images in later turns
    td = TensorDict({k: fields[k] for k in ("prompts", "prompt_mask", "mrope_positions", "rope_delta")}, batch_size=[n])
    td["pixel_values"], td["image_grid_thw"] = fields["pixel_values"], fields["image_grid_thw"]
    tasks = [
        session_task(fields["prompt_messages"][i], "visual_sum", fields["ground_truth"][i], {}, fields["raw_prompt"][i])
        for i in range(n)
    ]
    return td, VisionBatch.from_fields(td), tasks, fields


def test_the_task_carries_its_images_as_openai_image_parts(vlm) -> None:
    _, tok, _, vision = vlm
    _, _, tasks, fields = _batch(tok, vision)
    parts = tasks[0]["agent_task"]["prompt"][0]["content"]
    assert [p["type"] for p in parts][:1] == ["image_url"] and parts[1]["type"] == "text"
    url = parts[0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    png = base64.b64decode(url.split(",", 1)[1])
    from PIL import Image

    record = make_visual_sum_records(3, seed=0, split="train")[0]
    assert png == record["images"][0]["bytes"]  # the dataset's own bytes, not re-encoded
    assert Image.open(io.BytesIO(png)).format == "PNG"
    assert tasks[3]["agent_task"]["prompt"] == [{"role": "user", "content": "1+2="}]  # text rows stay as they are


def test_agents_sending_image_parts_reproduce_the_builtin_tool_loop_bitwise(vlm) -> None:
    """The example arithmetic agent, unchanged, in a process of its own: it sends the task's messages (an
    image_url part and text) and its tool turns; every session is one row, equal to the built-in loop's over the
    same images (tokens, mask, log-probs), and its vision fields are the stage-1 ones; the trainer's padded forward
    scores the model's tokens as the engine did (1e-4)."""
    model, tok, engine, vision = vlm
    td, batch_vision, tasks, _ = _batch(tok, vision)
    ids, mask = td["prompts"], td["prompt_mask"]
    params = SamplingParams(max_new_tokens=24)
    tools = load_tools("examples/tools/calculator.yaml")
    settings = AgentLoopSettings(max_assistant_turns=3, max_user_turns=2, max_tool_response_length=16)
    fmt = get_format("test_digit_calls")
    ref = AgentLoop(engine, tok, tools, fmt, settings).run(
        ids, mask, params, generator=torch.Generator().manual_seed(5), vision=batch_vision
    )
    gw = GatewayLoop(engine, tok, fmt, GatewaySettings(command=AGENT, batch_wait_s=120.0), vision)
    try:
        out = gw.run(ids, mask, params, generator=torch.Generator().manual_seed(5), tasks=tasks, vision=batch_vision)
    finally:
        gw.close()
    assert out.source_rows.tolist() == [0, 1, 2, 3]
    assert out.metrics["rollout/agent/ok@sum"] == 4 and ref.metrics["rollout/multi_turn/tool_calls@sum"] > 0
    span = response_span(ref["response_mask"])
    width = span.shape[1]
    assert span.sum(-1).tolist() == response_span(out["response_mask"]).sum(-1).tolist()
    for name in ("responses", "response_mask", "rollout_log_probs"):
        a = ref[name][:, :width]
        b = torch.nn.functional.pad(out[name], (0, max(0, width - out[name].shape[1])))[:, :width]
        zero = torch.zeros_like(a)
        assert torch.equal(torch.where(span, a, zero), torch.where(span, b, zero)), name
    got = out.sample_fields
    assert torch.equal(got["mrope_positions"], td["mrope_positions"])
    assert torch.equal(got["rope_delta"], td["rope_delta"])
    for i in range(4):
        assert torch.equal(got["image_grid_thw"][i], td["image_grid_thw"][i])
        if td["image_grid_thw"][i].numel():
            assert torch.equal(got["pixel_values"][i], td["pixel_values"][i])
        else:
            assert got["pixel_values"][i] is None
    _check_the_trainers_forward(model, out)


def _check_the_trainers_forward(model, out) -> None:
    """The trainer's padded forward over the gateway's rows as written (their vision fields included) gives the
    engine's log-probs of the model's tokens (1e-4)."""
    got = out.sample_fields
    fields = {
        "prompts": out.prompts,
        "prompt_mask": out.prompt_mask,
        "responses": out.responses,
        "response_mask": out.response_mask,
        "mrope_positions": got["mrope_positions"],
        "rope_delta": got["rope_delta"],
    }
    rows = TensorDict(fields, batch_size=[len(out.prompts)])
    rows["pixel_values"], rows["image_grid_thw"] = got["pixel_values"], got["image_grid_thw"]
    with torch.no_grad():
        kwargs = padded_kwargs(rows, *sequence_inputs(rows), model.config)
        logits = model(**kwargs, use_cache=False).logits[:, out.prompts.shape[1] - 1 : -1]
    trainer = torch.log_softmax(logits.float(), -1).gather(-1, out.responses.unsqueeze(-1)).squeeze(-1)
    assert out.response_mask.any()
    assert (trainer - out.rollout_log_probs).abs()[out.response_mask].max() < 1e-4


def _png_url(side: int = 56, shade: int = 0) -> str:
    from PIL import Image

    data = io.BytesIO()
    Image.new("RGB", (side, side), (shade, shade, shade)).save(data, format="PNG")
    return "data:image/png;base64," + base64.b64encode(data.getvalue()).decode()


def test_a_later_image_starts_a_sample_of_its_own_and_bad_images_are_refused(vlm) -> None:
    """An image added after a session's first prompt cannot sit in a response: that call starts a new sample whose
    prompt holds both images (the rows' fields say so). An http URL, a broken data URL and a typed `<image>` are
    400s naming the field; one that would overrun the prompt columns is context_length_exceeded."""
    model, tok, engine, vision = vlm
    td, batch_vision, tasks, _ = _batch(tok, vision, n=2)
    seen: dict = {}

    def agent(base_url: str, api_key: str, task: dict) -> None:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = list(task["prompt"])
        if not isinstance(messages[0]["content"], list):
            return
        first = client.chat.completions.create(model="p", messages=messages, max_tokens=2)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url(shade=200)}}]},
        ]
        client.chat.completions.create(model="p", messages=messages, max_tokens=2)
        errors = {}
        for name, content in [
            ("http", [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]),
            ("broken", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]),
            ("typed", "look: <image>"),
            ("long", [{"type": "text", "text": "9" * 24}, {"type": "image_url", "image_url": {"url": _png_url()}}]),
        ]:
            try:
                client.chat.completions.create(model="p", messages=[{"role": "user", "content": content}], max_tokens=2)
            except openai.BadRequestError as err:
                errors[name] = (err.body or {}).get("message", ""), (err.body or {}).get("code") or err.code
        seen.update(errors)

    gw = GatewayLoop(engine, tok, get_format("hash"), GatewaySettings(callable=agent, batch_wait_s=5.0), vision)
    try:
        out = gw.run(
            td["prompts"],
            td["prompt_mask"],
            SamplingParams(max_new_tokens=30),
            generator=torch.Generator().manual_seed(0),
            tasks=tasks,
            vision=batch_vision,
        )
    finally:
        gw.close()
    assert out.source_rows.tolist() == [0, 0, 1]  # session 0 cut in two; session 1 (text only) never called
    grids = out.sample_fields["image_grid_thw"]
    assert [g.shape[0] for g in grids] == [1, 2, 0]
    assert out.sample_fields["pixel_values"][1].shape[0] == 2 * out.sample_fields["pixel_values"][0].shape[0]
    _check_the_trainers_forward(model, out)  # the cut sample's row too, with its two images
    assert "data: URL" in seen["http"][0] and "does not decode" in seen["broken"][0]
    assert "placeholder" in seen["typed"][0]
    assert "data.max_prompt_length" in seen["long"][0]
