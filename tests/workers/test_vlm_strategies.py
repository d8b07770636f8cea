"""A vision-language actor under FSDP2 or DDP over two gloo ranks takes the one-rank step (packed, then padded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_strategies import BASE, FSDP2, LOG_PROB, PADDED, RANKS_SCRIPT, UPDATE, _actor, _assert_same_params
from update_batches import ragged_update_fields

from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.models.loading import load_model_config, load_tokenizer
from conveyor.models.tiny_vlm import load_image_processor, save_tiny_vlm
from conveyor.models.vision import VISION_FIELDS, VisionProcessor
from conveyor.tasks.prompts import PromptEncoder
from conveyor.tasks.visual import make_visual_sum_records

B, R = 7, 4
pytestmark = pytest.mark.process


def _batch(path: str, overrides: list[str]) -> dict:
    """Seven samples of the visual task (one text-only), ragged responses, advantages, the initial old log-probs."""
    tok = load_tokenizer(path, padding_side="left")
    vision = VisionProcessor(load_image_processor(path), tok, load_model_config(path))
    records = make_visual_sum_records(B - 1, seed=0, max_operand=9)
    records.append({**records[0], "images": [], "prompt": [{"role": "user", "content": "1+22="}]})
    fields, _ = PromptEncoder(tok, 32, "error", vision=vision).fields(records, [f"p{i}" for i in range(B)], range(B))
    fields = {k: v for k, v in fields.items() if k in ("prompts", "prompt_mask", *VISION_FIELDS)}
    update = ragged_update_fields(B, fields["prompts"].shape[1], R, 40, torch.Generator().manual_seed(0))
    fields.update({k: update[k] for k in ("responses", "response_mask", "advantages")})
    plane = make_data_plane("memory")
    keys = [f"s{i}" for i in range(B)]
    meta = plane.kv_batch_put(keys, "p", fields)
    _actor(load_config(None, overrides), model_path=path, data_plane=plane).compute_log_prob(
        meta.with_extra_info(**LOG_PROB)
    )
    fields["old_log_probs"] = plane.kv_batch_get(keys, "p", ["old_log_probs"])["old_log_probs"]
    return fields


# One sample a micro-batch under DDP: the text-only sample's micro-batch leaves the vision tower unused on its rank.
STRATEGIES = {"fsdp2": FSDP2, "dp": ["actor_rollout_ref.actor.strategy=dp"]}
MICRO = {"fsdp2": [], "dp": ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]}


@pytest.mark.parametrize("strategy", ["fsdp2", "dp"])
def test_two_ranks_take_the_one_rank_step(tmp_path, strategy: str) -> None:
    """Pixels and M-RoPE positions split over ranks with their samples: the sharded (FSDP2) or replicated (DDP),
    packed update moves the weights (the vision tower's included) exactly as the one-rank padded update does,
    DDP's with a micro-batch of no images on one rank."""
    path = str(save_tiny_vlm("qwen2_5_vl", tmp_path / "vlm"))
    overrides = [*BASE, f"actor_rollout_ref.model.path={path}", *MICRO[strategy]]
    fields = _batch(path, overrides)
    torch.save(fields, tmp_path / "batch.pt")
    (tmp_path / "out").mkdir()
    spec = {
        "world": 2,
        "model_path": path,
        "runs": [
            {
                "role": "actor",
                "overrides": overrides + STRATEGIES[strategy],
                "jobs": ["update"],
                "out": str(tmp_path / "out"),
                "batch": str(tmp_path / "batch.pt"),
            }
        ],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, str(RANKS_SCRIPT), str(tmp_path / "spec.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    plane = make_data_plane("memory")
    meta = plane.kv_batch_put([f"s{i}" for i in range(B)], "p", fields).with_extra_info(**UPDATE)
    worker = _actor(load_config(None, overrides + [PADDED]), model_path=path, data_plane=plane)
    initial = {k: v.clone() for k, v in worker.model_state_dict().items()}
    worker.update_actor(meta)
    want = worker.model_state_dict()
    _assert_same_params(torch.load(tmp_path / "out" / "params.pt", weights_only=True), want, initial)
    moved = max(float((want[k] - initial[k]).abs().max()) for k in want if ".visual." in f".{k}")
    assert moved > 5e-5, "the vision tower did not train"
