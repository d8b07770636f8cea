"""The checks of `benchmarks/gpu_check.sh` that are not a training run, one subcommand each.

    python benchmarks/gpu_steps.py env                        # versions, the device, varlen_attn's signature
    python benchmarks/gpu_steps.py varlen --device cuda       # packed attention against per-sequence SDPA
    python benchmarks/gpu_steps.py fsdp-step --device cuda    # one fsdp2 step: bf16 compute, fused AdamW
    python benchmarks/gpu_steps.py packspeed --device cuda    # packed against padded forward+backward
    python benchmarks/gpu_steps.py fused-logprob --device cuda  # a 16k-token packed update, fused log-prob vs logits
    python benchmarks/gpu_steps.py sp-step --device cuda      # an update through sequence parallelism of size 1
    python benchmarks/gpu_steps.py report RUN_DIR             # a run's per-phase peaks, step time, grad norm
    python benchmarks/gpu_steps.py same-grad-norm RUN_A RUN_B # step 1's gradient norms agree (R3 checkpointing)

Each prints its figures and ends with one line `FIGURE: ...` that the check's
summary table takes; exit status 0 is a pass, 1 a failed bar. Every check runs
on the CPU too (smaller, in float32), which is how the test suite keeps them
working between GPU runs. What a check compares against is always the plain
reference path (per-sequence SDPA in float32, the padded forward), never a
stored number.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import torch


def figure(text: str) -> None:
    """The one line of a check that its summary row shows."""
    print(f"FIGURE: {text}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def cmd_env(args: argparse.Namespace) -> int:
    """Versions of what the run uses and the installed varlen_attn's signature."""
    import transformers

    print(
        "python",
        sys.version.split()[0],
        "torch",
        torch.__version__,
        "cuda",
        torch.version.cuda,
        "transformers",
        transformers.__version__,
    )
    try:
        import tensordict

        print("tensordict", tensordict.__version__)
    except ImportError:
        print("tensordict: not installed")
    try:
        from torch.nn.attention.varlen import varlen_attn

        from conveyor.models.packing import varlen_call

        call = varlen_call()
        print("varlen_attn:", inspect.signature(varlen_attn))
        print(
            "conveyor's call:",
            "per-sequence SDPA (no usable varlen_attn)"
            if call is None
            else f"causal {dict(call.causal)}, enable_gqa passed: {call.takes_gqa}",
        )
    except ImportError:
        print("varlen_attn: not in this torch (packed forwards use per-sequence SDPA)")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        name = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
    else:
        name = "no CUDA device"
    print("device:", name)
    figure(f"torch {torch.__version__}, transformers {transformers.__version__}, {name}")
    return 0


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


def cmd_varlen(args: argparse.Namespace) -> int:
    """conveyor's packed attention (torch's varlen kernel on CUDA in bf16) against per-sequence causal SDPA."""
    import torch.nn.functional as F

    from conveyor.models.packing import packed_attention_forward

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bar = 1e-2 if dtype == torch.bfloat16 else 1e-4
    lengths = [17, 300, 2048, 5] if device.type == "cuda" else [17, 40, 5]
    torch.manual_seed(0)
    worst = 0.0
    for heads, kv_heads, dim in ((16, 8, 64), (16, 8, 128), (8, 8, 128)):
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
        q = torch.randn(1, heads, total, dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype, requires_grad=True)
        module = torch.nn.Module().eval()
        module.num_key_value_groups, module.is_causal = heads // kv_heads, True
        out, _ = packed_attention_forward(module, q, k, v, None, scaling=dim**-0.5, cu_seq_lens_q=cu)
        grad = torch.randn_like(out)
        (out * grad).sum().backward()
        qs, ks, vs = (x.detach().float().requires_grad_() for x in (q, k, v))
        parts = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            kk = ks[:, :, a:b].repeat_interleave(heads // kv_heads, 1)
            vv = vs[:, :, a:b].repeat_interleave(heads // kv_heads, 1)
            parts.append(F.scaled_dot_product_attention(qs[:, :, a:b], kk, vv, is_causal=True, scale=dim**-0.5))
        ref = torch.cat(parts, 2).transpose(1, 2)  # (1, T, H, D), as the packed forward returns
        (ref * grad.float()).sum().backward()
        errors = {
            "out": _rel(out.detach(), ref.detach()),
            "dq": _rel(q.grad, qs.grad),
            "dk": _rel(k.grad, ks.grad),
            "dv": _rel(v.grad, vs.grad),
        }
        worst = max(worst, *errors.values())
        print(
            f"heads {heads}/{kv_heads}, head dim {dim}, {dtype}: "
            + "  ".join(f"{n} rel {e:.2e}" for n, e in errors.items())
        )
    figure(f"worst rel. error {worst:.2e} ({dtype}, bar {bar:g}), sequences {lengths}")
    return 0 if worst < bar else 1


def _qwen3(device: torch.device, dtype: torch.dtype, **sizes: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from conveyor.models.tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("qwen3", **sizes)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device, dtype)


def cmd_fsdp_step(args: argparse.Namespace) -> int:
    """One fsdp2 training step on one rank as the actor takes it: bf16 compute on CUDA, the project's AdamW."""
    from conveyor.workers.training.optim import adamw_implementation
    from conveyor.workers.training.strategy import TrainingStrategy, ensure_process_group

    device = torch.device(args.device)
    ensure_process_group(device)
    big = device.type == "cuda"
    model = _qwen3(
        device,
        torch.float32,
        vocab_size=32000 if big else 512,
        hidden_size=1024 if big else 64,
        num_layers=8 if big else 2,
        num_heads=16 if big else 4,
        num_kv_heads=8 if big else 2,
        intermediate_size=2816 if big else 128,
    )
    strategy = TrainingStrategy("fsdp2", world_size=1, device=device)
    strategy.wrap(model)
    params = [p for p in model.parameters() if p.requires_grad]
    impl = adamw_implementation(params)
    opt = torch.optim.AdamW(params, lr=1e-4, **impl)
    ids = torch.randint(0, model.config.vocab_size, (4, 512 if big else 32), device=device)
    before = [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone() for p in params[:3]]
    times = []
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(
            model(input_ids=ids).logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
        )
        loss.backward()
        norm = float(strategy.clip_grad_norm(params, 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    after = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in params[:3]]
    moved = all(not torch.equal(a, b) for a, b in zip(before, after))
    compute = strategy.param_dtype or torch.float32
    peak = torch.cuda.max_memory_allocated() / 2**30 if big else float("nan")
    ok = (
        moved
        and torch.isfinite(loss).item()
        and norm > 0
        and (not big or (compute == torch.bfloat16 and impl.get("fused", False)))
    )
    print(f"compute {compute}, AdamW {impl}, loss {loss.item():.4f}, grad norm {norm:.4g}, parameters moved {moved}")
    figure(
        f"{compute}, AdamW {'fused' if impl.get('fused') else 'foreach'}, step {min(times):.3f} s, "
        f"peak {peak:.2f} GiB, grad norm {norm:.3g}"
    )
    return 0 if ok else 1


def cmd_packspeed(args: argparse.Namespace) -> int:
    """Packed (varlen) against padded forward+backward of a dense Qwen3 over responses of very different lengths."""
    from conveyor.algos.logprob import logprobs_and_entropy
    from conveyor.models.packing import PackedRows, enable_packing

    device = torch.device(args.device)
    big = device.type == "cuda"
    vocab = 32000 if big else 512
    model = _qwen3(
        device,
        torch.bfloat16 if big else torch.float32,
        vocab_size=vocab,
        hidden_size=1536 if big else 64,
        num_layers=12 if big else 2,
        num_heads=16 if big else 4,
        num_kv_heads=8 if big else 2,
        intermediate_size=4096 if big else 128,
        max_position_embeddings=8192,
    )
    n = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    batch, prompt = 8, 64 if big else 8
    lengths = torch.linspace(64, 4096, batch).long() if big else torch.linspace(4, 48, batch).long()
    width = int(lengths.max())
    span = torch.arange(width)[None] < lengths[:, None]
    responses = torch.randint(1, vocab, (batch, width), generator=gen) * span
    ids = torch.cat([torch.randint(1, vocab, (batch, prompt), generator=gen), responses], 1).to(device)
    attention = torch.cat([torch.ones(batch, prompt, dtype=torch.bool), span], 1).long().to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    span, responses = span.to(device), responses.to(device)
    tokens = int(attention.sum())

    def padded() -> torch.Tensor:
        logits = model(
            input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False, logits_to_keep=width + 1
        ).logits[:, :-1]
        return logprobs_and_entropy(logits, responses, False)[0] * span

    def packed() -> torch.Tensor:
        rows = PackedRows.from_masks(attention, span)
        logits = model(**rows.model_kwargs(ids, positions), use_cache=False, logits_to_keep=rows.predict).logits
        lp = logprobs_and_entropy(logits, responses[rows.rows, rows.cols][None], False)[0]
        return rows.responses(lp[0], width) * span

    def timed(fn) -> tuple[float, float]:
        fn().sum().backward()
        _sync(device)
        if big:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            fn().sum().backward()
        _sync(device)
        return (time.perf_counter() - t0) / args.repeats, torch.cuda.max_memory_allocated() / 2**30 if big else 0.0

    with torch.no_grad():
        want = padded()
    enable_packing(model)
    with torch.no_grad():
        got = packed()
    diff = (got - want).abs()[span]
    t_pad, m_pad = timed(padded)
    t_pack, m_pack = timed(packed)
    print(
        f"model {n / 1e9:.2f}B parameters, {tokens} tokens; log-probs packed vs padded max |diff| "
        f"{diff.max():.4f} mean {diff.mean():.5f}"
    )
    print(f"forward+backward: padded {t_pad:.3f} s {m_pad:.1f} GiB; packed {t_pack:.3f} s {m_pack:.1f} GiB")
    figure(
        f"packed {t_pad / t_pack:.2f}x faster, memory {m_pack:.1f} vs {m_pad:.1f} GiB, {tokens / t_pack:.0f} "
        f"tok/s, max |log-prob diff| {diff.max():.3f}"
    )
    # bf16 log-probs of a random model differ by a few hundredths between the two attention kernels.
    return 0 if float(diff.max()) < (0.25 if big else 1e-3) else 1


def _rows(run_dir: str) -> list[dict]:
    from conveyor.metrics.trackers import read_metrics_jsonl

    path = next(Path(run_dir).rglob("metrics.jsonl"), None)
    if path is None:
        raise SystemExit(f"no metrics.jsonl under {run_dir}")
    return [r for r in read_metrics_jsonl(path) if r.get("step", 0) > 0]


def cmd_report(args: argparse.Namespace) -> int:
    """A run's last step: every phase's peak memory, step time, tokens/s; step 1's gradient norm."""
    rows = _rows(args.run_dir)
    if not rows:
        figure("no training step logged")
        return 1
    last = rows[-1]
    # Each phase's peak is logged by its role: `actor/perf/update_actor/max_memory_gb`, `ref/perf/ref/...`.
    peaks = {k.split("/")[-2]: v for k, v in last.items() if "/perf/" in k and k.endswith("/max_memory_gb")}
    for key in sorted(k for k in last if "max_memory" in k):
        print(f"  {key}: {last[key]:.3f}")
    for key in ("timing_s/step", "timing_s/gen", "perf/throughput", "actor/grad_norm", "critic/score/mean"):
        if key in last:
            print(f"  {key}: step 1 {rows[0].get(key, float('nan')):.6g}, last {last[key]:.6g}")
    peak_text = ", ".join(f"{k} {v:.2f}" for k, v in sorted(peaks.items())) or "no per-phase peaks"
    figure(
        f"{len(rows)} steps, {last.get('timing_s/step', float('nan')):.2f} s/step, peaks GiB: {peak_text}, "
        f"step-1 grad norm {rows[0].get('actor/grad_norm', float('nan')):.4g}"
    )
    return 0


def cmd_same_grad_norm(args: argparse.Namespace) -> int:
    """Step 1's actor gradient norm of two runs agree (the same rollout replayed with and without checkpointing)."""
    norms = [_rows(d)[0]["actor/grad_norm"] for d in (args.run_a, args.run_b)]
    scores = [_rows(d)[0].get("critic/score/mean", float("nan")) for d in (args.run_a, args.run_b)]
    rel = abs(norms[0] - norms[1]) / max(abs(norms[0]), 1e-30)
    print(f"grad norms {norms[0]:.8g} and {norms[1]:.8g} (rel. diff {rel:.2e}); mean scores {scores}")
    figure(f"grad norms {norms[0]:.6g} / {norms[1]:.6g}, rel. diff {rel:.1e}")
    # A zero norm says nothing (all advantages zero): the comparison needs a model whose rewards vary.
    return 0 if norms[0] > 0 and rel < args.tolerance else 1


def cmd_fused_logprob(args: argparse.Namespace) -> int:
    """A 16k-token packed update of a dense Qwen3 with Qwen3's vocabulary: the fused log-prob against the logits."""
    from conveyor.algos.logprob import logprobs_and_entropy
    from conveyor.models.fused_head import fused_lm_head, split_head_output
    from conveyor.models.packing import PackedRows, enable_packing

    device = torch.device(args.device)
    big = device.type == "cuda"
    vocab = 151936 if big else 2048
    seqs, prompt, length = (4, 64, 4096) if big else (4, 8, 64)
    model = _qwen3(
        device,
        torch.bfloat16 if big else torch.float32,
        vocab_size=vocab,
        hidden_size=1024 if big else 64,
        num_layers=8 if big else 2,
        num_heads=16 if big else 4,
        num_kv_heads=8 if big else 2,
        intermediate_size=2816 if big else 128,
        max_position_embeddings=prompt + length + 1,
    )
    enable_packing(model)
    gen = torch.Generator().manual_seed(0)
    responses = torch.randint(1, vocab, (seqs, length), generator=gen).to(device)
    ids = torch.cat([torch.randint(1, vocab, (seqs, prompt), generator=gen).to(device), responses], 1)
    attention = torch.ones_like(ids)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    rows = PackedRows.from_masks(attention, torch.ones_like(responses))
    labels = responses[rows.rows, rows.cols][None]
    weights = torch.randn(labels.shape, generator=gen).to(device)

    def update(fused: bool) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        model.zero_grad(set_to_none=True)
        _sync(device)
        if big:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        kwargs = {**rows.model_kwargs(ids, positions), "use_cache": False, "logits_to_keep": rows.predict}
        if fused:
            with fused_lm_head(model, labels, with_entropy=True, temperature=1.0):
                lp, ent = split_head_output(model(**kwargs).logits, True)
        else:
            lp, ent = logprobs_and_entropy(model(**kwargs).logits, labels, True)
        (lp * weights + 0.01 * ent).sum().backward()
        _sync(device)
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() / 2**30 if big else 0.0
        return lp.detach(), model.lm_head.weight.grad.detach().float().clone(), seconds, peak

    update(True)  # warm-up: kernels, the allocator
    lp_f, grad_f, t_f, m_f = update(True)
    lp_l, grad_l, t_l, m_l = update(False)
    diff = float((lp_f - lp_l).abs().max())
    grad_rel = float((grad_f - grad_l).norm() / grad_l.norm())
    tokens = seqs * (prompt + length)
    print(
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, vocabulary {vocab}, {tokens} packed "
        f"tokens ({seqs} x {prompt} + {length}); fused {t_f:.3f} s {m_f:.2f} GiB, logits {t_l:.3f} s {m_l:.2f} GiB"
    )
    figure(
        f"{tokens}-token packed update: fused peak {m_f:.2f} vs logits {m_l:.2f} GiB, {tokens / t_f:.0f} vs "
        f"{tokens / t_l:.0f} tok/s, max |log-prob diff| {diff:.2e}, head grad rel. diff {grad_rel:.1e}"
    )
    # bf16: the same logits per block, up to the matmul's rounding for another row count.
    ok = diff < (0.05 if big else 1e-5) and grad_rel < (2e-2 if big else 1e-5)
    return 0 if ok and (not big or m_f < m_l) else 1


def cmd_sp_step(args: argparse.Namespace) -> int:
    """One packed update through the sequence-parallel path with a group of one rank (nccl on CUDA) against the
    plain packed path, in float32: the split, the all-to-alls around attention and the gather, nothing divided."""
    import torch.distributed as tdist

    from conveyor.algos.logprob import logprobs_and_entropy
    from conveyor.models.packing import PackedRows, enable_packing
    from conveyor.workers.training.sequence_parallel import SequenceParallel
    from conveyor.workers.training.strategy import ensure_process_group

    device = torch.device(args.device)
    ensure_process_group(device)
    big = device.type == "cuda"
    vocab = 32000 if big else 512
    seqs, prompt, length = (4, 64, 2048) if big else (3, 6, 20)
    model = _qwen3(
        device,
        torch.float32,
        vocab_size=vocab,
        hidden_size=1024 if big else 64,
        num_layers=4 if big else 2,
        num_heads=16 if big else 4,
        num_kv_heads=8 if big else 2,
        intermediate_size=2816 if big else 128,
        max_position_embeddings=prompt + length + 1,
    )
    enable_packing(model)
    gen = torch.Generator().manual_seed(0)
    responses = torch.randint(1, vocab, (seqs, length), generator=gen).to(device)
    ids = torch.cat([torch.randint(1, vocab, (seqs, prompt), generator=gen).to(device), responses], 1)
    attention = torch.ones_like(ids)
    attention[0, : prompt // 2] = 0  # a left-padded prompt: positions and bounds from the mask
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    rows = PackedRows.from_masks(attention, torch.ones_like(responses))
    labels = responses[rows.rows, rows.cols]
    weights = torch.randn(labels.shape, generator=gen).to(device)
    group = SequenceParallel(tdist.group.WORLD, 1, 0)

    def update(sp: bool) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        model.zero_grad(set_to_none=True)
        _sync(device)
        if big:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if sp:
            shard = group.shard(rows)
            kwargs = {**shard.model_kwargs(ids, positions), "use_cache": False, "logits_to_keep": shard.keep}
            lp, ent = logprobs_and_entropy(model(**kwargs).logits, labels[shard.mine][None], True)
            both = shard.gather_predicted(torch.stack([lp[0], ent[0]], -1))
            lp, ent = both[:, 0], both[:, 1]
        else:
            kwargs = {**rows.model_kwargs(ids, positions), "use_cache": False, "logits_to_keep": rows.predict}
            lp, ent = logprobs_and_entropy(model(**kwargs).logits, labels[None], True)
            lp, ent = lp[0], ent[0]
        (lp * weights + 0.01 * ent).sum().backward()
        _sync(device)
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() / 2**30 if big else 0.0
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return lp.detach(), grads, seconds, peak

    update(True)  # warm-up: kernels, the allocator, the communicator
    lp_s, grad_s, t_s, m_s = update(True)
    lp_p, grad_p, t_p, m_p = update(False)
    diff = float((lp_s - lp_p).abs().max())
    grad_rel = float((grad_s - grad_p).norm() / grad_p.norm())
    tokens = int(attention.sum())
    print(
        f"backend {tdist.get_backend()}, {tokens} packed tokens ({seqs} x {prompt} + {length}); "
        f"SP path {t_s:.3f} s {m_s:.2f} GiB, plain {t_p:.3f} s {m_p:.2f} GiB"
    )
    figure(
        f"{tokens}-token update, SP size 1 vs plain: peak {m_s:.2f} vs {m_p:.2f} GiB, {tokens / t_s:.0f} vs "
        f"{tokens / t_p:.0f} tok/s, max |log-prob diff| {diff:.1e}, grad rel. diff {grad_rel:.1e}"
    )
    return 0 if diff < 1e-4 and grad_rel < 1e-4 else 1


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit status is the check's verdict."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env").set_defaults(fn=cmd_env)
    checks = (
        ("varlen", cmd_varlen),
        ("fsdp-step", cmd_fsdp_step),
        ("packspeed", cmd_packspeed),
        ("fused-logprob", cmd_fused_logprob),
        ("sp-step", cmd_sp_step),
    )
    for name, fn in checks:
        p = sub.add_parser(name)
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--repeats", type=int, default=3)
        p.set_defaults(fn=fn)
    p = sub.add_parser("report")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("same-grad-norm")
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.set_defaults(fn=cmd_same_grad_norm)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
