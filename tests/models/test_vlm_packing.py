"""Packed = padded for vision-language forwards: each sample's M-RoPE positions and pixels kept in the packed row."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from conveyor.algos.trajectory import response_span
from conveyor.models.loading import load_causal_lm, load_tokenizer
from conveyor.models.packing import PackedRows, enable_packing, packing_unsupported_reason
from conveyor.models.tiny_vlm import TINY_VLM_ARCHS, load_image_processor, save_tiny_vlm
from conveyor.models.vision import VisionProcessor
from conveyor.tasks.prompts import PromptEncoder
from conveyor.tasks.visual import make_visual_sum_records
from conveyor.workers.ranks.forward import packed_kwargs, padded_kwargs, sequence_inputs


def visual_batch(path, model, tok) -> TensorDict:
    """Stage 1's fields of three visual-task prompts and a text-only one (no responses yet)."""
    enc = PromptEncoder(tok, 64, "error", vision=VisionProcessor(load_image_processor(path), tok, model.config))
    records = make_visual_sum_records(3, seed=0)
    records.append({**records[0], "images": [], "prompt": [{"role": "user", "content": "1+22="}]})
    fields, _ = enc.fields(records, [f"p{i}" for i in range(4)], [0, 1, 2, 3])
    td = TensorDict({k: fields[k] for k in ("prompts", "prompt_mask", "mrope_positions", "rope_delta")}, [4])
    td["pixel_values"], td["image_grid_thw"] = fields["pixel_values"], fields["image_grid_thw"]
    return td


@pytest.mark.parametrize("arch", TINY_VLM_ARCHS)
def test_packed_logits_equal_padded_ones(tmp_path, arch: str) -> None:
    """Rows of different lengths (one without an image, one response sampling an image-pad token): the packed
    forward's logits at the predicting positions are the padded forward's; without M-RoPE rows they are not."""
    path = save_tiny_vlm(arch, tmp_path / arch)
    model, tok = load_causal_lm(path), load_tokenizer(path, padding_side="left")
    assert packing_unsupported_reason(model) is None
    td = visual_batch(path, model, tok)
    td["responses"] = torch.randint(4, len(tok), (4, 5), generator=torch.Generator().manual_seed(0))
    td["responses"][0, 2] = model.config.image_token_id
    td["response_mask"] = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 5, [1] * 4 + [0]]).bool()
    ids, mask, pos = sequence_inputs(td)
    packed = PackedRows.from_masks(mask, response_span(td["response_mask"]))
    prompt_len = td["prompts"].shape[1]
    with torch.no_grad():
        padded = model(**padded_kwargs(td, ids, mask, pos, model.config), use_cache=False).logits
        enable_packing(model)
        kwargs = packed_kwargs(packed, td, ids, mask, pos, model.config)
        got = model(**kwargs, use_cache=False).logits[0, packed.predict]
        # The plain text positions in all three M-RoPE rows: the image tokens sit elsewhere, the logits move.
        text_only = kwargs["position_ids"][:1].expand(4, -1, -1)
        blind = model(**{**kwargs, "position_ids": text_only}, use_cache=False).logits[0, packed.predict]
    want = padded[:, prompt_len - 1 : -1][packed.rows, packed.cols]
    assert (got - want).abs().max() < 1e-5
    assert (blind - want).abs().max() > 1e-3
