"""Loading and saving local Hugging Face checkpoints (a causal LM, its config and its tokenizer).

Real runs point `actor_rollout_ref.model.path` at a directory written by
`save_pretrained` (config.json, weights, tokenizer files). Mistakes in that
directory are reported here as one line naming the path and the config key,
before transformers gets to raise something less direct: a missing path, no
or unparsable config.json, missing weights, a safetensors file shorter than
its header says (a copy cut off), no tokenizer files. A tokenizer without a
pad token gets its EOS token as pad (with a warning), since batched rollout
and training need one.

Code shipped with a checkpoint (the `auto_map` of its config.json or
tokenizer_config.json) runs only with `trust_remote_code=True`
(`actor_rollout_ref.model.trust_remote_code`). Every load passes that setting
to transformers explicitly, so transformers never stops to ask on stdin.
Without it, a model type transformers knows is built with its own
implementation (with a warning); an unknown one is refused, naming the key.

`build_causal_lm_on_meta` builds the same model from the checkpoint's config
on the meta device, reading no weights: under FSDP2 the ranks other than 0
start from it and get their shards from rank 0 (`conveyor.workers.training.loading`).

It deliberately does not download from a model hub, shard, or wrap models for
data parallelism; the workers do the wrapping.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

__all__ = [
    "check_checkpoint_dir",
    "build_causal_lm_on_meta",
    "max_positions",
    "check_tokenizer_dir",
    "load_causal_lm",
    "load_model_config",
    "load_tokenizer",
    "read_config_json",
    "save_pretrained_checkpoint",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

_PATH_KEY = "actor_rollout_ref.model.path"
_TOKENIZER_KEY = "actor_rollout_ref.model.tokenizer_path"
_TRUST_KEY = "actor_rollout_ref.model.trust_remote_code"

# Any one of these makes a directory a tokenizer directory (fast, sentencepiece, BPE or WordPiece files).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)

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


def _first_line(err: BaseException) -> str:
    """The first line of an exception's message (transformers' run over several), at most 300 characters."""
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


def max_positions(config: dict) -> tuple[int, str] | None:
    """(positions, how they were read) from a config.json: max_position_embeddings, widened by rope scaling."""
    for section in (config, config.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                limit, how = value, f"{key}={value}"
                # A rope-scaled model (YaRN, linear, dynamic) handles factor x its original positions.
                scaling = section.get("rope_scaling") or section.get("rope_parameters")
                factor = scaling.get("factor") if isinstance(scaling, dict) else None
                if isinstance(factor, (int, float)) and factor > 1:
                    original = scaling.get("original_max_position_embeddings") or value
                    if int(original * factor) > limit:
                        limit, how = int(original * factor), f"{how} with rope scaling factor {factor:g}"
                return limit, how
    return None


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of the checkpoint directory `path`; a ValueError naming the file when it is not JSON."""
    file = Path(path).expanduser() / "config.json"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{str(file)!r} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
            f"fix or re-save the checkpoint, or set `{_PATH_KEY}` to another one"
        ) from err
    except (OSError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"cannot read {str(file)!r} ({_first_line(err)}); check `{_PATH_KEY}`") from err
    if not isinstance(data, dict):
        raise ValueError(
            f"{str(file)!r} holds a JSON {type(data).__name__}, not an object of settings; "
            f"fix or re-save the checkpoint, or set `{_PATH_KEY}` to another one"
        )
    return data


def _check_remote_code(path: Path, config: dict[str, Any], trust_remote_code: bool) -> None:
    """Refuse a checkpoint that can only be built by running its own code, unless that is allowed."""
    auto_map = config.get("auto_map")
    if not auto_map or trust_remote_code:
        return
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        logger.warning(
            "%s/config.json names code of its own (auto_map); it is not run: the model is built with transformers' "
            "own %r implementation (set %s=true to run the checkpoint's code instead)",
            path,
            model_type,
            _TRUST_KEY,
        )
        return
    raise ValueError(
        f"model path {str(path)!r} can only be built by running the Python code it ships (config.json's auto_map; "
        f"model_type {model_type!r} is not one transformers knows), and that code is not run by default; "
        f"if you trust this checkpoint, set {_TRUST_KEY}=true"
    )


def _safetensors_problem(file: Path) -> str | None:
    """Why `file` is not a whole safetensors file (None when its header and size agree)."""
    if not file.is_file():
        return "is missing"
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or 8 + n > size:
                return f"is cut short ({size} bytes, shorter than its own header)"
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as err:
        return f"is not a safetensors file ({type(err).__name__}: {_first_line(err)})"
    if 8 + n + end > size:
        return f"is cut short ({size} bytes; its header describes {8 + n + end})"
    return None


def _check_weights(path: Path) -> None:
    """The weight files of a checkpoint are present and whole (safetensors: size checked against the header)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
                raise ValueError(
                    f"{str(index)!r} is not a valid weight index ({_first_line(err)}); "
                    f"re-save the checkpoint, or set `{_PATH_KEY}` to another one"
                ) from err
            break
    else:
        shards = [name for name in ("model.safetensors", "pytorch_model.bin") if (path / name).is_file()][:1]
        if not shards:
            raise ValueError(
                f"model path {str(path)!r} has no weights (no model.safetensors, pytorch_model.bin or a sharded "
                f"index of them); copy the whole checkpoint, or set `{_PATH_KEY}` to a directory written by "
                "save_pretrained"
            )
    for name in shards:
        shard = path / name
        if name.endswith(".safetensors"):
            problem = _safetensors_problem(shard)
        else:
            problem = None if shard.is_file() and shard.stat().st_size > 0 else "is missing or empty"
        if problem:
            raise ValueError(
                f"weights file {str(shard)!r} {problem}; copy or save the checkpoint again, "
                f"or set `{_PATH_KEY}` to another one"
            )


def check_checkpoint_dir(path: str | Path, *, trust_remote_code: bool = False) -> Path:
    """The directory `path` as a Path, once it holds a readable config.json and whole weights (else a ValueError)."""
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
    _check_remote_code(p, read_config_json(p), trust_remote_code)
    _check_weights(p)
    return p


def check_tokenizer_dir(path: str | Path) -> Path:
    """The directory `path` as a Path, once it holds tokenizer files (else a ValueError naming the keys to set)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(
            f"tokenizer path {str(path)!r} does not exist; set `{_PATH_KEY}` (or `{_TOKENIZER_KEY}`) to a local "
            "directory written by save_pretrained (tokenizers are not downloaded)"
        )
    if not p.is_dir() or not any((p / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"no tokenizer in {str(path)!r} (none of {', '.join(_TOKENIZER_FILES)}); set `{_TOKENIZER_KEY}` to the "
            "directory holding the model's tokenizer"
        )
    return p


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    mmap: bool | None = None,
    lm_head: bool = True,
) -> PreTrainedModel:
    """A causal LM from the local checkpoint directory `path`, in `dtype` on `device` (its own code only if trusted).

    `lm_head` (a role that samples or scores tokens): refuse a checkpoint with no weights for the LM head (a
    sequence classifier, say), which loading would fill with random numbers. A critic or a value-head reward model
    reads only the body and passes False.

    `mmap` (None: only when the model leaves the host) memory-maps the checkpoint's files. A model that stays
    in host memory is read instead: tensors built from mapped pages (and the pages of tensors that loading
    converted, such as fused experts) keep the whole file mapped and resident for the model's life.
    """
    p = check_checkpoint_dir(path, trust_remote_code=trust_remote_code)
    on_host = torch.device(device).type == "cpu"
    if mmap is None:
        mmap = not on_host
    kwargs: dict = {"dtype": resolve_dtype(dtype), "trust_remote_code": bool(trust_remote_code)}
    if not mmap:
        kwargs["disable_mmap"] = True
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model, info = _auto_class(p).from_pretrained(str(p), output_loading_info=True, **kwargs)
    except (OSError, ValueError, SafetensorError) as err:
        raise ValueError(
            f"cannot load the model in {str(p)!r}: {type(err).__name__}: {_first_line(err)}; "
            f"check the checkpoint's files, or set `{_PATH_KEY}` to another one"
        ) from err
    if lm_head:
        _check_lm_head(model, info.get("missing_keys") or [], p)
    if not mmap:
        release_freed_host_memory()  # the file's bytes and the loading's copies, freed but kept by the heap
    return model.to(device)


def _auto_class(path: Path) -> type:
    """The auto class of a checkpoint: a vision-language model (a config with a vision tower) is an image-text one."""
    try:
        config = read_config_json(path)
    except ValueError:
        return AutoModelForCausalLM  # from_pretrained reports the file's problem in its own words
    return AutoModelForImageTextToText if isinstance(config.get("vision_config"), dict) else AutoModelForCausalLM


def _check_lm_head(model: PreTrainedModel, missing: list[str] | set[str], path: Path) -> None:
    """Refuse a model whose LM head the checkpoint did not hold (and that is not tied to the embeddings)."""
    head = model.get_output_embeddings()
    if head is None or getattr(model.config, "tie_word_embeddings", False):
        return
    names = {name for name, param in model.named_parameters() if any(param is q for q in head.parameters())}
    if names & set(missing):
        archs = getattr(model.config, "architectures", None) or ["unknown"]
        raise ValueError(
            f"the checkpoint in {str(path)!r} holds no weights for a language-model head ({', '.join(sorted(names))}: "
            f"it is a {', '.join(archs)} checkpoint), so the head would be random; point `{_PATH_KEY}` at a causal "
            "LM (a reward model goes under reward_model.model.path)"
        )


def release_freed_host_memory() -> None:
    """Hand memory the C heap keeps after frees back to the system (glibc's malloc_trim; elsewhere nothing)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


def build_causal_lm_on_meta(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """The causal LM of the checkpoint `path` built from its config on the meta device: no weights read, no memory.

    The same modules, names, dtypes and shapes as `load_causal_lm` gives (in eval
    mode, as from_pretrained leaves it); the ranks that get their shards from
    rank 0 start from it (`conveyor.workers.training.loading`).
    """
    config = load_model_config(path, trust_remote_code=trust_remote_code)
    kwargs: dict = {"dtype": resolve_dtype(dtype), "trust_remote_code": bool(trust_remote_code)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, **kwargs)
    return model.eval()


def load_model_config(path: str | Path, *, trust_remote_code: bool = False) -> PretrainedConfig:
    """The Hugging Face config of the checkpoint directory `path` (its own config class only if trusted)."""
    p = check_checkpoint_dir(path, trust_remote_code=trust_remote_code)
    try:
        return AutoConfig.from_pretrained(str(p), trust_remote_code=bool(trust_remote_code))
    except (OSError, ValueError) as err:
        raise ValueError(
            f"cannot read the config of {str(p)!r}: {type(err).__name__}: {_first_line(err)}; "
            f"check its config.json, or set `{_PATH_KEY}` to another checkpoint"
        ) from err


def load_tokenizer(
    path: str | Path, *, padding_side: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `path`, with a pad token guaranteed (EOS stands in when it has none)."""
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"`padding_side` must be 'left', 'right' or None, got {padding_side!r}")
    p = check_tokenizer_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p), trust_remote_code=bool(trust_remote_code))
    except Exception as err:  # the tokenizers library raises plain Exception; any failure here is the files'
        if "trust_remote_code" in str(err):
            raise ValueError(
                f"the tokenizer in {str(p)!r} can only be built by running the Python code it ships "
                f"(tokenizer_config.json's auto_map), which is not run by default; if you trust it, "
                f"set {_TRUST_KEY}=true"
            ) from err
        raise ValueError(
            f"cannot load the tokenizer in {str(p)!r}: {type(err).__name__}: {_first_line(err)}; "
            f"fix its files, or set `{_TOKENIZER_KEY}` to the model's tokenizer"
        ) from err
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
