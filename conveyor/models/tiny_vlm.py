"""Tiny vision-language models built locally: Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE, with their processor.

`build_tiny_vlm` instantiates transformers' own class of each family from a
tiny config (a two-layer vision tower, a two-layer text model, M-RoPE) with
a seeded random init, over the character tokenizer extended with the
family's vision tokens (`VISION_TOKENS`). `save_tiny_vlm` writes the model,
the tokenizer and the image processor (preprocessor_config.json) into one
directory, which `actor_rollout_ref.model.path` loads as it loads a text
checkpoint (`conveyor build-vlm --arch ... --out DIR`).

The image processor resizes every image to `IMAGE_SIDE[arch]` pixels a side
(min_pixels = max_pixels), so each image is a 4 x 4 grid of patches merged
into 4 image-pad tokens: prompts stay short on a CPU.

It deliberately does not download weights: random weights run the image
paths (processor, M-RoPE, vision tower) end to end, and RL alone teaches them
the counting task. A policy that reads the sum task's digits now and then is a
supervised warm start away (`conveyor.trainer.warmstart.warm_start_tiny_vlm`,
`conveyor build-vlm --warmstart-until`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoImageProcessor,
    AutoModelForImageTextToText,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
)

__all__ = [
    "IMAGE_PAD",
    "IMAGE_SIDE",
    "TINY_VLM_ARCHS",
    "VISION_END",
    "VISION_START",
    "VISION_TOKENS",
    "build_tiny_image_processor",
    "build_tiny_vlm",
    "build_vlm_tokenizer",
    "is_vlm_config",
    "save_tiny_vlm",
    "save_vlm",
]

#: The families `build_tiny_vlm` knows (transformers' model_type of each).
TINY_VLM_ARCHS: tuple[str, ...] = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
#: The Qwen-VL vision tokens (a video pad is there too: the configs need its id, no video is made).
VISION_TOKENS: tuple[str, ...] = (VISION_START, IMAGE_PAD, VISION_END, "<|video_pad|>")

# Qwen2.5-VL's vision patches are 14 pixels, Qwen3-VL's 16; with a 2 x 2 merge, 4 patches a side make 4 tokens.
_PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_vl_moe": 16}
_MERGE = 2
#: The side in pixels every image is resized to, per family: a 4 x 4 patch grid, 4 image-pad tokens.
IMAGE_SIDE: dict[str, int] = {arch: 4 * patch for arch, patch in _PATCH.items()}


def is_vlm_config(config: Any) -> bool:
    """Whether a Hugging Face config (or a config.json dict) is a vision-language model's (it has a vision tower)."""
    if isinstance(config, dict):
        return isinstance(config.get("vision_config"), dict)
    return getattr(config, "vision_config", None) is not None


def build_vlm_tokenizer(model_max_length: int = 512) -> PreTrainedTokenizerBase:
    """The character tokenizer with the vision tokens added as special tokens (each one id, never split)."""
    from conveyor.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    return tokenizer


def build_tiny_image_processor(arch: str) -> Any:
    """The Qwen-VL image processor of `arch`, resizing every image to `IMAGE_SIDE[arch]` pixels a side."""
    from transformers import Qwen2VLImageProcessorPil

    _check_arch(arch)
    pixels = IMAGE_SIDE[arch] ** 2
    # The PIL backend: the default one needs torchvision. Both give the same arrays for these sizes.
    return Qwen2VLImageProcessorPil(
        min_pixels=pixels,
        max_pixels=pixels,
        patch_size=_PATCH[arch],
        merge_size=_MERGE,
        temporal_patch_size=2,
    )


def _check_arch(arch: str) -> None:
    if arch not in TINY_VLM_ARCHS:
        raise ValueError(f"unknown tiny VLM arch {arch!r}; choose one of {list(TINY_VLM_ARCHS)} (--arch)")


def _config(arch: str, ids: dict[str, int], vocab_size: int, max_positions: int, seed_ids: dict[str, Any]) -> Any:
    text = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": False,
        **seed_ids,
    }
    # M-RoPE: the head's 8 rotary frequencies split over (time, height, width).
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": _PATCH[arch],
        "spatial_merge_size": _MERGE,
        "temporal_patch_size": 2,
    }
    tokens = {
        "image_token_id": ids[IMAGE_PAD],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids[VISION_START],
        "vision_end_token_id": ids[VISION_END],
    }
    if arch == "qwen2_5_vl":
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
        text["rope_parameters"] = rope
        vision.update(window_size=4 * _PATCH[arch], fullatt_block_indexes=[1])
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
    # Qwen3-VL interleaves the sections over the frequencies and feeds early vision layers to the text (deepstack).
    text["rope_parameters"] = {**rope, "mrope_interleaved": True}
    vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
    if arch == "qwen3_vl":
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)


def build_tiny_vlm(
    arch: str, tokenizer: PreTrainedTokenizerBase, *, seed: int = 0, max_positions: int = 512
) -> PreTrainedModel:
    """A randomly initialised tiny VLM of `arch` (seeded, the global RNG untouched) for `build_vlm_tokenizer`'s ids."""
    _check_arch(arch)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in VISION_TOKENS}
    missing = [tok for tok, i in ids.items() if i is None or i == tokenizer.unk_token_id]
    if missing:
        raise ValueError(f"the tokenizer lacks the vision tokens {missing}; build it with build_vlm_tokenizer")
    special = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    config = _config(arch, ids, len(tokenizer), max_positions, special)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    gen = getattr(model, "generation_config", None)
    if gen is not None:  # not the real family's defaults
        gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = (special[k] for k in special)
    return model.eval()


def save_tiny_vlm(arch: str, out: str | Path, *, seed: int = 0, max_positions: int = 512) -> Path:
    """Build a tiny VLM of `arch` and write it, its tokenizer and its image processor into `out`; returns `out`."""
    tokenizer = build_vlm_tokenizer(model_max_length=max_positions)
    model = build_tiny_vlm(arch, tokenizer, seed=seed, max_positions=max_positions)
    return save_vlm(model, tokenizer, build_tiny_image_processor(arch), out)


def save_vlm(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, image_processor: Any, out: str | Path) -> Path:
    """Write a VLM, its tokenizer and its image processor into `out` (one checkpoint directory); returns `out`."""
    path = Path(out).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    image_processor.save_pretrained(str(path))
    return path


def load_image_processor(path: str | Path) -> Any:
    """The image processor saved in the checkpoint directory `path` (its preprocessor_config.json)."""
    p = Path(path)
    if not (p / "preprocessor_config.json").is_file():
        raise ValueError(
            f"the vision-language checkpoint in {str(p)!r} has no preprocessor_config.json (its image processor); "
            "save the processor beside the model (processor.save_pretrained), or rebuild it with conveyor build-vlm"
        )
    return AutoImageProcessor.from_pretrained(str(p))
