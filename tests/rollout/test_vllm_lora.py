"""A LoRA actor with the vllm rollout (vLLM's CPU build): the engine gets the merged weights after an update.

vLLM's CPU build is given the weights with the adapters merged in (W + scale * B @ A, under the base
model's names), through the same in-place sync a full fine-tuning run uses; its own LoRA serving is not
used (the trainer's fused-expert adapters have no vLLM counterpart). After an update the engine's greedy
tokens are the trainer's own (its Hugging Face forward with the adapters active).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFEngine
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.ranks.actor import PolicyWorker
from conveyor.workers.ranks.calls import GenerateCall, LogProbCall, UpdateCall
from conveyor.workers.ranks.settings import actor_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
from update_batches import ragged_update_fields  # noqa: E402

pytest.importorskip("vllm")

VLLM_LORA = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.model.tiny.num_heads=2",
    "actor_rollout_ref.model.tiny.num_kv_heads=2",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj,experts]",
    "actor_rollout_ref.actor.optim.lr=0.05",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "data.synthetic.num_train=64",
    "data.synthetic.num_val=8",
    "data.max_prompt_length=16",
    "data.max_response_length=8",
]


def test_engine_greedy_after_a_lora_update_equals_the_trainer(tmp_path) -> None:
    cfg = load_config(None, VLLM_LORA + [f"trainer.default_local_dir={tmp_path}"])
    path = prepare_default_model(cfg)
    plane = make_data_plane("memory")
    worker = PolicyWorker(actor_settings(cfg, build_run_plan(cfg, "cpu")), model_path=path, data_plane=plane)
    try:
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, 40, (6, 5), generator=gen)
        call = GenerateCall(
            max_new_tokens=8,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            do_sample=False,
            seed=0,
            capture_routing=False,
            pad_to_max_new_tokens=True,
        ).to_extra_info()
        keys = [f"g{i}" for i in range(6)]

        def engine_greedy(partition):
            meta = plane.kv_batch_put(
                keys, partition, {"prompts": prompts, "prompt_mask": torch.ones_like(prompts, dtype=torch.bool)}
            )
            worker.generate_sequences(meta.with_extra_info(**call))
            return plane.kv_batch_get(keys, partition, ["responses", "response_mask"])

        before = engine_greedy("before")
        # Two real updates of the adapters at a high learning rate.
        fields = ragged_update_fields(8, 5, 4, 40, gen)
        ukeys = [f"u{i}" for i in range(8)]
        meta = plane.kv_batch_put(ukeys, "u", fields)
        worker.compute_log_prob(
            meta.with_extra_info(**LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info())
        )
        for _ in range(2):
            worker.update_actor(
                meta.with_extra_info(**UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info())
            )
        after = engine_greedy("after")
        assert worker.engine.weights_version == worker.optim_steps == 2
        ours = HFEngine(
            worker.model, pad_token_id=worker.tokenizer.pad_token_id, eos_token_id=worker.tokenizer.eos_token_id
        ).generate(prompts, torch.ones_like(prompts), SamplingParams(max_new_tokens=8, do_sample=False))
        width = ours["responses"].shape[1]
        mask = after["response_mask"][:, :width]
        assert torch.equal(mask, ours["response_mask"].bool())
        assert torch.equal(after["responses"][:, :width] * mask, ours["responses"] * mask)
        assert not torch.equal(before["responses"], after["responses"])  # the update changed what is served
    finally:
        worker.close()
