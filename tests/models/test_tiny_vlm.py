"""Tiny VLMs: built from config, saved with their processor, loaded as a policy checkpoint; M-RoPE positions."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from conveyor.models.loading import load_causal_lm, load_tokenizer
from conveyor.models.tiny_vlm import TINY_VLM_ARCHS, load_image_processor, save_tiny_vlm
from conveyor.models.vision import VisionProcessor, check_image_tokens, mrope_positions


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One saved tiny checkpoint per family."""
    root = tmp_path_factory.mktemp("vlm")
    return {arch: str(save_tiny_vlm(arch, root / arch)) for arch in TINY_VLM_ARCHS}


@pytest.mark.parametrize("arch", TINY_VLM_ARCHS)
def test_checkpoint_loads_and_positions_match_transformers(checkpoints: dict[str, str], arch: str) -> None:
    """The saved directory loads as a policy checkpoint; our M-RoPE positions are the model's own, logits agree."""
    path = checkpoints[arch]
    model = load_causal_lm(path)
    tok = load_tokenizer(path)
    vp = VisionProcessor(load_image_processor(path), tok, model.config)
    pixels, grids = vp.process([Image.new("RGB", (30, 20), (255, 0, 0)), Image.new("RGB", (20, 20), (0, 0, 255))])
    ids = tok(vp.expand("a <image> b <image>=", grids, "row 0"), add_special_tokens=False)["input_ids"]
    pos, delta = mrope_positions(ids, grids, vp.image_token_id, vp.merge)
    t = torch.tensor([ids])
    types = (t == vp.image_token_id).int()
    ref, ref_delta = model.model.get_rope_index(t, types, image_grid_thw=torch.tensor(grids))
    assert torch.equal(ref[:, 0], pos) and int(ref_delta) == delta
    grid = torch.tensor(grids)
    with torch.no_grad():
        ours = model(input_ids=t, pixel_values=pixels, image_grid_thw=grid, position_ids=pos.unsqueeze(1)).logits
        theirs = model(input_ids=t, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types).logits
    assert torch.equal(ours, theirs)


def test_pads_without_pixels_are_refused() -> None:
    """Image-pad tokens with no pixels, or pixels with no pads, stop naming the sample."""
    with pytest.raises(ValueError, match=r"sample 'b/p0/s1': 4 image-pad tokens and no pixels"):
        check_image_tokens("b/p0/s1", [5, 9, 9, 9, 9, 6], [], 9, 2)
    with pytest.raises(ValueError, match=r"sample 'b/p0/s0': pixels of 1 image\(s\) \(4 patches\) and no image-pad"):
        check_image_tokens("b/p0/s0", [5, 6], [[1, 4, 4]], 9, 2)
    check_image_tokens("ok", [5, 9, 9, 9, 9, 6], [[1, 4, 4]], 9, 2)
