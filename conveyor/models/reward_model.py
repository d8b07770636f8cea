"""Reward models: loading a scorer checkpoint and the one number it gives a whole sequence.

Two kinds of checkpoint score a sequence:

- a Hugging Face sequence classifier (`*ForSequenceClassification`, one label): its head on the last token that
  is not padding (Skywork-Reward, the Qwen and Llama reward models);
- a causal LM with a value head: the checkpoint's causal LM plus `value_head.safetensors` (`weight` (1, H),
  `bias` (1,)) in the same directory, scored by `ValueModel` (the critic's class) on the last token.

`load_reward_model` loads either on a device, or as rank 0's host copy / a meta skeleton when fsdp2 ranks get
their shards from rank 0 (`conveyor.workers.training.loading`). `sequence_scores` runs one forward of
left-padded rows: the last column is every row's last real token, so no row's score depends on how the batch
was padded. `save_value_head_model` writes the value-head format; `build_tiny_reward_model` makes a tiny sequence
classifier from config (`conveyor.models.tiny`), for tests, benchmarks and CPU runs.

What it deliberately does not do: tokenize, batch or place anything (the reward-model worker does).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from conveyor.models.loading import (
    build_causal_lm_on_meta,
    check_checkpoint_dir,
    load_causal_lm,
    load_model_config,
    read_config_json,
    resolve_dtype,
)
from conveyor.models.tiny import tiny_config
from conveyor.models.value_head import ValueModel

__all__ = [
    "VALUE_HEAD_FILE",
    "reward_model_head",
    "load_reward_model",
    "sequence_scores",
    "save_value_head_model",
    "import_external_lib",
    "build_tiny_reward_model",
    "load_keyed",
]

#: The value head's weights beside a causal LM checkpoint.
VALUE_HEAD_FILE = "value_head.safetensors"
_PATH_KEY = "reward_model.model.path"


def import_external_lib(name: str | None) -> None:
    """Import `reward_model.model.external_lib` (a module that registers a model class); an error names the key."""
    if not name:
        return
    try:
        importlib.import_module(name)
    except ImportError as err:
        raise ValueError(
            f"reward_model.model.external_lib: cannot import {name!r} ({err}); install it or set the key to null"
        ) from err


def load_keyed(key: str, path: Any, load: Any, *args: Any, **kwargs: Any) -> Any:
    """`load(*args, **kwargs)`, its ValueError said again naming `key` (the loaders' own advice names the actor's)."""
    try:
        return load(*args, **kwargs)
    except ValueError as err:
        if key in str(err):
            raise
        what = str(err).split(";")[0]
        raise ValueError(f"{key}={str(path)!r}: {what}; set {key} to a directory written by save_pretrained") from err


def reward_model_head(path: str | Path, head: str = "auto") -> str:
    """`sequence_classification` or `value_head` for the checkpoint at `path` (`auto`: from config.json)."""
    if head != "auto":
        return head
    config = read_config_json(path)
    archs = config.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "sequence_classification"
    if (Path(path) / VALUE_HEAD_FILE).is_file():
        return "value_head"
    raise ValueError(
        f"{_PATH_KEY}={str(path)!r}: neither a sequence-classification checkpoint (architectures {archs}) nor a "
        f"causal LM with {VALUE_HEAD_FILE}; point the key at a reward model, or set reward_model.model.head"
    )


def _classifier(model: nn.Module, path: str | Path) -> nn.Module:
    """`model` checked to have one label, set to pool its last column."""
    labels = getattr(getattr(model, "config", None), "num_labels", 1)
    if labels != 1:
        raise ValueError(
            f"{_PATH_KEY}={str(path)!r}: the classifier has {labels} labels; a reward model has one (its score)"
        )
    # A classifier pools its last token that is not the pad id. The rows come left-padded, so the last column is
    # every row's last real token: an id no token has makes the pooling read exactly that column, also for a
    # response that ends in the pad id (eos == pad), and for a checkpoint that names no pad token.
    model.config.pad_token_id = -1
    return model


def load_reward_model(
    path: str | Path,
    *,
    head: str = "auto",
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    meta: bool = False,
    trust_remote_code: bool = False,
) -> nn.Module:
    """The reward model at `path` in eval mode: on `device`, or (`meta`) a skeleton with no weights read."""
    return load_keyed(
        _PATH_KEY,
        path,
        _load_reward_model,
        path,
        head=head,
        dtype=dtype,
        device=device,
        meta=meta,
        trust_remote_code=trust_remote_code,
    )


def _load_reward_model(
    path: str | Path, *, head: str, dtype: str, device: str | torch.device, meta: bool, trust_remote_code: bool
) -> nn.Module:
    kind = reward_model_head(path, head)
    torch_dtype = resolve_dtype(dtype)
    if kind == "value_head":
        if meta:
            base = build_causal_lm_on_meta(path, dtype=dtype, trust_remote_code=trust_remote_code)
            with torch.device("meta"):
                return ValueModel.from_causal_lm(base, copy=False).eval()
        base = load_causal_lm(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code, lm_head=False)
        model = ValueModel.from_causal_lm(base, copy=False)
        head_file = Path(path) / VALUE_HEAD_FILE
        if not head_file.is_file():
            raise ValueError(f"{_PATH_KEY}={str(path)!r}: no {VALUE_HEAD_FILE} beside the causal LM")
        from safetensors.torch import load_file

        state = load_file(str(head_file))
        model.value_head.load_state_dict({k: v.to(torch_dtype) for k, v in state.items()})
        return model.to(device).eval()
    if meta:
        config = load_model_config(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(
                config, dtype=torch_dtype, trust_remote_code=trust_remote_code
            )
        return _classifier(model, path).eval()
    p = check_checkpoint_dir(path, trust_remote_code=trust_remote_code)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            str(p), dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise ValueError(
            f"cannot load the reward model in {str(p)!r}: {type(err).__name__}: {str(err).splitlines()[0]}; "
            f"check its files, or set {_PATH_KEY} to another checkpoint"
        ) from err
    return _classifier(model, path).to(device).eval()


def sequence_scores(module: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scores (B,) float32 of left-padded rows `input_ids`, `attention_mask`: (B, S), read at the last column.

    `module` is a reward model from `load_reward_model` (or its sharded wrapper: its own forward gathers).
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if isinstance(module, ValueModel) or isinstance(getattr(module, "value_head", None), nn.Linear):
        return module(input_ids, attention_mask, position_ids)[:, -1].float()
    out = module(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.logits[:, 0].float()


def save_value_head_model(model: ValueModel, causal_lm: PreTrainedModel, path: str | Path) -> None:
    """Write `causal_lm` (whose body `model` holds) and `model`'s value head as a value-head reward model at `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    causal_lm.save_pretrained(str(path))
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in model.value_head.state_dict().items()}, path / VALUE_HEAD_FILE
    )


def build_tiny_reward_model(
    tokenizer: PreTrainedTokenizerBase, *, arch: str = "qwen3", seed: int = 0, **kw: Any
) -> PreTrainedModel:
    """A randomly initialised tiny sequence classifier of `arch`, one label unless `num_labels` says (seeded; the other
    `kw` go to `tiny_config`)."""
    kw.setdefault("vocab_size", len(tokenizer))
    labels = kw.pop("num_labels", 1)
    config = tiny_config(arch, **kw)
    config.num_labels = labels
    config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
        # The classifier's head starts at std 0.02 of a 64-wide state: scores of about 1e-2; a wider spread makes
        # the tiny model's scores tell sequences apart in tests and benchmarks.
        nn.init.normal_(model.score.weight, std=1.0)
    return model.eval()
