"""Memory per rank, phase by phase, on 1 and 2 fsdp2 ranks: does it shrink with the ranks?

A Qwen3-MoE of 340M float32 parameters is built from config and saved as
a checkpoint. Then, once with one rank and once with two gloo ranks (fsdp2),
every rank builds the run's model roles in one process as the trainer does
(`ColocatedWorker` over `worker_specs` of the config and its run plan: the
actor, and the reference for the KL loss), and runs a few training steps
through the workers' own endpoints, on a data plane of its own holding its
share of the batch: the rollout (hf, routing captured for R3), the old
log-probs (bypass off, routing replayed), the reference log-probs and the
update (routing replayed). Every endpoint reports its phase's peak resident
memory (`perf/<phase>/max_memory_gb`, `conveyor.workers.ranks.perf`); the table
shows it above the process's baseline (its resident set before any model was
built), for the last step, the highest rank, with the ratio 2 ranks / 1 rank.
Sequences are short, so parameters, gradients and optimizer state dominate,
as they do on a GPU at these settings. Loading is each role's peak while it
is built, above what the process held just before, against the full model's
bytes.

The same accounting (`account`, conveyor.workers.training.memory_budget: the one a
vllm run is checked against at start-up) that predicts the CPU figures
(printed next to them) gives the per-GPU figures of real models on real
hardware, for the hf rollout and for a colocated vLLM engine (its weights at
the engine's dtype over tensor_model_parallel_size GPUs, its KV cache, what the
trainer keeps beside it while it generates), the latter from the settings of
examples/gpu_moe_gsm8k.yaml:

    python benchmarks/memory.py                    # the CPU measurement (~5 min on 2 cores)
    python benchmarks/memory.py --smoke            # a tiny model, seconds (the suite runs it)
    python benchmarks/memory.py --account          # Qwen3-8B and Qwen3-30B-A3B on 8 x 80 GB (no model built)
    python benchmarks/memory.py --lora 16          # one rank: full fine-tuning against LoRA (one model held)
    python benchmarks/memory.py --long 4096 --device cuda   # 4096-token responses on one GPU vs the accounting

Bar (CPU measurement at the default size): every phase at most 0.6x, goal
0.55x; rank 1's loading peak at most 0.6x of the full model's bytes. Exit
status 1 when a bar is missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from conveyor.workers.training.memory_budget import (  # noqa: F401 (layout_of, total: the tests' too)
    GB,
    Layout,
    Setup,
    account,
    engine_terms,
    kv_bytes_per_token,
    layout_of,
    misfits,
    setup_of,
    total,
)

PHASES = ("rollout", "old_log_prob", "ref", "update_actor")
PROMPT_LEN, RESPONSE_LEN, BATCH, MICRO = 16, 8, 16, 4


def cpu_setup(world: int, **changes) -> Setup:
    """The CPU measurement's settings as memory sees them on `world` ranks (`changes` replace fields)."""
    return Setup(
        **{"world": world, "rollout_seqs": BATCH, "seq_len": PROMPT_LEN + RESPONSE_LEN, "micro_seqs": MICRO, **changes}
    )


# --------------------------------------------------------------------------- CPU measurement
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


OVERRIDES = [
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.router_replay.mode=R3",
    "algorithm.rollout_correction.bypass_mode=false",  # an old-log-prob forward of its own, to measure it
    f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}",
    f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={MICRO}",
    f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={MICRO}",
    f"data.max_prompt_length={PROMPT_LEN}",
    f"data.max_response_length={RESPONSE_LEN}",
]


def lora_overrides(rank: int) -> list[str]:
    """LoRA adapters of `rank` on attention and the experts (alpha 2 x rank), as docs/lora.md trains the tiny MoE."""
    return [
        f"actor_rollout_ref.model.lora_rank={rank}",
        f"actor_rollout_ref.model.lora_alpha={2 * rank}",
        "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj,experts]",
    ]


def _rank(rank: int, world: int, port: int, model_path: str, steps: int, out: str, extra: list[str]) -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.models.loading import load_tokenizer
    from conveyor.protocol import KVBatchMeta
    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.placement.group import ColocatedWorker
    from conveyor.workers.placement.roles import worker_specs
    from conveyor.workers.ranks.calls import GenerateCall, LogProbCall, UpdateCall
    from conveyor.workers.ranks.perf import peak_memory_bytes, reset_peak_memory

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if world > 1:
        tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=20))
    cfg = load_config(None, OVERRIDES + [f"trainer.num_cpu_workers={world}"] + extra)
    plan = build_run_plan(cfg, "cpu")
    plane = make_data_plane("memory")
    specs = worker_specs(cfg, plan, model_path, plane, load_tokenizer(model_path), "cpu")
    baseline = _rss()
    host = ColocatedWorker(rank, world)
    loading = {}
    # Under LoRA no reference is built: the actor serves it with its adapters disabled.
    for role in [r for r in ("actor", "ref") if r in specs]:
        before = _rss()
        reset_peak_memory()
        host.add(specs[role])
        loading[role] = peak_memory_bytes() - before
    actor = host.worker("actor")
    ref_log_prob = host.worker("ref").compute_log_prob if "ref" in host.roles else actor.compute_ref_log_prob

    # This rank's share of one global batch of prompts (the trainer's split: contiguous equal shares).
    gen = torch.Generator().manual_seed(0)
    vocab = actor.model.config.vocab_size
    special = {actor.tokenizer.pad_token_id, actor.tokenizer.eos_token_id}
    prompts = torch.randint(0, vocab, (BATCH, PROMPT_LEN), generator=gen)
    for t in special:
        prompts[prompts == t] = (t + 1) % vocab
    share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    keys = [f"s{i}" for i in range(BATCH)][share]
    phases: list[dict[str, float]] = []
    for step in range(steps):
        part = f"step{step}"
        fields = {"prompts": prompts[share], "prompt_mask": torch.ones(len(keys), PROMPT_LEN, dtype=torch.long)}
        meta = plane.kv_batch_put(keys, part, fields)
        meta = KVBatchMeta(keys, part, meta.fields, [{} for _ in keys], {})
        call = GenerateCall(
            max_new_tokens=RESPONSE_LEN,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            do_sample=True,
            seed=step,
            capture_routing=True,
            pad_to_max_new_tokens=True,
        )
        got: dict[str, float] = {}
        got.update(actor.generate_sequences(meta.with_extra_info(**call.to_extra_info())).extra_info)
        lp = LogProbCall(temperature=1.0, calculate_entropy=True).to_extra_info()
        got.update(actor.compute_log_prob(meta.with_extra_info(**lp)).extra_info)
        got.update(ref_log_prob(meta.with_extra_info(**{**lp, "calculate_entropy": False})).extra_info)
        mask = plane.kv_batch_get(keys, part, ["response_mask"])["response_mask"]
        plane.kv_batch_put(keys, part, {"advantages": torch.randn(mask.shape, generator=gen) * mask})
        update = UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info()
        got.update(actor.update_actor(meta.with_extra_info(**update)).extra_info)
        phases.append({p: got[f"perf/{p}/max_memory_gb"] * 1024**3 - baseline for p in PHASES})
    result = {
        "phases": phases[-1],
        "loading": loading,
        "baseline": baseline,
        "shards": sum(
            p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
            for p in actor.model.parameters()
        ),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    host.close()
    if world > 1:
        tdist.barrier()
        tdist.destroy_process_group()


def _run_ranks(world: int, model_path: str, steps: int, extra: list[str] = ()) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(_rank, args=(world, port, model_path, steps, tmp, list(extra)), nprocs=world)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def save_moe(folder: str, hidden: int, layers: int, experts: int, **config) -> tuple[Layout, str]:
    """Build the benchmark's Qwen3-MoE from config (`config`: more of its keys) and save it under `folder`; its
    layout and checkpoint path."""
    import transformers

    from conveyor.models.loading import save_pretrained_checkpoint
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer

    transformers.utils.logging.disable_progress_bar()
    tok = build_char_tokenizer()
    heads = max(4, hidden // 64)
    model = build_tiny_model(
        "qwen3_moe",
        tok,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        intermediate_size=hidden,
        num_experts=experts,
        **config,
    )
    return layout_of(model.config), str(save_pretrained_checkpoint(model, tok, Path(folder) / "model"))


def measure(hidden: int, layers: int, experts: int, steps: int, lora: int = 0) -> dict:
    """Build and save the model, run 1 and 2 ranks (with `lora`: 1 rank in full and with adapters); the layout too."""
    with tempfile.TemporaryDirectory() as tmp:
        lay, path = save_moe(tmp, hidden, layers, experts)
        if lora:
            runs = {"1": _run_ranks(1, path, steps), "lora": _run_ranks(1, path, steps, lora_overrides(lora))}
        else:
            runs = {w: _run_ranks(w, path, steps) for w in (1, 2)}
    return {"layout": dataclasses.asdict(lay), "runs": {str(w): r for w, r in runs.items()}}


def long_responses(device: str, response_len: int, hidden: int, layers: int, experts: int) -> int:
    """Fixed-length responses through one rank's endpoints (old log-probs, reference, update) against `account`.

    No generation: a random model samples its end-of-sequence token early, so the responses are written
    whole (`response_len` tokens, every one real) and the phases see exactly that length. On a GPU the
    peaks are the allocator's (bf16 compute over float32 masters, gradient checkpointing on); on the CPU
    the resident set above the process's before the model was built. Exit status 1 when, on a GPU, a phase's
    peak exceeds its accounted bytes by more than half (the accounting would let a run that cannot fit
    through); on the CPU the resident set carries the allocator's and interpreter's own growth, so no bar.
    """
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.models.loading import load_tokenizer
    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.placement.group import ColocatedWorker
    from conveyor.workers.placement.roles import worker_specs
    from conveyor.workers.ranks.calls import LogProbCall, UpdateCall
    from conveyor.workers.ranks.perf import reset_peak_memory

    dev = torch.device(device)
    with tempfile.TemporaryDirectory() as tmp:
        lay, path = save_moe(tmp, hidden, layers, experts, max_position_embeddings=PROMPT_LEN + response_len)
        tok = load_tokenizer(path)
        cfg = load_config(
            None,
            [
                "actor_rollout_ref.actor.use_kl_loss=true",
                "algorithm.rollout_correction.bypass_mode=false",
                "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                f"trainer.device={device}",
                "actor_rollout_ref.actor.strategy=fsdp2",
                "actor_rollout_ref.ref.strategy=fsdp2",
                f"data.max_prompt_length={PROMPT_LEN}",
                f"data.max_response_length={response_len}",
                "data.train_batch_size=2",
                "actor_rollout_ref.rollout.n=1",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
            ],
        )
        plan = build_run_plan(cfg, dev.type)
        plane = make_data_plane("memory")
        specs = worker_specs(cfg, plan, path, plane, tok, dev.type)
        baseline = 0 if dev.type == "cuda" else _rss()
        had_group = tdist.is_initialized()  # fsdp2 makes a one-rank group; one made here is destroyed below
        host = ColocatedWorker(0, 1)
        for role in ("actor", "ref"):
            host.add(specs[role])
        actor, ref = host.worker("actor"), host.worker("ref")
        batch = 2
        gen = torch.Generator().manual_seed(0)
        low = max(tok.pad_token_id, tok.eos_token_id) + 1  # no pad or end-of-sequence token inside a response
        keys = [f"s{i}" for i in range(batch)]
        fields = {
            "prompts": torch.randint(low, lay.vocab, (batch, PROMPT_LEN), generator=gen),
            "prompt_mask": torch.ones(batch, PROMPT_LEN, dtype=torch.long),
            "responses": torch.randint(low, lay.vocab, (batch, response_len), generator=gen),
            "response_mask": torch.ones(batch, response_len, dtype=torch.bool),
            "rollout_log_probs": torch.zeros(batch, response_len),
            "advantages": torch.randn(batch, response_len, generator=gen),
        }
        meta = plane.kv_batch_put(keys, "long", fields)
        lp = LogProbCall(temperature=1.0, calculate_entropy=True).to_extra_info()
        got: dict[str, float] = {}
        reset_peak_memory(dev)
        got.update(actor.compute_log_prob(meta.with_extra_info(**lp)).extra_info)
        got.update(ref.compute_log_prob(meta.with_extra_info(**{**lp, "calculate_entropy": False})).extra_info)
        got.update(
            actor.update_actor(
                meta.with_extra_info(**UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info())
            ).extra_info
        )
        host.close()
        if tdist.is_initialized() and not had_group:
            tdist.destroy_process_group()
    compute = 2 if dev.type == "cuda" else 4
    acc = account(
        lay,
        Setup(
            world=1,
            rollout_seqs=batch,
            seq_len=PROMPT_LEN + response_len,
            micro_seqs=1,
            compute_bytes=compute,
            kv_bytes=compute,
            checkpointing=True,
        ),
    )
    print(
        f"model: qwen3_moe {lay.params / 1e9:.3f}B float32 parameters on {device}; {batch} responses of "
        f"{response_len} tokens (+ {PROMPT_LEN} prompt), micro-batches of 1, checkpointing, reference + KL loss"
    )
    print(f"{'phase':<14}{'measured GB':>13}{'accounted GB':>14}{'ratio':>8}")
    worst, cells = 0.0, []
    for phase in PHASES[1:]:
        measured = got[f"perf/{phase}/max_memory_gb"] * 1024**3 - baseline
        accounted = total(acc[phase])
        worst = max(worst, measured / accounted)
        cells.append(f"{phase} {measured / GB:.2f}/{accounted / GB:.2f}")
        print(f"{phase:<14}{measured / GB:>13.2f}{accounted / GB:>14.2f}{measured / accounted:>7.2f}x")
    print(
        f"FIGURE: {response_len}-token responses, measured/accounted GB: {', '.join(cells)}; "
        f"worst {worst:.2f}x" + (" (bar <= 1.5x)" if dev.type == "cuda" else "")
    )
    return 0 if worst <= 1.5 or dev.type != "cuda" else 1


def report(res: dict, bars: bool) -> int:
    """Print the phase table and loading; 1 when a bar is missed (only checked when `bars`)."""
    lay = Layout(**res["layout"])
    if "lora" in res["runs"]:
        return report_lora(res, lay)
    one, two = res["runs"]["1"], res["runs"]["2"]
    full = lay.params * 4
    print(
        f"model: qwen3_moe {lay.params / 1e6:.1f}M float32 parameters ({full / GB:.2f} GB), {lay.layers} layers, "
        f"hidden {lay.hidden}; batch {BATCH} x ({PROMPT_LEN} + {RESPONSE_LEN}) tokens, micro-batches of {MICRO}, "
        "reference + KL loss, R3"
    )
    print(f"{'phase':<14}{'1 rank GB':>11}{'2 ranks GB':>12}{'ratio':>8}{'accounted 1':>13}{'accounted 2':>13}")
    worst = 0.0
    acc = {w: account(lay, cpu_setup(w, rollout_seqs=BATCH // w)) for w in (1, 2)}
    for phase in PHASES:
        a = one[0]["phases"][phase]
        b = max(r["phases"][phase] for r in two)
        ratio = b / a
        worst = max(worst, ratio)
        print(
            f"{phase:<14}{a / GB:>11.2f}{b / GB:>12.2f}{ratio:>7.3f}x{total(acc[1][phase]) / GB:>13.2f}"
            f"{total(acc[2][phase]) / GB:>13.2f}"
        )
    load = [r["loading"] for r in two]
    for rank, roles in enumerate(load):
        print(
            f"loading, rank {rank} of 2: "
            + ", ".join(f"{role} {v / GB:.2f} GB ({v / full:.3f}x the model)" for role, v in roles.items())
        )
    rank1 = max(load[1].values()) / full
    print(
        f"worst phase ratio {worst:.3f}x (bar <= 0.6x, goal 0.55x); rank 1's loading peak {rank1:.3f}x the "
        "model (bar <= 0.6x)"
    )
    if not bars:
        return 0
    return 0 if worst <= 0.6 and rank1 <= 0.6 else 1


def report_lora(res: dict, lay: Layout) -> int:
    """Print one rank's phases in full fine-tuning (with its reference) against LoRA (the reference is the base)."""
    full, lora = res["runs"]["1"][0], res["runs"]["lora"][0]
    print(
        f"model: qwen3_moe {lay.params / 1e6:.1f}M float32 parameters ({lay.params * 4 / GB:.2f} GB); one rank, "
        "reference + KL loss, R3; LoRA on attention and experts"
    )
    print(f"{'phase':<14}{'full GB':>9}{'LoRA GB':>9}{'ratio':>8}")
    for phase in PHASES:
        a, b = full["phases"][phase], lora["phases"][phase]
        print(f"{phase:<14}{a / GB:>9.2f}{b / GB:>9.2f}{b / a:>7.3f}x")
    print(
        f"models loaded: full {sorted(full['loading'])}, LoRA {sorted(lora['loading'])}; loading "
        f"{sum(full['loading'].values()) / GB:.2f} GB vs {sum(lora['loading'].values()) / GB:.2f} GB"
    )
    return 0


# --------------------------------------------------------------------------- real models
def _qwen3_8b():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    )


def _qwen3_30b_a3b():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )


REAL_MODELS = {"Qwen3-8B": _qwen3_8b, "Qwen3-30B-A3B": _qwen3_30b_a3b}


def gpu_table(gpus: int, gpu_gb: float, response_len: int, ep: int = 1) -> None:
    """Per-GPU bytes of each phase for examples/gpu_moe_gsm8k.yaml's settings on one node of `gpus` GPUs.

    First with the hf rollout in place of the example's vllm (and AdamW's state on the GPU), then the vllm rows.
    With `ep` > 1 the MoE models split their experts over `ep` ranks (dense models are unchanged; no vllm rows).
    """
    # The recipe: 256 prompts x 8 samples per step, micro-batches of 4, prompts of 512, fp32 masters with bf16
    # compute, a reference for the KL loss (its shards offloaded), gradient checkpointing; the hf
    # rollout decodes at most rollout.max_num_seqs (256) of the rank's sequences at once.
    seqs = min(256, 256 * 8 // gpus)
    for name, make in REAL_MODELS.items():
        lay = layout_of(make())
        if ep > 1 and not lay.layer_expert_params:
            continue
        base = Setup(
            world=gpus,
            master_bytes=4,
            compute_bytes=2,
            kv_bytes=2,
            reference=True,
            ref_offload=True,
            rollout_seqs=seqs,
            seq_len=512 + response_len,
            micro_seqs=4,
            checkpointing=True,
            ep=ep,
        )
        print(
            f"\n{name}: {lay.params / 1e9:.2f}B parameters, {gpus} x {gpu_gb:g} GB, responses of {response_len}"
            + (f", expert_parallel_size={ep}" if ep > 1 else "")
        )
        lean = dataclasses.replace(base, rollout_seqs=32, micro_seqs=1)
        rows = (
            ("recipe", base),
            ("+ rollout.max_num_seqs=32", dataclasses.replace(base, rollout_seqs=32)),
            ("+ micro-batches of 1", lean),
            ("+ optimizer_offload", dataclasses.replace(lean, optimizer_offload=True)),
            ("+ fused log-prob", dataclasses.replace(lean, optimizer_offload=True, fused_logprob=True)),
            (
                f"+ sequence parallel, sp={sp_size(lay, gpus)}",
                dataclasses.replace(lean, optimizer_offload=True, fused_logprob=True, sp=sp_size(lay, gpus)),
            ),
        )
        for label, s in rows:
            acc = account(lay, s)
            cells = "  ".join(f"{p} {total(t) / GB:6.1f}" for p, t in acc.items())
            fits = all(total(t) / GB <= gpu_gb for t in acc.values())
            print(f"  {label:<27} {cells}  {'fits' if fits else 'does not fit'}")
        acc = account(lay, base)
        print(
            "  terms of the recipe's update: " + ", ".join(f"{k} {v / GB:.1f}" for k, v in acc["update_actor"].items())
        )
        if ep == 1:
            vllm_rows(name, lay, gpus, gpu_gb, response_len)


def longest_response(lay: Layout, s: Setup, gpu_gb: float, step: int = 256, limit: int = 1 << 23) -> int:
    """The longest response (a multiple of `step` tokens, prompt of 512 aside) whose trainer phases fit `gpu_gb`.

    The trainer's phases only (old log-probs, reference, update): the rollout is the vLLM engine's, which sleeps
    while they run and is sized on its own (`vllm_rows`).
    """

    def fits(response: int) -> bool:
        acc = account(lay, dataclasses.replace(s, seq_len=512 + response))
        return all(total(t) / GB <= gpu_gb for p, t in acc.items() if p != "rollout")

    if not fits(step):
        return 0
    good, bad = step, None
    while bad is None:
        nxt = good * 2
        if nxt > limit:
            return good
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def sp_size(lay: Layout, gpus: int, most: int = 8) -> int:
    """The largest sequence-parallel size up to `most` that divides the GPUs, the attention and the key/value heads."""
    return max(n for n in range(1, most + 1) if gpus % n == 0 and lay.heads % n == 0 and lay.kv_heads % n == 0)


def longest_table(gpus: int, gpu_gb: float) -> dict[str, dict[str, int]]:
    """Per model, the longest response one micro-batch of one sequence can train with, per step, with and without
    the fused log-prob and sequence parallelism (bf16 compute over fp32 masters, AdamW's state offloaded,
    checkpointing, reference offloaded). SP is the largest size up to 8 the model's heads allow.
    """
    print(
        f"\nlongest response per micro-batch of one sequence, {gpus} x {gpu_gb:g} GB (trainer phases; bf16 compute, "
        "fp32 masters, optimizer_offload, gradient checkpointing, reference offloaded)"
    )
    print(f"  {'model':<16}{'logits path':>13}{'fused log-prob':>16}{'SP':>4}{'SP, logits':>12}{'SP, fused':>11}")
    out = {}
    for name, make in REAL_MODELS.items():
        lay = layout_of(make())
        base = Setup(
            world=gpus,
            master_bytes=4,
            compute_bytes=2,
            kv_bytes=2,
            reference=True,
            ref_offload=True,
            rollout_seqs=1,
            seq_len=512,
            micro_seqs=1,
            checkpointing=True,
            optimizer_offload=True,
        )
        sp = sp_size(lay, gpus)
        row = {
            "logits": longest_response(lay, base, gpu_gb),
            "fused": longest_response(lay, dataclasses.replace(base, fused_logprob=True), gpu_gb),
            "sp": sp,
            "sp_logits": longest_response(lay, dataclasses.replace(base, sp=sp), gpu_gb),
            "sp_fused": longest_response(lay, dataclasses.replace(base, sp=sp, fused_logprob=True), gpu_gb),
        }
        out[name] = row
        print(f"  {name:<16}{row['logits']:>13}{row['fused']:>16}{sp:>4}{row['sp_logits']:>12}{row['sp_fused']:>11}")
    return out


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gpu_moe_gsm8k.yaml"


def example_setup(gpus: int, gpu_gb: float, response_len: int, overrides: list[str] = (), is_moe: bool = True) -> Setup:
    """The `Setup` of examples/gpu_moe_gsm8k.yaml (plus `overrides`) on one node of `gpus` GPUs of `gpu_gb` GB."""
    from conveyor.config import load_config
    from conveyor.trainer.plan import build_run_plan

    cfg = load_config(
        EXAMPLE,
        ["trainer.nnodes=1", f"trainer.n_gpus_per_node={gpus}", f"data.max_response_length={response_len}", *overrides],
    )
    return setup_of(cfg, build_run_plan(cfg, "cuda", is_moe=is_moe), gpu_gb * GB)


def vllm_rows(name: str, lay: Layout, gpus: int, gpu_gb: float, response_len: int) -> None:
    """The vllm rollout's rows: the engine's share (weights, KV cache) beside the trainer, defaults to the example."""
    ro, actor = "actor_rollout_ref.rollout", "actor_rollout_ref.actor.fsdp_config"
    plain = [
        f"{ro}.tensor_model_parallel_size=1",
        f"{ro}.gpu_memory_utilization=0.5",
        f"{actor}.optimizer_offload=false",
    ]
    example = example_setup(gpus, gpu_gb, response_len, is_moe=bool(lay.layer_expert_params))
    eng = example.engine
    rows = (
        ("rollout defaults: tp 1, utilization 0.5", plain),
        ("tensor_model_parallel_size=4", plain[1:] + [f"{ro}.tensor_model_parallel_size=4"]),
        ("+ optimizer_offload=true", [f"{ro}.tensor_model_parallel_size=4", f"{ro}.gpu_memory_utilization=0.5"]),
        (f"the example: tp {eng.tp}, utilization {eng.gpu_memory_utilization:g}", []),
    )
    dtype = "bfloat16" if eng.weight_bytes == 2 else "float32"
    print(
        f"  vllm rollout (examples/gpu_moe_gsm8k.yaml: engine in {dtype},"
        f" sleeping between rollouts; KV cache in sequences of max_model_len={eng.max_model_len}):"
    )
    for label, overrides in rows:
        s = example_setup(gpus, gpu_gb, response_len, overrides, is_moe=bool(lay.layer_expert_params))
        acc = account(lay, s)
        terms = engine_terms(lay, s.engine)
        kv = max(terms["KV cache"], 0.0)
        seqs = int(kv // (kv_bytes_per_token(lay, s.engine) * s.engine.max_model_len))
        state = total({k: v for k, v in acc["rollout"].items() if k not in terms})
        cells = "  ".join(f"{p} {total(t) / GB:6.1f}" for p, t in acc.items())
        found = [m.what for m in misfits(lay, s, gpu_gb * GB, ranks=gpus)]
        found += [f"{p} over {gpu_gb:g} GB" for p, t in acc.items() if p != "rollout" and total(t) / GB > gpu_gb]
        print(
            f"  {label:<41} weights {terms['engine weights'] / GB:5.1f}  KV {kv / GB:5.1f} ({seqs:>4} seqs)  "
            f"trainer {state / GB:5.1f}  {cells}  {'fits' if not found else 'does not fit: ' + '; '.join(found)}"
        )


def main(argv: list[str] | None = None) -> int:
    """Measure on the CPU (or only account for real models with --account); exit 1 when a bar is missed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="training steps per run (the last one is reported)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model: checks the script, not the bars")
    parser.add_argument("--account", action="store_true", help="per-GPU figures of Qwen3-8B and Qwen3-30B-A3B")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-gb", type=float, default=80.0)
    parser.add_argument("--ep", type=int, default=1, help="with --account: expert_parallel_size of the MoE rows")
    parser.add_argument("--response-len", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--json", help="also write the measurement here")
    parser.add_argument(
        "--long",
        type=int,
        metavar="TOKENS",
        default=0,
        help="one rank: fixed-length responses of TOKENS through the endpoints against the accounting",
    )
    parser.add_argument("--device", default="cpu", help="with --long: cpu or cuda")
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="one rank in full fine-tuning against LoRA adapters of this rank (no bars)",
    )
    args = parser.parse_args(argv)
    if args.account:
        for n in args.response_len:
            gpu_table(args.gpus, args.gpu_gb, n, args.ep)
        longest_table(args.gpus, args.gpu_gb)
        return 0
    if args.smoke:
        args.hidden, args.layers, args.experts = 64, 2, 4
    if args.long:
        return long_responses(args.device, args.long, args.hidden, args.layers, args.experts)
    res = measure(args.hidden, args.layers, args.experts, args.steps, args.lora)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return report(res, bars=not args.smoke and args.hidden >= 1024)


if __name__ == "__main__":
    sys.exit(main())
