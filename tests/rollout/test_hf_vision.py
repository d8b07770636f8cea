"""The hf engine with images: M-RoPE positions in prefill and decode, log-probs equal to the padded forward, alone
and in the multi-turn tool loop."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from conveyor.algos.trajectory import response_span
from conveyor.models.loading import load_causal_lm, load_tokenizer
from conveyor.models.tiny_vlm import load_image_processor, save_tiny_vlm
from conveyor.models.vision import VisionBatch, VisionProcessor
from conveyor.rollout.agent_loop import AgentLoop, AgentLoopSettings
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFEngine
from conveyor.tasks.prompts import PromptEncoder, sample_keys
from conveyor.tasks.visual import make_visual_sum_records
from conveyor.tools.base import make_tool
from conveyor.tools.formats import CallFormat, ToolCall
from conveyor.workers.ranks.forward import padded_kwargs, sequence_inputs


def _check_against_the_padded_forward(model, td: TensorDict, out) -> tuple[dict, torch.Tensor]:
    """Assert that the engine's log-probs of its model tokens are the trainer's padded forward's (1e-4); returns
    that forward's keywords and response logits."""
    td["responses"], td["response_mask"] = out.responses, out.response_mask
    with torch.no_grad():
        kwargs = padded_kwargs(td, *sequence_inputs(td), model.config)
        logits = model(**kwargs, use_cache=False).logits[:, td["prompts"].shape[1] - 1 : -1]
    trainer = torch.log_softmax(logits.float(), -1).gather(-1, out.responses.unsqueeze(-1)).squeeze(-1)
    diff = (trainer - out.rollout_log_probs).abs()[out.response_mask]
    assert diff.max() < 1e-4, diff.max()
    return kwargs, logits


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_rollout_log_probs_match_the_padded_forward(tmp_path, arch: str) -> None:
    """Sampled with images, the engine's log-probs are the trainer's padded forward's (the text path's 1e-4)."""
    path = save_tiny_vlm(arch, tmp_path / arch)
    model, tok = load_causal_lm(path), load_tokenizer(path, padding_side="left")
    encoder = PromptEncoder(tok, 64, "error", vision=VisionProcessor(load_image_processor(path), tok, model.config))
    records = make_visual_sum_records(3, seed=0, split="train")
    # A text-only record in the batch: its row has no pixels, its positions are plain.
    records.append({**records[0], "images": [], "prompt": [{"role": "user", "content": "1+2="}]})
    uids = [f"b/p{i}" for i in range(len(records))]
    fields, _ = encoder.fields(records, uids, [0, 0, 1, 2, 3])
    assert [g.shape[0] for g in fields["image_grid_thw"]] == [1, 1, 1, 1, 0]
    td = TensorDict({k: fields[k] for k in ("prompts", "prompt_mask", "mrope_positions", "rope_delta")}, batch_size=[5])
    td["pixel_values"], td["image_grid_thw"] = fields["pixel_values"], fields["image_grid_thw"]
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, do_sample=True)
    gen = torch.Generator().manual_seed(0)
    vision = VisionBatch.from_fields(td)
    out = engine.generate(td["prompts"], td["prompt_mask"], params, generator=gen, vision=vision)
    kwargs, logits = _check_against_the_padded_forward(model, td, out)
    # Without the images the same tokens score differently: the pixels reached both forwards.
    blind = {k: v for k, v in kwargs.items() if k not in ("pixel_values", "image_grid_thw")}
    with torch.no_grad():
        blind_logits = model(**blind, use_cache=False).logits[:, td["prompts"].shape[1] - 1 : -1]
    assert not torch.allclose(blind_logits[:4], logits[:4], atol=1e-3)
    assert sample_keys(["b/p0"], 2) == ["b/p0/s0", "b/p0/s1"]


def test_image_pads_without_pixels_stop_in_stage_1_the_engine_and_the_forward(tmp_path) -> None:
    """Pads typed into a prompt with no image, or prompts whose pixels were not read: one error, never a forward
    that embeds the pads as text."""
    path = save_tiny_vlm("qwen2_5_vl", tmp_path / "vlm")
    model, tok = load_causal_lm(path), load_tokenizer(path, padding_side="left")
    encoder = PromptEncoder(tok, 64, "error", vision=VisionProcessor(load_image_processor(path), tok, model.config))
    typed = {**make_visual_sum_records(1, seed=0)[0], "images": []}
    typed["prompt"] = [{"role": "user", "content": "<|image_pad|>="}]
    with pytest.raises(ValueError, match=r"sample 'b/p7': 1 image-pad tokens and no pixels"):
        encoder.fields([typed], ["b/p7"], [0])
    record = make_visual_sum_records(1, seed=0)[0]
    with pytest.raises(ValueError, match=r"has 0 '<image>' placeholder\(s\) but the row has 1 image"):
        encoder.fields([{**record, "prompt": [{"role": "user", "content": "="}]}], ["b/p0"], [0])
    fields, _ = encoder.fields([record], ["b/p0"], [0])
    td = TensorDict({k: fields[k] for k in ("prompts", "prompt_mask")}, batch_size=[1])  # the pixels left unread
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with pytest.raises(ValueError, match=r"HFEngine.generate: rows \[0\] of the batch hold image-pad tokens but no"):
        engine.generate(td["prompts"], td["prompt_mask"], SamplingParams(max_new_tokens=2))
    td["responses"], td["response_mask"] = torch.ones(1, 2, dtype=torch.long) + 4, torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"the padded forward: rows \[0\] .* read the fields \['pixel_values'"):
        padded_kwargs(td, *sequence_inputs(td), model.config)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_a_generation_over_images_resumed_from_its_prefix_equals_the_uninterrupted_one(tmp_path, arch: str) -> None:
    """Partial rollouts with images: the re-prefill after an interrupt feeds the prompt's pixels again and each
    sampled token at the M-RoPE position decoding gave it, so resuming changes neither tokens nor log-probs."""
    path = save_tiny_vlm(arch, tmp_path / arch)
    model, tok = load_causal_lm(path), load_tokenizer(path, padding_side="left")
    encoder = PromptEncoder(tok, 64, "error", vision=VisionProcessor(load_image_processor(path), tok, model.config))
    records = make_visual_sum_records(3, seed=1, split="train")
    records.append({**records[0], "images": [], "prompt": [{"role": "user", "content": "1+2="}]})
    fields, _ = encoder.fields(records, [f"b/p{i}" for i in range(4)], [0, 1, 2, 3])
    td = TensorDict({k: fields[k] for k in ("prompts", "prompt_mask", "mrope_positions", "rope_delta")}, batch_size=[4])
    td["pixel_values"], td["image_grid_thw"] = fields["pixel_values"], fields["image_grid_thw"]
    vision = VisionBatch.from_fields(td)
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    whole = engine.generate(td["prompts"], td["prompt_mask"], params, vision=vision)
    calls: list[int] = []

    def interrupt(sampled: int) -> bool:
        calls.append(sampled)
        return sampled in (1, 3)  # weights "changed": the cache is recomputed from the prefix twice

    resumed = engine.generate(td["prompts"], td["prompt_mask"], params, vision=vision, interrupt=interrupt)
    assert calls and calls[0] == 1
    assert torch.equal(resumed.responses, whole.responses)
    assert torch.equal(resumed.response_mask, whole.response_mask)
    torch.testing.assert_close(resumed.rollout_log_probs, whole.rollout_log_probs, atol=1e-5, rtol=0)
    # Plain text positions in place of M-RoPE's move the log-probs by well over that tolerance: the equality above
    # would catch a resumed prefix fed at the wrong positions.
    plain = (td["prompt_mask"].cumsum(-1) - 1).clamp(min=0)[:, None].expand(-1, 3, -1)
    flat = VisionBatch(vision.pixel_values, vision.image_grid_thw, plain, torch.zeros(4, dtype=torch.long))
    blind = engine.generate(td["prompts"], td["prompt_mask"], params, vision=flat, interrupt=interrupt)
    assert (blind.rollout_log_probs - whole.rollout_log_probs).abs().max() > 1e-4


def _echo(text: str) -> str:
    """A tool whose answer length varies with the call, with an image-pad token in it now and then: the loop and
    the trainer feed it as vision-end (it has no pixels)."""
    return ("ab" if len(text) % 2 else "a<|image_pad|>") * (len(text) % 3 + 1)


# A random policy calls the tool whenever a turn ends at one of these characters: samples make 0, 1 or more calls.
TURNS = CallFormat("turns", stop_texts=tuple("13579"), parser=lambda turn: ToolCall("echo", text=turn))


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_multi_turn_trajectories_over_images_score_as_the_trainers_padded_forward(tmp_path, arch: str) -> None:
    """The tool loop with images: every turn re-prefills the prompt's pixels and the trajectory so far at the
    positions the trainer's forward gives a response, so each model token's log-prob is the padded forward's
    (1e-4) over the whole stitched trajectory, tool turns included."""
    path = save_tiny_vlm(arch, tmp_path / arch)
    model, tok = load_causal_lm(path), load_tokenizer(path, padding_side="left")
    encoder = PromptEncoder(tok, 64, "error", vision=VisionProcessor(load_image_processor(path), tok, model.config))
    records = make_visual_sum_records(4, seed=2, split="train")
    records.append({**records[0], "images": [], "prompt": [{"role": "user", "content": "1+2="}]})
    fields, _ = encoder.fields(records, [f"b/p{i}" for i in range(5)], [0, 1, 2, 3, 4, 4])
    td = TensorDict({k: fields[k] for k in ("prompts", "prompt_mask", "mrope_positions", "rope_delta")}, batch_size=[6])
    td["pixel_values"], td["image_grid_thw"] = fields["pixel_values"], fields["image_grid_thw"]
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    loop = AgentLoop(engine, tok, {"echo": make_tool(_echo)}, TURNS, AgentLoopSettings(max_assistant_turns=4))
    params = SamplingParams(max_new_tokens=24, temperature=1.0, do_sample=True)
    out = loop.run(
        td["prompts"],
        td["prompt_mask"],
        params,
        generator=torch.Generator().manual_seed(0),
        vision=VisionBatch.from_fields(td),
    )
    tool_tokens = response_span(out.response_mask) & ~out.response_mask
    assert tool_tokens.any(dim=-1).sum() >= 3, "too few samples called the tool to test alignment"
    assert out.metrics["rollout/multi_turn/tool_calls@sum"] >= 3
    _check_against_the_padded_forward(model, td, out)


def test_a_tool_that_returns_an_image_stops_the_loop_naming_it(tmp_path) -> None:
    """Tool outputs reach the policy as text only: a tool returning an image (PIL, or content parts) stops the
    run with one error naming the tool, rather than failing every call."""
    from PIL import Image

    from conveyor.tools.base import ToolOutputRefused, run_call

    path = save_tiny_vlm("qwen2_5_vl", tmp_path / "vlm")
    tools = {
        "draw": make_tool(lambda text: Image.new("RGB", (8, 8))),
        "parts": make_tool(lambda text: [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]),
    }
    for name in tools:
        with pytest.raises(ToolOutputRefused, match=rf"tool '{name}': it returned an image .* return text"):
            run_call(tools, ToolCall(name, text="x"), "traj-1", set())
    model, tok = load_causal_lm(path), load_tokenizer(path, padding_side="left")
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    always = CallFormat("always", stop_texts=tuple("0123456789"), parser=lambda turn: ToolCall("draw", text=turn))
    loop = AgentLoop(engine, tok, {"draw": tools["draw"]}, always)
    enc = tok(["1+2=", "3+4="], padding=True, return_tensors="pt")
    with pytest.raises(ToolOutputRefused, match="tool 'draw'"):
        loop.run(enc["input_ids"], enc["attention_mask"], SamplingParams(max_new_tokens=40, do_sample=False))
