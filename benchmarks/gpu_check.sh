#!/usr/bin/env bash
# The prepared GPU check: one command, under 8 minutes on one GPU, every step time-boxed and non-fatal,
# the most informative steps first. Each step's log goes to $OUT/logs.tgz and one row to $OUT/summary.md
# (step | pass/FAIL/skipped | seconds | figure).
#
#   make gpu-wheels                     # here: the pure-Python packages a bare CUDA image lacks, into .whl/
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh   # there: python3 with its own torch, or PY=... (default:
#                                               # .venv/bin/python when it exists, else python3)
#
# Steps: the packed-attention call (torch's varlen kernel) against per-sequence SDPA in bf16 with grouped
# heads, forward and backward; one fsdp2 step in bf16 with fused AdamW; 2 training steps of a small MoE with
# R3, a KL loss and packed forwards (every phase's peak); packed against padded forward+backward; a 16k-token
# packed update with Qwen3's vocabulary through the fused log-prob against the logits (peaks, speed); an update
# through the sequence-parallel path with a group of one (the all-to-alls and the gather on nccl); R3 with and
# without gradient checkpointing in fp32 from a warm-started model (step-1 gradient norms agree); 4096-token
# responses through the workers' endpoints against the memory accounting; expert parallelism of size 1
# in fp32; the actor's parameter and optimizer offload with R3 and an offloaded reference; the hf rollout's
# decode step against `model.generate`; the vLLM steps when vLLM is installed (a colocated run, and weights
# loaded mid-generation under both KV policies; skipped with a message if not).
# It runs the same code as the CPU tests (gloo there, nccl here); only the device differs.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${OUT:-$(mktemp -d)}
BUDGET=${BUDGET:-450}   # seconds for all steps; a step that would start past it is skipped
WHEELS=${WHEELS:-.whl}
START=$(date +%s)
LOG=$(mktemp -d)/logs
mkdir -p "$OUT" "$LOG"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export CONVEYOR_CACHE=${CONVEYOR_CACHE:-$LOG/../cache}

# The packages the image lacks, from wheels carried beside the tree (`make gpu-wheels`); conveyor from
# this tree, not installed.
SITE=$LOG/../site
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl >"$LOG/pip.log" 2>&1 || echo "installing $WHEELS/*.whl failed: see pip.log"
fi
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}

SUMMARY=$OUT/summary.md
printf '| step | result | seconds | figure |\n|---|---|---|---|\n' >"$SUMMARY"
row() { printf '| %s | %s | %s | %s |\n' "$1" "$2" "$3" "$4" | tee -a "$SUMMARY"; }

# step NAME TIMEOUT CMD...: runs CMD in the tree's root, time-boxed by TIMEOUT and by what is left of BUDGET.
# Its row's figure is the log's last `FIGURE:` line, else the last error line.
step() {
  local name=$1 limit=$2; shift 2
  local used=$(( $(date +%s) - START ))
  if (( used + 15 > BUDGET )); then row "$name" skipped 0 "budget: ${used}s of ${BUDGET}s used"; return 0; fi
  (( limit > BUDGET - used )) && limit=$(( BUDGET - used ))
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$LOG/$name.log" 2>&1
  local rc=$? dt=$(( $(date +%s) - t0 )) result=pass
  local fig; fig=$(grep -a '^FIGURE: ' "$LOG/$name.log" | tail -1 | cut -c9- | cut -c1-300)
  if (( rc != 0 )); then
    result=FAIL
    (( rc == 124 || rc == 137 )) && result="FAIL (timed out at ${limit}s)"
    local err; err=$(grep -aE 'Error|error:|Traceback|FAIL' "$LOG/$name.log" | grep -v '^FIGURE' | tail -1 | cut -c1-240)
    fig="${fig:+$fig; }${err}"
  fi
  row "$name" "$result" "$dt" "${fig//|//}"
  tar -czf "$OUT/logs.tgz" -C "$LOG/.." logs 2>/dev/null
  return 0
}
# run_step NAME TIMEOUT DIR OVERRIDES...: a `conveyor train` run into DIR, then its report as the row's figure.
run_step() {
  local name=$1 limit=$2 dir=$3; shift 3
  step "$name" "$limit" bash -c '"$0" -m conveyor.cli train "${@:2}" trainer.default_local_dir="$1" \
    && "$0" benchmarks/gpu_steps.py report "$1"' "$PY" "$dir" "$@"
}

step env 40 "$PY" benchmarks/gpu_steps.py env
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  row cuda FAIL 0 "no CUDA device visible to $PY: the GPU steps need one"
  exit 1
fi

step varlen 60 "$PY" benchmarks/gpu_steps.py varlen --device cuda
step fsdp2_step 60 "$PY" benchmarks/gpu_steps.py fsdp-step --device cuda

# A small Qwen3-MoE built from config (hidden 512, 8 layers, 8 experts): fp32 masters, bf16 compute under fsdp2.
MODEL=(actor_rollout_ref.model.tiny.hidden_size=512 actor_rollout_ref.model.tiny.num_layers=8
  actor_rollout_ref.model.tiny.num_heads=8 actor_rollout_ref.model.tiny.num_kv_heads=4
  actor_rollout_ref.model.tiny.intermediate_size=1024 actor_rollout_ref.model.tiny.num_experts=8
  actor_rollout_ref.model.tiny.warmstart_steps=0)
RUN=(trainer.device=cuda trainer.total_training_steps=2 trainer.test_freq=0 trainer.val_before_train=false
  "trainer.logger=[console,jsonl]" trainer.progress_bar=false trainer.dump_freq=0 trainer.save_freq=0
  actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.ref.strategy=fsdp2
  data.train_batch_size=16 actor_rollout_ref.rollout.n=4 data.max_response_length=64
  actor_rollout_ref.actor.ppo_mini_batch_size=16)
R=$LOG/../runs
run_step moe_r3_kl_packed 110 "$R/moe" "${RUN[@]}" "${MODEL[@]}" \
  actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.router_replay.mode=R3

step packed_vs_padded 70 "$PY" benchmarks/gpu_steps.py packspeed --device cuda
step fused_logprob_16k 45 "$PY" benchmarks/gpu_steps.py fused-logprob --device cuda
step sp_size1_step 30 "$PY" benchmarks/gpu_steps.py sp-step --device cuda

# R3 with and without checkpointing, fp32 compute, from the default example's warm-started tiny model (its
# rewards vary, so the advantages and the step-1 gradient are not zero); the second run reuses the warm start.
R3=(--config examples/tiny_cpu.yaml trainer.device=cuda trainer.total_training_steps=1 trainer.test_freq=0
  trainer.val_before_train=false "trainer.logger=[console,jsonl]" trainer.progress_bar=false trainer.save_freq=0
  actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.router_replay.mode=R3
  actor_rollout_ref.actor.fsdp_config.param_dtype=float32 algorithm.rollout_correction.bypass_mode=false)
for ckpt in false true; do
  run_step r3_checkpointing_$ckpt 70 "$R/r3_$ckpt" "${R3[@]}" actor_rollout_ref.model.enable_gradient_checkpointing=$ckpt
done
step r3_same_grad_norm 20 "$PY" benchmarks/gpu_steps.py same-grad-norm "$R/r3_false" "$R/r3_true"

step long_4096_vs_account 100 "$PY" benchmarks/memory.py --long 4096 --device cuda

step ep_fp32 50 "$PY" benchmarks/ep_check.py --device cuda --hidden 512 --layers 2 --experts 8 --top-k 2 \
  --vocab 4096 --batch 4 --seq 256

# The actor's parameter and optimizer offload (CPU shards over the device-mapped group) with R3, and the
# reference offloaded with a KL loss: what failed on the first GPU run.
run_step offload_r3 90 "$R/offload" "${RUN[@]}" "${MODEL[@]}" trainer.total_training_steps=1 \
  actor_rollout_ref.actor.fsdp_config.param_offload=true actor_rollout_ref.actor.fsdp_config.optimizer_offload=true \
  actor_rollout_ref.ref.fsdp_config.param_offload=true actor_rollout_ref.actor.use_kl_loss=true \
  actor_rollout_ref.actor.router_replay.mode=R3

# Generation was 96% of a GPU step: conveyor's decode loop against transformers' generate on the same model.
step hf_decode 60 "$PY" benchmarks/rollout.py --sizes 50m --engines hf generate --device cuda --dtype bfloat16 \
  --batch 64 --new-tokens 64 --repeats 2

if "$PY" -c 'import vllm' >/dev/null 2>&1; then
  run_step vllm_colocated 120 "$R/vllm" --config examples/vllm_cpu.yaml "${RUN[@]}" trainer.total_training_steps=3 \
    actor_rollout_ref.actor.strategy=none actor_rollout_ref.ref.strategy=none \
    actor_rollout_ref.actor.router_replay.mode=R3 actor_rollout_ref.rollout.free_cache_engine=true \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.3
  # Partial rollouts: weights loaded between two engine steps, the KV kept or recomputed; on a GPU vLLM schedules
  # asynchronously (recompute) and synchronously (keep), which a CPU never does.
  step vllm_in_flight 90 "$PY" benchmarks/in_flight.py --engines vllm --dtype bfloat16 --repeats 1
else
  row vllm_colocated skipped 0 "vllm is not installed for $PY (pip install 'conveyor[vllm]' there to run it)"
fi

row total "" $(( $(date +%s) - START )) "logs and run metrics: $OUT/logs.tgz"
tar -czf "$OUT/logs.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.distcp' --exclude='*.bin' \
  -C "$LOG/.." logs runs 2>/dev/null
grep -q '| FAIL' "$SUMMARY" && exit 1
exit 0
