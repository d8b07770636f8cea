"""The float32 LM head (actor_rollout_ref.model.lm_head_fp32): float32 logits over a bf16 body, on every path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.algos.logprob import logprobs_from_logits
from conveyor.config import load_config
from conveyor.models.fused_head import Float32Head, float32_lm_head, fused_lm_head, split_head_output
from conveyor.models.lean import LeanForward
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFEngine
from conveyor.workers.training.memory_budget import Layout, Setup, account


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _bf16_model(tok, arch="qwen3"):
    return build_tiny_model(arch, tok, seed=0, initializer_range=0.3).to(torch.bfloat16).eval()


def _batch(tok):
    enc = tok(["1+2=3", "12+345=357"], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _reference_logits(model, ids, mask, pos) -> torch.Tensor:
    """The body's bf16 hidden states through the head in float32: what the float32 head must compute."""
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        return F.linear(hidden.float(), model.lm_head.weight.float())


def test_float32_logits_equal_a_float32_reference_of_the_head(tok) -> None:
    model = _bf16_model(tok)
    ids, mask, pos = _batch(tok)
    with torch.no_grad():
        bf16 = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    head = float32_lm_head(model)
    assert isinstance(head, Float32Head) and float32_lm_head(model) is head  # idempotent
    assert head.weight.dtype == torch.bfloat16 and model.model.norm.weight.dtype == torch.bfloat16
    with torch.no_grad():
        fp32 = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    ref = _reference_logits(model, ids, mask, pos)
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    torch.testing.assert_close(fp32, ref, rtol=1e-6, atol=1e-6)
    # The bf16 head rounds its logits to bf16's 8 bits: visibly off the float32 reference.
    assert (bf16.float() - ref).abs().max() > 1e-3


def test_lean_and_fused_paths_compute_the_float32_head(tok) -> None:
    model = _bf16_model(tok, "qwen3_moe")
    float32_lm_head(model)
    ids, mask, pos = _batch(tok)
    ref = _reference_logits(model, ids, mask, pos)
    labels = torch.roll(ids, -1, dims=1)
    want = logprobs_from_logits(ref, labels)
    with torch.no_grad(), fused_lm_head(model, labels, with_entropy=False, temperature=1.0):
        stats = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    got, _ = split_head_output(stats, False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The lean forward's prefill: the last prompt position's logits come out of the same float32 head.
    lean = LeanForward(model)
    with torch.no_grad():
        logits, _ = lean.prefill(ids, mask, 2)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref[:, -1], rtol=1e-4, atol=1e-4)


def test_hf_engine_samples_from_the_float32_head(tok) -> None:
    model = _bf16_model(tok)
    ids, mask, _ = _batch(tok)
    engine = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=10_000)
    params = SamplingParams(max_new_tokens=4)
    before = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(0))
    float32_lm_head(model)
    after = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(0))
    # The same weights and draws, log-probs from float32 rather than bf16-rounded logits.
    assert not torch.equal(before["rollout_log_probs"], after["rollout_log_probs"])


def test_a_lora_head_is_refused_naming_the_key(tok) -> None:
    model = _bf16_model(tok)
    model.lm_head = torch.nn.Sequential(model.lm_head)
    model.get_output_embeddings = lambda: model.lm_head
    with pytest.raises(ValueError, match="lm_head_fp32"):
        float32_lm_head(model)


def test_memory_accounting_counts_the_float32_copy() -> None:
    lay = Layout(
        params=10**9,
        layer_params=10**7,
        root_params=10**8,
        hidden=2048,
        layers=24,
        vocab=151936,
        kv_dim=512,
        ffn_tokens_dim=4096,
    )
    base = dict(world=1, rollout_seqs=8, seq_len=1024, micro_seqs=4, compute_bytes=2)
    plain, fp32 = account(lay, Setup(**base)), account(lay, Setup(**base, lm_head_fp32=True))
    copy = lay.vocab * lay.hidden * 4
    assert fp32["old_log_prob"]["LM head float32 copy"] == copy
    assert fp32["update_actor"]["LM head float32 copy and its gradient"] == 2 * copy
    assert fp32["rollout"]["LM head float32 copy"] == copy
    assert fp32["old_log_prob"]["logits"] == 2 * plain["old_log_prob"]["logits"]  # float32, not bf16
    # A float32 model's head is float32 already: nothing more.
    assert account(lay, Setup(**{**base, "compute_bytes": 4}, lm_head_fp32=True)) == account(
        lay, Setup(**{**base, "compute_bytes": 4})
    )


def test_the_key_is_read(tmp_path) -> None:
    assert load_config(None, ["actor_rollout_ref.model.lm_head_fp32=true"]).actor_rollout_ref.model.lm_head_fp32


BF16_RUN = [
    "actor_rollout_ref.model.dtype=bfloat16",
    "actor_rollout_ref.model.allow_low_precision_master_weights=true",
    # The old-log-prob forward runs and the gap is logged (rollout_corr/*), weights untruncated.
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=10.0",
    "data.train_batch_size=16",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "trainer.total_training_steps=4",
]


@pytest.mark.process
def test_bf16_run_with_the_float32_head_has_the_smaller_rollout_gap(tiny_run) -> None:
    # hf rollout, bf16 body on the CPU: the decode loop (one token a forward, KV cache) and the trainer's forward
    # round differently; the float32 head stops adding bf16 rounding of the logits on top of the body's.
    import json

    from conveyor.trainer.run import run_training

    gaps = {}
    for fp32 in (False, True):
        run_dir = f"{tiny_run[-1].split('=', 1)[1]}/fp32-{fp32}"
        overrides = [
            f"trainer.default_local_dir={run_dir}",
            f"actor_rollout_ref.model.lm_head_fp32={str(fp32).lower()}",
        ]
        cfg = load_config(None, tiny_run + BF16_RUN + overrides)
        run_training(cfg)
        rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "actor/pg_loss" in r]
        assert len(rows) == 4
        gaps[fp32] = {
            k: sum(r[k] for r in rows) / len(rows)
            for k in ("rollout_corr/k3_kl", "actor/rollout_corr/probs_diff_max", "rollout_corr/log_prob_abs_diff/mean")
        }
    assert gaps[False]["rollout_corr/k3_kl"] > 0  # bf16: a gap to close
    for key in gaps[False]:
        assert gaps[True][key] < gaps[False][key], (key, gaps)


@pytest.mark.process
def test_vllm_engine_runs_its_head_in_float32(tok, tmp_path) -> None:
    # vLLM's head_dtype: a bf16 engine whose logits are float32, closer to the trainer's float32 head than to its
    # bf16 one.
    pytest.importorskip("vllm")
    from conveyor.config.rollout import RolloutConfig
    from conveyor.rollout.base import EngineContext, engine_spec

    model = build_tiny_model("qwen3", tok, seed=0, hidden_size=64, num_heads=2, num_kv_heads=2, initializer_range=0.3)
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    context = EngineContext(
        model_path=str(tmp_path),
        model=model,
        tokenizer=tok,
        rollout=RolloutConfig(max_num_seqs=8, dtype="bfloat16"),
        model_dtype="bfloat16",
        trust_remote_code=False,
        max_model_len=64,
        seed=0,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        lm_head_fp32=True,
    )
    engine = engine_spec("vllm").build(context)
    try:
        assert engine.llm.llm_engine.model_config.head_dtype == torch.float32
        engine.update_weights(model.state_dict().items(), version=0)
        ids, mask, _ = _batch(tok)
        out = engine.generate(ids, mask, SamplingParams(max_new_tokens=6, do_sample=False))
    finally:
        engine.close()
    seq = torch.cat([ids, out["responses"]], 1)
    att = torch.cat([mask, out["response_mask"].long()], 1)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    p, r = ids.shape[1], out["responses"].shape[1]
    m = out["response_mask"]

    def trainer_log_probs() -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=seq, attention_mask=att, position_ids=pos).logits[:, p - 1 : p + r - 1]
        return logprobs_from_logits(logits.float(), out["responses"])[m]

    bf16_head = trainer_log_probs()
    float32_lm_head(model)
    fp32_head = trainer_log_probs()
    engine_lp = out["rollout_log_probs"][m]
    assert (engine_lp - fp32_head).abs().mean() < (engine_lp - bf16_head).abs().mean()
