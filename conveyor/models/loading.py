"""Loading and saving local Hugging Face checkpoints (a causal LM and its tokenizer).

Real runs point `actor_rollout_ref.model.path` at a directory written by
`save_pretrained` (config.json, weights, tokenizer files). Mistakes in that
path are reported here, naming the path and the config key, before
transformers gets to raise something less direct. A tokenizer without a pad
token gets its EOS token as pad (with a warning), since batched rollout and
training need one.

It deliberately does not download from a model hub, shard, or wrap models for
data parallelism; the workers do the wrapping.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["load_causal_lm", "load_tokenizer", "save_pretrained_checkpoint", "resolve_dtype"]

logger = logging.getLogger(__name__)

_PATH_KEY = "actor_rollout_ref.model.path"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`torch.dtype` for a name such as "float32" / "bf16", or the dtype itself."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown `dtype` {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def _check_checkpoint_dir(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(
            f"model path {str(path)!r} does not exist; set `{_PATH_KEY}` to a local directory "
            "written by save_pretrained (models are not downloaded)"
        )
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ValueError(
            f"model path {str(path)!r} is not a Hugging Face checkpoint directory (no config.json); "
            f"set `{_PATH_KEY}` to a directory written by save_pretrained"
        )
    return p


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A causal LM from the local checkpoint directory `path`, in `dtype` on `device`."""
    p = _check_checkpoint_dir(path)
    kwargs: dict = {"dtype": resolve_dtype(dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
    return model.to(device)


def load_tokenizer(path: str | Path, *, padding_side: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `path`, with a pad token guaranteed (EOS stands in when it has none)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(
            f"tokenizer path {str(path)!r} does not exist; set `{_PATH_KEY}` to a local directory "
            "written by save_pretrained (tokenizers are not downloaded)"
        )
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"`padding_side` must be 'left', 'right' or None, got {padding_side!r}")
    tokenizer = AutoTokenizer.from_pretrained(str(p))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"the tokenizer in {str(path)!r} has neither a pad token nor an EOS token; "
                "add a pad token (tokenizer.add_special_tokens({'pad_token': ...})) and save it again"
            )
        logger.warning(
            "tokenizer in %s has no pad token; using its EOS token %r as pad", str(path), tokenizer.eos_token
        )
        tokenizer.pad_token = tokenizer.eos_token
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    return tokenizer


def save_pretrained_checkpoint(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, path: str | Path
) -> Path:
    """Write `model` (and `tokenizer`, when given) to the directory `path` with save_pretrained; returns it."""
    p = Path(path).expanduser()
    p.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(p))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(p))
    return p
