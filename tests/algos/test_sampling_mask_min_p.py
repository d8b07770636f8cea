"""min_p in validation and per call: the key, and the generation rank handing each call's min-p to its engine."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conveyor.config import load_config
from conveyor.config.fields import ConfigError
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFEngine
from conveyor.workers.ranks.calls import GenerateCall
from conveyor.workers.ranks.generation import _call_min_p


def test_val_kwargs_min_p_is_a_key_and_is_checked() -> None:
    cfg = load_config(None, ["actor_rollout_ref.rollout.val_kwargs.min_p=0.3"])
    assert cfg.actor_rollout_ref.rollout.val_kwargs.min_p == 0.3
    assert load_config(None, []).actor_rollout_ref.rollout.val_kwargs.min_p == 0.0
    with pytest.raises(ConfigError, match="val_kwargs.min_p"):
        load_config(None, ["actor_rollout_ref.rollout.val_kwargs.min_p=1.5"])


def _call() -> GenerateCall:
    base = dict(
        max_new_tokens=4,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        do_sample=True,
        seed=0,
        capture_routing=False,
        pad_to_max_new_tokens=False,
    )
    return GenerateCall(**base)


def test_a_call_without_min_p_samples_with_the_rollouts() -> None:
    rollout = load_config(None, ["actor_rollout_ref.rollout.min_p=0.2"]).actor_rollout_ref.rollout
    assert _call_min_p(_call(), rollout) == 0.2
    # A call that carries its own (validation's val_kwargs.min_p) wins over the rollout's.
    assert _call_min_p(dataclasses.replace(_call(), min_p=0.0), rollout) == 0.0


@pytest.mark.process
def test_hf_engine_samples_under_min_p() -> None:
    # min_p=1 keeps only the likeliest token of each row: sampling is then greedy decoding, log-prob 0.
    tok = build_char_tokenizer()
    model = build_tiny_model("qwen3", tok, seed=0, initializer_range=0.3).eval()
    enc = tok(["1+2=", "7*8="], padding=True, return_tensors="pt")
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=10_000)
    gen = torch.Generator().manual_seed(0)
    sampled = engine.generate(
        enc["input_ids"], enc["attention_mask"], SamplingParams(max_new_tokens=6, min_p=1.0), generator=gen
    )
    greedy = engine.generate(
        enc["input_ids"], enc["attention_mask"], SamplingParams(max_new_tokens=6, do_sample=False), generator=gen
    )
    assert torch.equal(sampled["responses"], greedy["responses"])
    assert torch.equal(sampled["rollout_log_probs"], torch.zeros_like(sampled["rollout_log_probs"]))
    free = engine.generate(enc["input_ids"], enc["attention_mask"], SamplingParams(max_new_tokens=6), generator=gen)
    assert (free["rollout_log_probs"] < 0).any()


@pytest.mark.process
def test_validation_samples_under_val_kwargs_min_p(tmp_path, tiny_run_base) -> None:
    """min_p=1 keeps only the likeliest token: sampled validation is then greedy validation, value for value; without
    it, sampling at temperature 1 from the untrained model is not."""
    from conveyor.trainer.run import run_training

    def validation(name: str, *overrides: str) -> dict[str, float]:
        run_dir = tmp_path / name
        run_training(
            load_config(
                None,
                tiny_run_base + [f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=1", *overrides],
            )
        )
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {k: v for r in rows if r["step"] == 0 for k, v in r.items() if k.startswith("val")}

    sampled = [
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1",
    ]
    greedy = validation("greedy")
    assert greedy
    assert validation("min_p_1", *sampled, "actor_rollout_ref.rollout.val_kwargs.min_p=1.0") == greedy
    assert validation("min_p_0", *sampled) != greedy
