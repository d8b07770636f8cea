"""Export the policy of a run's checkpoint as a Hugging Face checkpoint directory (`conveyor export`).

A checkpoint holds the actor's shards (written by however many ranks trained
it) and, in `hf/`, the model's config and tokenizer. Export builds the model
from that config in this one process, reads the shards into it (no process
group, no unpickling), and writes `config.json`, safetensors weights and the
tokenizer (with its chat template) into a new directory that
`AutoModelForCausalLM.from_pretrained` and serving engines load directly.

A LoRA run's checkpoint holds the adapters and the path of the base
checkpoint they adapt (PEFT's `adapter_config.json`): export merges them into
the base weights, or with `adapter_only` writes the adapter in PEFT's format.

A run with loss-free balancing (`actor_rollout_ref.actor.router.bias_update_rate`) trained routers whose
top-k is chosen on logits plus a per-expert bias that no Hugging Face MoE class of these architectures holds
and that cannot be folded into the router's weight: export writes the model without it (so a Hugging Face
load routes by the logits alone), keeps the biases in `router_selection_bias.safetensors`, and says so.

It deliberately exports only the policy: the critic's value head and the
optimizer state stay in the checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from conveyor.files import make_dir
from conveyor.trainer import checkpoint as ckpt

__all__ = ["export_hf", "SELECTION_BIAS_FILE"]

logger = logging.getLogger(__name__)

#: Where an export keeps the routers' loss-free balancing biases, which the exported model has no place for.
SELECTION_BIAS_FILE = "router_selection_bias.safetensors"


def _choose_checkpoint(run_dir: Path, step: int | None) -> Path:
    root = run_dir / "checkpoints"
    found = ckpt.list_checkpoints(root)
    if not found:
        raise ValueError(
            f"{run_dir} has no complete checkpoint under checkpoints/; a run saves one every "
            "trainer.save_freq steps and at its end"
        )
    if step is None:
        return found[-1][1]
    by_step = dict(found)
    if step not in by_step:
        raise ValueError(f"{run_dir} has no checkpoint of step {step}; it has steps {sorted(by_step)}")
    return by_step[step]


def _lora_model(actor_dir: Path, config, dtype) -> tuple:
    """A LoRA checkpoint's base model (from the path its adapter_config.json names) with the adapters loaded."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from conveyor.workers.training.shards import load_model_weights

    lora = LoraConfig.from_pretrained(str(actor_dir))
    base = lora.base_model_name_or_path
    if not base or not Path(base).is_dir():
        raise ValueError(
            f"{actor_dir} holds LoRA adapters over the base checkpoint {base!r}, which is not a "
            "directory here: the base weights are not in the checkpoint; make that path available"
        )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, trust_remote_code=False)
    lora.inference_mode = False
    peft_model = get_peft_model(model, lora)
    load_model_weights(actor_dir, model, adapters_only=True)
    return peft_model, model


def _drop_selection_bias(biases: dict, out: Path, model_class: str) -> None:
    """Write the routers' loss-free balancing biases beside the export, and say why the model goes without them."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in biases.items()}, str(out / SELECTION_BIAS_FILE))
    largest = max(float(v.abs().max()) for v in biases.values())
    logger.warning(
        "export: the routers carry a loss-free balancing bias (actor_rollout_ref.actor.router.bias_update_rate; "
        "largest |bias| %.4g); %s has no place for one, and it cannot be folded into the router's weight (a linear "
        "map without a bias term, over an RMS-normalised input with no constant component), so the exported model "
        "chooses its experts without it: a Hugging Face load routes differently from the trainer wherever the bias "
        "changed a token's top-k. The biases are kept in %s (DeepSeek-V3's tensor names).",
        largest,
        model_class,
        SELECTION_BIAS_FILE,
    )


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None, adapter_only: bool = False) -> Path:
    """Write the actor of `run_dir`'s newest checkpoint (or of `step`) to `out` as a Hugging Face checkpoint.

    A LoRA run's checkpoint holds adapters only: by default they are merged into the base model (a plain
    checkpoint); `adapter_only` writes the adapter in PEFT's format instead (`PeftModel.from_pretrained`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from conveyor.models.loading import read_config_json
    from conveyor.models.router_control import BIAS_NAME
    from conveyor.workers.training.shards import load_model_tensors, load_model_weights

    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise ValueError(
            f"run directory {run_dir} " + ("is a file, not a run directory" if run_dir.exists() else "does not exist")
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; choose a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty; choose a new directory")
    make_dir(out.parent, "--out")  # before the model is built: a path under a file fails at once
    path = _choose_checkpoint(run_dir, step)
    parts = ckpt.load_checkpoint(path)
    hf = path / "hf"
    if "actor" not in parts or not (hf / "config.json").is_file():
        raise ValueError(f"checkpoint {path} lacks the actor's shards or hf/config.json; it cannot be exported")
    # transformers reports a broken config.json as an OSError that names no errno; this says which file and why.
    read_config_json(hf)
    try:
        config = AutoConfig.from_pretrained(str(hf), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(
            f"checkpoint {path}: {hf / 'config.json'} cannot be read as a model config "
            f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); export another "
            "checkpoint (--step)"
        ) from err
    # Read before the model is built: a damaged tokenizer is found in a second, not after the weights load.
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(hf), trust_remote_code=False)
    except Exception as err:  # a damaged tokenizer.json reaches the tokenizers library's every error type
        raise ValueError(
            f"checkpoint {path}: the tokenizer in {hf} (tokenizer.json, tokenizer_config.json) cannot be read "
            f"({type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}); export another "
            "checkpoint (--step)"
        ) from err
    actor_dir = Path(parts["actor"])
    is_lora = (actor_dir / "adapter_config.json").is_file()
    if adapter_only and not is_lora:
        raise ValueError(
            f"--adapter-only: checkpoint {path} is a full fine-tuning run's (no LoRA adapters, "
            "actor_rollout_ref.model.lora_rank was 0); export it without --adapter-only"
        )
    if is_lora:
        peft_model, _ = _lora_model(actor_dir, config, getattr(config, "dtype", None))
        model = peft_model if adapter_only else peft_model.merge_and_unload()
    else:
        # A vision-language checkpoint is rebuilt as its image-text class (the vision tower's weights are the actor's).
        auto = (
            AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
        )
        model = auto.from_config(config, dtype=getattr(config, "dtype", None), trust_remote_code=False)
        load_model_weights(parts["actor"], model)
    try:
        biases = load_model_tensors(actor_dir, "." + BIAS_NAME)
    except ValueError:
        raise
    except Exception as err:  # metadata that unpickles but describes tensors no one could build
        raise ValueError(
            f"checkpoint file {actor_dir / '.metadata'} describes tensors that cannot be read "
            f"({type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}); export another "
            "checkpoint (--step)"
        ) from err
    # Written beside the target and renamed into place: an interrupted export leaves no half directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if (hf / "preprocessor_config.json").is_file():  # a vision-language policy's image processor
            shutil.copy(hf / "preprocessor_config.json", tmp / "preprocessor_config.json")
        if biases:
            _drop_selection_bias(biases, tmp, type(model).__name__)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
