"""A vision-language critic: the value head on the vision tower and text model, run with the policy's pixels and
M-RoPE positions, padded and packed alike."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from test_vlm_packing import visual_batch

from conveyor.algos.trajectory import response_span
from conveyor.models.loading import load_causal_lm, load_tokenizer
from conveyor.models.packing import PackedRows, enable_packing
from conveyor.models.tiny_vlm import TINY_VLM_ARCHS, save_tiny_vlm
from conveyor.models.value_head import ValueModel
from conveyor.models.vision import VisionBatch
from conveyor.workers.ranks.forward import packed_kwargs, padded_kwargs, sequence_inputs
from conveyor.workers.training.strategy import decoder_layers


def _batch(path, model, tok) -> TensorDict:
    """Three visual-task prompts and a text-only one, responses of 5, 3, 5 and 4 tokens."""
    td = visual_batch(path, model, tok)  # tests/models is on sys.path
    # Ordinary tokens only: transformers' own forward (the reference below) would take a sampled image pad for
    # an image.
    td["responses"] = torch.randint(4, 40, (4, 5), generator=torch.Generator().manual_seed(0))
    td["response_mask"] = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 5, [1] * 4 + [0]]).bool()
    return td


@pytest.mark.parametrize("arch", TINY_VLM_ARCHS)
def test_values_are_the_policys_forward_with_pixels_padded_and_packed(tmp_path, arch: str) -> None:
    """The critic's body is the vision tower and text model: with the head set to one row of the LM head its padded
    values are transformers' own logits of that token (its own M-RoPE positions and image features), the packed
    values equal the padded ones, and other pixels give other values."""
    path = save_tiny_vlm(arch, tmp_path / arch)
    policy, tok = load_causal_lm(path), load_tokenizer(path, padding_side="left")
    critic = ValueModel.from_causal_lm(policy, copy=False).eval()  # as the critic worker builds it
    assert critic.config is policy.config and critic.value_head.in_features == policy.config.text_config.hidden_size
    assert any(k.startswith("backbone.visual.") for k in critic.state_dict())
    # FSDP2's units: the vision tower's blocks, then the text model's layers.
    vision, text = critic.backbone.visual.blocks, critic.backbone.language_model.layers
    assert decoder_layers(critic) == [*vision, *text]
    token = 7
    with torch.no_grad():
        critic.value_head.weight.copy_(policy.lm_head.weight[token : token + 1])
        critic.value_head.bias.zero_()
    td = _batch(path, policy, tok)
    ids, mask, pos = sequence_inputs(td)
    with torch.no_grad():
        # No positions given: transformers computes the M-RoPE positions itself from the image tokens' types.
        pixels = VisionBatch.from_fields(td).model_kwargs()
        types = (ids == policy.config.image_token_id).int()
        own = policy(input_ids=ids, attention_mask=mask, mm_token_type_ids=types, **pixels, use_cache=False)
        own = own.logits[..., token]
        kwargs = padded_kwargs(td, ids, mask, pos, critic.config)
        padded = critic(**kwargs)
        blind = critic(**{**kwargs, "pixel_values": torch.zeros_like(kwargs["pixel_values"])})
        enable_packing(policy)  # the body shares the policy's config: its attention now takes packed bounds
        packed = PackedRows.from_masks(mask, response_span(td["response_mask"]))
        got = critic(**packed_kwargs(packed, td, ids, mask, pos, critic.config))[0]
    real = mask.bool()
    assert (padded - own)[real].abs().max() < 1e-5
    flat = padded.reshape(-1)[packed.flat]  # the padded values at the packed tokens, in packed order
    assert (got - flat).abs().max() < 1e-5
    assert (blind - padded)[real].abs().max() > 1e-4, "the values do not depend on the pixels"
