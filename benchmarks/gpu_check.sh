#!/usr/bin/env bash
# The prepared GPU check: nccl, then 2 training steps under fsdp2 on one GPU with a ~0.86B-parameter
# Qwen3-MoE built from config (no download) with a reference and R3, printing every phase's peak GPU
# memory and tokens/s; R3 with and without gradient checkpointing (their first gradient norms); one
# update and log-prob pass over 4k-token responses of a ~1B model; packed forwards (torch's varlen kernel) against
# padded ones on a ~1B model with responses of 64..4096 tokens; then the rollout
# benchmark's GPU goal, vLLM against the hf rollout on a ~0.44B model, and the vLLM engine's contract on the GPU
# (routing shape, syncs after real updates, the sync time of a ~0.5B model) (when vllm is installed); last,
# expert parallelism of size 1 through the EP code path against the plain model (benchmarks/ep_check.py);
# asynchronous training (k = 1, the rollout on a thread) against synchronous on one GPU (benchmarks/async.py).
#
#   bash benchmarks/gpu_check.sh            # from the repository root, with the venv's python on PATH or PY=...
#
# It runs the same code as the CPU tests (gloo there, nccl here); only the device differs.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d)}
export CONVEYOR_CACHE=${CONVEYOR_CACHE:-$OUT/cache}

echo "== devices"
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0),
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PY

echo "== nccl all_reduce on one rank"
"$PY" - <<'PY'
import os, socket, torch, torch.distributed as dist
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("nccl", rank=0, world_size=1)
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
print("all_reduce ok:", t.tolist())
dist.destroy_process_group()
PY

# A ~0.86B Qwen3-MoE built from config: float32 master weights, bf16 compute (fsdp2's GPU defaults).
MODEL=(actor_rollout_ref.model.tiny.hidden_size=1024 actor_rollout_ref.model.tiny.num_layers=16
  actor_rollout_ref.model.tiny.num_heads=16 actor_rollout_ref.model.tiny.num_kv_heads=8
  actor_rollout_ref.model.tiny.intermediate_size=2048 actor_rollout_ref.model.tiny.num_experts=8
  actor_rollout_ref.model.tiny.warmstart_steps=0)
RUN=(trainer.device=cuda trainer.total_training_steps=2 trainer.test_freq=0 trainer.val_before_train=false
  trainer.logger=[console,jsonl] trainer.progress_bar=false trainer.dump_freq=0 trainer.save_freq=0
  actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.ref.strategy=fsdp2)

# Every phase's peak (rollout, old_log_prob, ref, update_actor, ...), the step's speed and, for the R3
# checks, the first update's gradient norm (equal with and without checkpointing when replay holds).
report() {
  "$PY" - "$1" <<'PY'
import sys
from pathlib import Path
from conveyor.metrics.trackers import read_metrics_jsonl
rows = [r for r in read_metrics_jsonl(Path(sys.argv[1]) / "metrics.jsonl") if r.get("step", 0) > 0]
for key in sorted(k for k in rows[-1] if "/perf/" in k and k.endswith("/max_memory_gb")):
    print(f"  {key}: {rows[-1][key]:.2f} GiB")
print(f"  tokens/s (step {rows[-1]['step']}): {rows[-1]['perf/throughput']:.0f}; step time {rows[-1]['timing_s/step']:.2f} s")
print(f"  step 1 actor/grad_norm: {rows[0]['actor/grad_norm']:.6g}")
PY
}

echo "== 2 steps of fsdp2 (one GPU), reference + KL loss, R3: each phase's peak"
"$PY" -m conveyor.cli train "${RUN[@]}" "${MODEL[@]}" trainer.default_local_dir="$OUT/run" \
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.router_replay.mode=R3 \
  data.train_batch_size=32 actor_rollout_ref.rollout.n=8 data.max_response_length=64 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64
report "$OUT/run"

echo "== R3 with gradient checkpointing against without (same seed; the step-1 grad norms should agree)"
for ckpt in false true; do
  "$PY" -m conveyor.cli train "${RUN[@]}" "${MODEL[@]}" trainer.default_local_dir="$OUT/r3-ckpt-$ckpt" \
    trainer.total_training_steps=1 actor_rollout_ref.actor.router_replay.mode=R3 \
    actor_rollout_ref.model.enable_gradient_checkpointing=$ckpt \
    data.train_batch_size=8 actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.rollout.n=4 \
    data.max_response_length=64 >/dev/null
  echo "enable_gradient_checkpointing=$ckpt"; report "$OUT/r3-ckpt-$ckpt"
done

echo "== one update and one log-prob pass over 4k-token responses, ~1B model, checkpointing on: peaks"
"$PY" -m conveyor.cli train "${RUN[@]}" trainer.default_local_dir="$OUT/long" trainer.total_training_steps=1 \
  actor_rollout_ref.model.tiny.hidden_size=1536 actor_rollout_ref.model.tiny.num_layers=16 \
  actor_rollout_ref.model.tiny.num_heads=16 actor_rollout_ref.model.tiny.num_kv_heads=8 \
  actor_rollout_ref.model.tiny.intermediate_size=1536 actor_rollout_ref.model.tiny.num_experts=8 \
  actor_rollout_ref.model.tiny.warmstart_steps=0 actor_rollout_ref.model.enable_gradient_checkpointing=true \
  algorithm.rollout_correction.bypass_mode=false \
  data.max_prompt_length=64 data.max_response_length=4096 data.train_batch_size=2 actor_rollout_ref.rollout.n=2 \
  actor_rollout_ref.actor.ppo_mini_batch_size=2 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1
report "$OUT/long"
echo "== packed forwards (use_remove_padding): torch's varlen flash kernel against padded SDPA, ~1B dense Qwen3, bf16"
"$PY" - <<'PY'
import time, torch
from transformers import AutoModelForCausalLM
from conveyor.algos.logprob import logprobs_and_entropy
from conveyor.models.packing import PackedRows, enable_packing
from conveyor.models.tiny import tiny_config
torch.manual_seed(0)
cfg = tiny_config("qwen3", vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8,
                  intermediate_size=5632, max_position_embeddings=8192)
model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to("cuda", torch.bfloat16)
print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
gen = torch.Generator().manual_seed(0)
B, P = 8, 64
lengths = torch.linspace(64, 4096, B).long()  # responses of 64..4096 tokens
R = int(lengths.max())
prompts = torch.randint(1, 32000, (B, P), generator=gen)
responses = torch.randint(1, 32000, (B, R), generator=gen)
span = torch.arange(R)[None] < lengths[:, None]
responses[~span] = 0
ids = torch.cat([prompts, responses], 1).cuda()
attention = torch.cat([torch.ones(B, P, dtype=torch.bool), span], 1).long().cuda()
positions = (attention.cumsum(-1) - 1).clamp(min=0)
span, responses = span.cuda(), responses.cuda()

def padded():
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False,
                   logits_to_keep=R + 1).logits[:, :-1]
    return logprobs_and_entropy(logits, responses, False)[0] * span

def packed():
    rows = PackedRows.from_masks(attention, span)
    logits = model(**rows.model_kwargs(ids, positions), use_cache=False, logits_to_keep=rows.predict).logits
    lp = logprobs_and_entropy(logits, responses[rows.rows, rows.cols][None], False)[0]
    return rows.responses(lp[0], R) * span

def timed(fn):
    for _ in range(2):
        fn().sum().backward()
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); t0 = time.perf_counter()
    for _ in range(3):
        fn().sum().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 3, torch.cuda.max_memory_allocated() / 2**30

with torch.no_grad():
    want = padded()
enable_packing(model)
with torch.no_grad():
    got = packed()
diff = (got - want).abs()[span]
print(f"log-probs packed vs padded: max |diff| {diff.max():.4f}, mean {diff.mean():.5f} (bf16; tokens {int(span.sum())})")
t_pad, m_pad = timed(padded)
t_pack, m_pack = timed(packed)
print(f"forward+backward: padded {t_pad:.3f} s, {m_pad:.1f} GiB peak; packed {t_pack:.3f} s, {m_pack:.1f} GiB peak; "
      f"speed-up {t_pad / t_pack:.2f}x")
PY

echo "== vLLM in the actor's process on the GPU: 3 steps with R3 from vLLM's captured routing, sleeping at level 2"
if "$PY" -c "import vllm" 2>/dev/null; then
  "$PY" -m conveyor.cli train --config examples/vllm_cpu.yaml "${RUN[@]}" trainer.default_local_dir="$OUT/vllm" \
    trainer.total_training_steps=3 actor_rollout_ref.actor.strategy=none actor_rollout_ref.ref.strategy=none \
    actor_rollout_ref.actor.router_replay.mode=R3 actor_rollout_ref.rollout.free_cache_engine=true \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.3
  report "$OUT/vllm"
else
  echo "vllm is not installed in $PY's environment: pip install 'conveyor[vllm]' there, then rerun"
fi

echo "== vLLM engine contract on the GPU: routing shape, two syncs after real updates, sync time of a ~0.5B model"
if "$PY" -c "import vllm" 2>/dev/null; then
  "$PY" - "$OUT/engine" <<'PY'
import sys, time, torch
from pathlib import Path
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFRollout
from conveyor.rollout.vllm import VLLMRollout
from conveyor.rollout.weight_sync import iter_weights

root = Path(sys.argv[1]); tok = build_char_tokenizer()
enc = tok(["1+2=", "12+345=", "7*8=", "100-1="], padding=True, padding_side="left", return_tensors="pt")
ids, mask = enc["input_ids"].cuda(), enc["attention_mask"].cuda()
greedy = SamplingParams(max_new_tokens=8, do_sample=False, capture_routing=True)

def same(a, b):
    return bool(torch.equal(a["responses"].cpu() * a["response_mask"].cpu(), b["responses"].cpu() * b["response_mask"].cpu()))

# A small Qwen3-MoE with one dense layer (mlp_only_layers): routing by sparse layer, R3's shape.
model = build_tiny_model("qwen3_moe", tok, seed=0, hidden_size=256, num_heads=4, num_kv_heads=4, num_layers=3,
                         initializer_range=0.3, mlp_only_layers=[1]).cuda()
model.save_pretrained(root / "moe"); tok.save_pretrained(root / "moe")
from conveyor.models.moe_routing import moe_info, sparse_decoder_layers
info = moe_info(model)
engine = VLLMRollout(str(root / "moe"), hf_config=model.config, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                     max_model_len=64, max_num_seqs=16, device="cuda", gpu_memory_utilization=0.2, enforce_eager=False,
                     capture_routing=True, sparse_layers=sparse_decoder_layers(model))
engine.update_weights(iter_weights(model), version=0)
out = engine.generate(ids, mask, greedy)
r = out.get("routed_experts")
print("routing:", None if r is None else tuple(r.shape), "want (B, P+R, L, K) =",
      (ids.shape[0], ids.shape[1] + out["responses"].shape[1], info.num_layers, info.top_k))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
for version in (1, 2):  # two real updates, each followed by a sync
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    for _ in range(10):
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1],
                                                 torch.full((len(ids),), 7 + version, device="cuda"))
        opt.zero_grad(); loss.backward(); opt.step()
    t0 = time.perf_counter(); engine.update_weights(iter_weights(model), version=version); torch.cuda.synchronize()
    ours = HFRollout(model.eval(), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).generate(
        ids, mask, SamplingParams(max_new_tokens=8, do_sample=False))
    model.train()
    print(f"sync {version}: {time.perf_counter() - t0:.3f} s; greedy tokens equal the updated policy's: "
          f"{same(engine.generate(ids, mask, greedy), ours)}")
engine.close()

# The sync time of a ~0.5B dense Qwen3 (bf16 engine over float32 masters), asleep between rollouts.
from transformers import Qwen3Config, AutoModelForCausalLM
cfg = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048)
big = AutoModelForCausalLM.from_config(cfg).cuda()
big.save_pretrained(root / "dense"); tok.save_pretrained(root / "dense")
n = sum(p.numel() for p in big.parameters())
engine = VLLMRollout(str(root / "dense"), hf_config=big.config, pad_token_id=0, eos_token_id=1, dtype="bfloat16",
                     max_model_len=1024, max_num_seqs=64, device="cuda", gpu_memory_utilization=0.3)
for i in range(3):
    t0 = time.perf_counter(); engine.update_weights(iter_weights(big), version=i); torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"sync of {n / 1e9:.2f}B params ({n * 4 / 1e9:.2f} GB float32): {dt:.3f} s, {n * 4 / 1e9 / dt:.1f} GB/s")
engine.close()
PY
else
  echo "vllm is not installed in $PY's environment: pip install 'conveyor[vllm]' there, then rerun"
fi

echo "== rollout: vLLM against the hf rollout, ~0.44B dense Qwen3, batch 256 x 512 new tokens (goal: vllm >= 5x hf)"
if "$PY" -c "import vllm" 2>/dev/null; then
  "$PY" benchmarks/rollout.py --sizes 0.5b --engines hf vllm --device cuda --dtype bfloat16 \
    --batch 256 --new-tokens 512 --repeats 3
else
  echo "vllm is not installed in $PY's environment: pip install 'conveyor[vllm]' there, then rerun"
fi
echo "== expert parallelism of size 1 on one GPU (nccl), through the EP path: logits, gradients, norm, step vs plain"
# The experts through transformers' expert plan, conveyor's counting all-to-all over a group of one and their
# own FSDP2 unit, float32 with TF32 off (1e-5 bars); the 2-rank split is the CPU test test_expert_parallel.py.
"$PY" benchmarks/ep_check.py --device cuda --hidden 1024 --layers 4 --experts 16 --top-k 4 --vocab 4096 \
  --batch 8 --seq 512
echo "== asynchronous training on one GPU: k = 1, the rollout on a thread of the trainer's process, against sync"
# The async speed bar on a device (docs/async.md projects it from CPU figures): a ~0.33B Qwen3-MoE, 128-token
# responses, 8 steps each, the first 2 left out of steps/s as warm-up; the run folders (checkpoints) removed after.
"$PY" benchmarks/async.py --rounds 1 --modes async_k1_thread --skip 2 --out "$OUT/async" \
  --set trainer.device=cuda "${MODEL[@]}" actor_rollout_ref.model.tiny.num_layers=6 trainer.total_training_steps=8 \
  trainer.test_freq=0 trainer.save_freq=0 data.max_response_length=128 actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.ref.strategy=fsdp2 || echo "the asynchronous check failed (above)"
rm -rf "$OUT/async"
echo "== done: $OUT"
