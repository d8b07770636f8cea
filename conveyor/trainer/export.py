"""Export the policy of a run's checkpoint as a Hugging Face checkpoint directory (`conveyor export`).

A checkpoint holds the actor's shards (written by however many ranks trained
it) and, in `hf/`, the model's config and tokenizer. Export builds the model
from that config in this one process, reads the shards into it (no process
group, no unpickling), and writes `config.json`, safetensors weights and the
tokenizer (with its chat template) into a new directory that
`AutoModelForCausalLM.from_pretrained` and serving engines load directly.

It deliberately exports only the policy: the critic's value head and the
optimizer state stay in the checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from conveyor.trainer import checkpoint as ckpt

__all__ = ["export_hf"]


def _choose_checkpoint(run_dir: Path, step: int | None) -> Path:
    root = run_dir / "checkpoints"
    found = ckpt.list_checkpoints(root)
    if not found:
        raise ValueError(f"{run_dir} has no complete checkpoint under checkpoints/; a run saves one every "
                         "trainer.save_freq steps and at its end")
    if step is None:
        return found[-1][1]
    by_step = dict(found)
    if step not in by_step:
        raise ValueError(f"{run_dir} has no checkpoint of step {step}; it has steps {sorted(by_step)}")
    return by_step[step]


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the actor of `run_dir`'s newest checkpoint (or of `step`) to `out` as a Hugging Face checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from conveyor.workers.shards import load_model_weights

    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty; choose a new directory")
    path = _choose_checkpoint(run_dir, step)
    parts = ckpt.load_checkpoint(path)
    hf = path / "hf"
    if "actor" not in parts or not (hf / "config.json").is_file():
        raise ValueError(f"checkpoint {path} lacks the actor's shards or hf/config.json; it cannot be exported")
    config = AutoConfig.from_pretrained(str(hf), trust_remote_code=False)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None), trust_remote_code=False)
    load_model_weights(parts["actor"], model)
    tokenizer = AutoTokenizer.from_pretrained(str(hf), trust_remote_code=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed into place: an interrupted export leaves no half directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
