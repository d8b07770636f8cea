"""Long responses on one rank: the fused LM-head log-prob against the logits path, peak memory, speed, longest fit.

A dense Qwen3 of about 100M float32 parameters with Qwen3's 151,936-token
vocabulary (hidden 512, 6 layers, MLP 1536, tied embeddings as in
Qwen3-0.6B: the embedding is 78M of it) is built from config and saved as a
checkpoint. Each measurement runs in a fresh process (its peak resident set is
its own) that builds the actor through `PolicyWorker` exactly as a run does
(`use_remove_padding=true`, the Hugging Face forward on the packed row, one
sequence of a 64-token prompt and an `L`-token response per update, no
activation checkpointing) and runs `update_actor` on it, with
`actor_rollout_ref.model.use_fused_kernels` on (the fused head) or off (the
logits path: (L, V) logits and their gradient). Three tables:

1. the LM head alone (hidden states in, log-probs and entropy out, forward
   and backward) at `--head-tokens` tokens: seconds per call each way, the
   two modes alternating, median of `--reps`;
2. one update of an `--update-tokens` (4096) token response each way: the
   process's peak resident set (VmHWM) and the part the update added above
   the process before it (model and batch loaded; Adam's state is made by
   the update), and tokens/s (prompt + response tokens / the update's wall
   time);
3. the longest response one rank can update under `--cap-gb` (6 GB) of
   resident memory: lengths double from `--start` until a run goes over the
   cap, then bisect to `--resolution` tokens. The cap is enforced by a thread
   that reads the resident set every 2 ms and ends the process at the first
   sample above it, and by VmHWM checked after the update (a spike between
   samples still counts).

Then Ulysses sequence parallelism (`--part sp`), on two gloo ranks under
fsdp2 (so the parameters and AdamW's state are sharded alike both ways), for
the dense model and a Qwen3-MoE of about 100M parameters with the same
vocabulary (8 experts of width `--moe-intermediate`, top-2), each with the
fused log-prob on and off:

4. one update of an `--sp-tokens` (8192) token response per rank pair: SP=1
   is dp=2 (each rank updates its own sequence of that length), SP=2 splits
   one sequence over the two ranks; the peak resident set per rank (the
   larger of the two), and tokens/s (the update's tokens over its wall time,
   two cores either way);
5. the longest response the pair updates under `--sp-cap-gb` per rank, each
   rank process with its own watchdog (one over the cap ends both): the
   search of table 3 per (model, log-prob, SP).

    python benchmarks/long_context.py            # long: each try is a whole update of up to 16k+ tokens
    python benchmarks/long_context.py --part sp --models dense --fused on   # one slice of tables 4 and 5
    python benchmarks/long_context.py --smoke    # a small vocabulary, seconds (the suite runs it)

Bars: the fused head cuts the 4096-token update's peak resident set (the whole
process) by at least half; SP=2 updates at least 1.8x the response length of
SP=1 under the same per-rank cap. Exit status 1 when one measured is missed
(not checked under --smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GB = 1e9
BAR = 2.0
SP_BAR = 1.8
RANKS = 2  # the sequence-parallel tables' gloo ranks
PROMPT = 64
OVER_CAP = 3  # a child's exit status when its resident set went over the cap


def _status_kb(field: str) -> int:
    from conveyor.workers.ranks.perf import status_kb

    kb = status_kb(field)
    if kb is None:
        raise RuntimeError(f"/proc/self/status has no {field}: these measurements need Linux")
    return kb


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _watch(cap: float) -> None:
    """End this process (status OVER_CAP) at the first resident-set sample above `cap` bytes."""

    def loop() -> None:
        while True:
            if _rss() > cap:
                os._exit(OVER_CAP)
            time.sleep(0.002)

    threading.Thread(target=loop, daemon=True).start()


def _overrides(fused: bool, tokens: int) -> list[str]:
    return [
        "actor_rollout_ref.model.forward_impl=hf",
        "actor_rollout_ref.model.use_remove_padding=true",
        f"actor_rollout_ref.model.use_fused_kernels={str(fused).lower()}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "actor_rollout_ref.rollout.n=1",
        "data.train_batch_size=1",
        f"data.max_response_length={tokens}",
        f"data.max_prompt_length={PROMPT}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "algorithm.rollout_correction.bypass_mode=false",
        "actor_rollout_ref.model.tiny.warmstart_steps=0",
    ]


def _batch(tokens: int, vocab: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(0)
    return {
        "prompts": torch.randint(4, vocab, (1, PROMPT), generator=gen),
        "prompt_mask": torch.ones(1, PROMPT, dtype=torch.bool),
        "responses": torch.randint(4, vocab, (1, tokens), generator=gen),
        "response_mask": torch.ones(1, tokens, dtype=torch.bool),
        "old_log_probs": -torch.rand(1, tokens, generator=gen) * 10,
        "advantages": torch.randn(1, tokens, generator=gen),
    }


def child_update(model_path: str, tokens: int, fused: bool, updates: int, cap_gb: float | None) -> dict:
    """One process's measurement: `updates` updates of one `tokens`-token response; its peaks and last time."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.ranks.actor import PolicyWorker
    from conveyor.workers.ranks.calls import UpdateCall
    from conveyor.workers.ranks.settings import actor_settings

    if cap_gb is not None:
        _watch(cap_gb * GB)
    cfg = load_config(None, _overrides(fused, tokens))
    plane = make_data_plane("memory")
    worker = PolicyWorker(actor_settings(cfg, build_run_plan(cfg, "cpu")), model_path=model_path, data_plane=plane)
    assert worker.forward.fused is fused and worker.forward.packed
    fields = _batch(tokens, worker.model.config.vocab_size)
    call = UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info()
    before = _status_kb("VmRSS") * 1024
    seconds = 0.0
    for step in range(updates):
        meta = plane.kv_batch_put(["s0"], f"p{step}", fields).with_extra_info(**call)
        start = time.perf_counter()
        worker.update_actor(meta)
        seconds = time.perf_counter() - start
        plane.kv_clear(f"p{step}")
    peak = _status_kb("VmHWM") * 1024
    return {
        "tokens": tokens,
        "fused": fused,
        "peak": peak,
        "added": peak - before,
        "seconds": seconds,
        "fits": cap_gb is None or peak <= cap_gb * GB,
    }


def _sp_overrides(fused: bool, tokens: int, sp: int) -> list[str]:
    """A run of RANKS fsdp2 ranks with `sp`-way sequence parallelism (a mini-batch of RANKS sequences)."""
    base = [o for o in _overrides(fused, tokens) if "mini_batch_size=" not in o and "train_batch_size=" not in o]
    return base + [
        f"trainer.num_cpu_workers={RANKS}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={RANKS}",
        f"data.train_batch_size={RANKS}",
        f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}",
    ]


def child_rank(model_path: str, tokens: int, fused: bool, sp: int, cap_gb: float | None, rank: int, port: int) -> dict:
    """One gloo rank of an fsdp2 pair: one update; SP=1 updates this rank's own sequence, SP=2 half of one."""
    from datetime import timedelta

    import torch
    import torch.distributed as tdist
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.protocol import KVBatchMeta
    from conveyor.trainer.plan import build_run_plan
    from conveyor.workers.ranks.actor import PolicyWorker
    from conveyor.workers.ranks.calls import UpdateCall
    from conveyor.workers.ranks.settings import actor_settings

    if cap_gb is not None:
        _watch(cap_gb * GB)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=timedelta(hours=2))
    cfg = load_config(None, _sp_overrides(fused, tokens, sp))
    plane = make_data_plane("memory")
    worker = PolicyWorker(
        actor_settings(cfg, build_run_plan(cfg, "cpu")),
        model_path=model_path,
        data_plane=plane,
        rank=rank,
        world_size=RANKS,
    )
    assert worker.forward.fused is fused and worker.forward.packed
    assert (worker.forward.sp.size if worker.forward.sp is not None else 1) == sp
    fields = _batch(tokens, worker.model.config.vocab_size)
    # SP=1: a sequence per rank (dp=2). SP=2: the group's one sequence, handed to rank 0; rank 1 reads it through
    # the group's exchange of handles, as a rank of a group with fewer sequences than ranks does.
    key = f"s{rank}" if sp == 1 else "s0"
    plane.kv_batch_put([key], "p", fields)
    mine = [key] if sp == 1 or rank == 0 else []
    call = UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info()
    meta = KVBatchMeta(mine, "p", list(fields), [{} for _ in mine], call)
    before = _status_kb("VmRSS") * 1024
    tdist.barrier()
    start = time.perf_counter()
    worker.update_actor(meta)
    seconds = time.perf_counter() - start
    peak = _status_kb("VmHWM") * 1024
    tdist.barrier()
    tdist.destroy_process_group()
    return {
        "tokens": tokens,
        "fused": fused,
        "sp": sp,
        "rank": rank,
        "peak": peak,
        "added": peak - before,
        "seconds": seconds,
        "fits": cap_gb is None or peak <= cap_gb * GB,
    }


def ranks_update(model: str, tokens: int, fused: bool, sp: int, cap_gb: float | None) -> dict | None:
    """One update on RANKS rank processes; the per-rank peak (max) and the update's time, or None over the cap."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cap = "none" if cap_gb is None else str(cap_gb)
    with tempfile.TemporaryDirectory() as tmp:
        procs, outs = [], []
        for rank in range(RANKS):
            out = Path(tmp) / f"rank{rank}"
            outs.append(out)
            args = [model, str(tokens), str(int(fused)), str(sp), cap, str(rank), str(port)]
            with open(f"{out}.out", "w") as so, open(f"{out}.err", "w") as se:
                procs.append(
                    subprocess.Popen([sys.executable, __file__, "--child-rank", *args], stdout=so, stderr=se, env=env)
                )
        over = False
        while True:
            codes = [p.poll() for p in procs]
            if OVER_CAP in codes or any(c not in (None, 0) for c in codes):
                over = OVER_CAP in codes
                for p in procs:  # the other rank would wait for its partner's collectives forever
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                if not over:
                    bad = next(i for i, c in enumerate(codes) if c not in (None, 0))
                    raise RuntimeError(
                        f"rank {bad} failed ({codes[bad]}):\n{Path(f'{outs[bad]}.err').read_text()[-3000:]}"
                    )
                return None
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
        res = []
        for out in outs:
            lines = [line for line in Path(f"{out}.out").read_text().splitlines() if line.startswith("{")]
            res.append(json.loads(lines[-1]))
    peak = max(r["peak"] for r in res)
    return {
        "tokens": tokens,
        "peak": peak,
        "added": max(r["added"] for r in res),
        "seconds": max(r["seconds"] for r in res),
        # Tokens the pair updated: two sequences under dp=2, one split under SP=2.
        "update_tokens": (tokens + PROMPT) * (RANKS // sp),
        "fits": all(r["fits"] for r in res),
    }


def child_head(tokens: int, vocab: int, hidden: int, reps: int) -> dict:
    """The LM head alone, fused and from the logits, alternating: each one's median seconds per forward+backward."""
    import torch
    import torch.nn.functional as F

    from conveyor.algos.fused_logprob import fused_linear_logprobs
    from conveyor.algos.logprob import logprobs_and_entropy

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    g = torch.randn(tokens, generator=gen)

    def fused() -> None:
        lp, ent = fused_linear_logprobs(h, w, y, with_entropy=True)
        (lp * g + ent).sum().backward()

    def plain() -> None:
        lp, ent = logprobs_and_entropy(F.linear(h, w)[None], y[None], True)
        (lp[0] * g + ent[0]).sum().backward()

    times: dict[str, list[float]] = {"fused": [], "logits": []}
    for rep in range(reps + 1):  # the first round warms up
        for name, fn in (("fused", fused), ("logits", plain)) if rep % 2 else (("logits", plain), ("fused", fused)):
            h.grad = w.grad = None
            start = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _child(args: list[str], timeout: float = 3600) -> tuple[int, dict | None]:
    """Run this script as a child with `args`; (exit status, its JSON result or None)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if done.returncode not in (0, OVER_CAP):
        raise RuntimeError(f"child {args} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, (json.loads(lines[-1]) if lines and done.returncode == 0 else None)


def build_model(
    path: Path, vocab: int, hidden: int, layers: int, intermediate: int, arch: str = "qwen3", experts: int = 8
) -> int:
    """Save the dense model (or, with `arch="qwen3_moe"`, `experts` of width `intermediate`, top-2) and the char
    tokenizer at `path`; its parameter count."""
    import transformers

    from conveyor.models.loading import save_pretrained_checkpoint
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer

    transformers.utils.logging.disable_progress_bar()
    tok = build_char_tokenizer()
    heads = max(4, hidden // 64)
    moe = {"num_experts": experts, "top_k": 2} if arch == "qwen3_moe" else {}
    model = build_tiny_model(
        arch,
        tok,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        intermediate_size=intermediate,
        max_position_embeddings=65536,
        tie_word_embeddings=True,
        **moe,
    )
    params = sum(p.numel() for p in model.parameters())
    save_pretrained_checkpoint(model, tok, path)
    return params


def longest(
    model: str, fused: bool, cap_gb: float, start: int, resolution: int, limit: int, sp: int | None = None
) -> tuple[int, list]:
    """The longest response (tokens) whose update stays under the cap: doubling, then bisection; and every try.

    `sp` None: one rank (table 3); 1 or 2: the rank pair of tables 4 and 5, the cap per rank.
    """
    tries = []

    def fits(tokens: int) -> bool:
        if sp is not None:
            res = ranks_update(model, tokens, fused, sp, cap_gb)
            ok = res is not None and res["fits"]
        else:
            status, res = _child(["--child-update", model, str(tokens), str(int(fused)), "1", str(cap_gb)])
            ok = status == 0 and res is not None and res["fits"]
        tries.append((tokens, ok))
        return ok

    good, bad = 0, None
    tokens = start
    while tokens <= limit:
        if not fits(tokens):
            bad = tokens
            break
        good, tokens = tokens, tokens * 2
    if bad is None:
        return good, tries
    while bad - good > resolution:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, tries


def fused_tables(ns: argparse.Namespace, model: str) -> float:
    """Tables 1-3 (one rank: the fused head against the logits); the 4096-token update's peak cut."""
    _, head = _child(["--child-head", str(ns.head_tokens), str(ns.vocab), str(ns.hidden), str(ns.reps)])
    assert head is not None
    print(f"\nLM head + log-prob + entropy, forward and backward, {ns.head_tokens} tokens (median of {ns.reps})")
    print(f"{'logits s':>10}{'fused s':>10}{'fused speed':>13}")
    print(f"{head['logits']:>10.3f}{head['fused']:>10.3f}{head['logits'] / head['fused']:>12.2f}x")

    runs = {}
    for fused in (False, True):
        _, res = _child(["--child-update", model, str(ns.update_tokens), str(int(fused)), "1", "none"])
        assert res is not None
        runs[fused] = res
    total = ns.update_tokens + PROMPT
    print(f"\none update of a {ns.update_tokens}-token response")
    print(f"{'log-prob':<10}{'peak GB':>9}{'added GB':>10}{'tokens/s':>10}")
    for fused, res in runs.items():
        name = "fused" if fused else "logits"
        print(f"{name:<10}{res['peak'] / GB:>9.2f}{res['added'] / GB:>10.2f}{total / res['seconds']:>10.1f}")
    cut = runs[False]["peak"] / runs[True]["peak"]
    print(
        f"peak cut {cut:.2f}x (added: {runs[False]['added'] / runs[True]['added']:.2f}x); "
        f"tokens/s fused / logits {runs[False]['seconds'] / runs[True]['seconds']:.2f}x"
    )

    print(f"\nlongest response one rank updates under {ns.cap_gb} GB resident (to {ns.resolution} tokens)")
    print(f"{'log-prob':<10}{'tokens':>8}  tries (tokens: fits)")
    best = {}
    for fused in (False, True):
        best[fused], tries = longest(model, fused, ns.cap_gb, ns.start, ns.resolution, ns.limit)
        name = "fused" if fused else "logits"
        print(f"{name:<10}{best[fused]:>8}  " + ", ".join(f"{t}: {'y' if ok else 'n'}" for t, ok in tries))
    if best[False]:
        print(f"longest fused / logits: {best[True] / best[False]:.2f}x")
    return cut


def sp_tables(ns: argparse.Namespace, models: dict[str, str]) -> list[float]:
    """Tables 4 and 5 (two gloo ranks: SP=1 against SP=2) per model and log-prob; each longest SP=2 / SP=1."""
    ratios = []
    for name, model in models.items():
        for fused in ns.fused_modes:
            mode = "fused" if fused else "logits"
            print(f"\n{name}, {mode} log-prob, {RANKS} gloo ranks under fsdp2")
            if ns.sp_tokens:
                print(f"one update of a {ns.sp_tokens}-token response")
                print(f"{'SP':<4}{'peak GB/rank':>13}{'added GB':>10}{'update s':>10}{'tokens/s':>10}")
                for sp in (1, RANKS):
                    res = ranks_update(model, ns.sp_tokens, fused, sp, None)
                    assert res is not None
                    print(
                        f"{sp:<4}{res['peak'] / GB:>13.2f}{res['added'] / GB:>10.2f}{res['seconds']:>10.1f}"
                        f"{res['update_tokens'] / res['seconds']:>10.1f}"
                    )
            if ns.sp_cap_gb is None:
                continue
            print(f"longest response under {ns.sp_cap_gb} GB resident per rank (to {ns.sp_resolution} tokens)")
            print(f"{'SP':<4}{'tokens':>8}  tries (tokens: fits)")
            best = {}
            for sp in (1, RANKS):
                best[sp], tries = longest(model, fused, ns.sp_cap_gb, ns.sp_start, ns.sp_resolution, ns.sp_limit, sp=sp)
                print(f"{sp:<4}{best[sp]:>8}  " + ", ".join(f"{t}: {'y' if ok else 'n'}" for t, ok in tries))
            if best[1]:
                ratios.append(best[RANKS] / best[1])
                print(f"longest SP={RANKS} / SP=1: {ratios[-1]:.2f}x")
    return ratios


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and print their tables; 1 when a bar is missed (not under --smoke)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a small vocabulary and short responses: seconds")
    ap.add_argument("--part", choices=("all", "fused", "sp"), default="all", help="tables 1-3, 4-5, or all")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--moe-intermediate", type=int, default=256, help="each expert's width (8 experts, top-2)")
    ap.add_argument("--head-tokens", type=int, default=512)
    ap.add_argument("--update-tokens", type=int, default=4096)
    ap.add_argument("--cap-gb", type=float, default=6.0)
    ap.add_argument("--start", type=int, default=2048)
    ap.add_argument("--resolution", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", default="dense,moe", help="the SP tables' models: dense, moe or both")
    ap.add_argument("--fused", default="on,off", help="the SP tables' log-prob: on (fused), off (logits) or both")
    ap.add_argument("--sp-tokens", type=int, default=8192, help="table 4's response length (0: skip it)")
    ap.add_argument("--sp-cap-gb", type=float, default=3.5, help="table 5's cap per rank (0: skip the table)")
    ap.add_argument("--sp-start", type=int, default=2048, help="table 5: the first length tried (tokens)")
    ap.add_argument(
        "--sp-resolution", type=int, default=512, help="table 5: stop halving the bracket at this many tokens"
    )
    ap.add_argument("--sp-limit", type=int, default=65536, help="table 5: the longest length tried (tokens)")
    ns = ap.parse_args(argv)
    ns.fused_modes = [{"on": True, "off": False}[m] for m in ns.fused.split(",")]
    if ns.smoke:
        ns.vocab, ns.hidden, ns.layers, ns.intermediate, ns.moe_intermediate = 4096, 64, 2, 128, 64
        ns.head_tokens, ns.update_tokens, ns.cap_gb, ns.start, ns.resolution, ns.limit, ns.reps = (
            256,
            256,
            float("inf"),
            128,
            128,
            256,
            1,
        )
        ns.sp_tokens, ns.sp_cap_gb, ns.sp_start, ns.sp_resolution, ns.sp_limit = 128, float("inf"), 128, 128, 128
        ns.models, ns.fused_modes = "dense,moe", [True]
    ns.sp_cap_gb = ns.sp_cap_gb or None
    cut, ratios = None, []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        params = build_model(Path(model), ns.vocab, ns.hidden, ns.layers, ns.intermediate)
        print(
            f"model: qwen3 (dense, tied embeddings) {params / 1e6:.1f}M float32 parameters, vocabulary {ns.vocab}, "
            f"hidden {ns.hidden}, {ns.layers} layers; one rank, 1 thread, packed Hugging Face forward, "
            f"no activation checkpointing; prompt {PROMPT} tokens"
        )
        if ns.part in ("all", "fused"):
            cut = fused_tables(ns, model)
        if ns.part in ("all", "sp"):
            models = {}
            for name in ns.models.split(","):
                if name == "dense":
                    models["dense"] = model
                    continue
                path = str(Path(tmp) / "moe")
                n = build_model(Path(path), ns.vocab, ns.hidden, ns.layers, ns.moe_intermediate, "qwen3_moe")
                print(f"moe: qwen3_moe {n / 1e6:.1f}M float32 parameters, 8 experts of width {ns.moe_intermediate}")
                models[f"moe ({n / 1e6:.0f}M)"] = path
            ratios = sp_tables(ns, models)
    if ns.smoke:
        return 0
    ok = True
    if cut is not None:
        print(f"bar: peak cut >= {BAR}x -> {'met' if cut >= BAR else 'MISSED'}")
        ok = cut >= BAR
    if ratios:
        met = min(ratios) >= SP_BAR
        print(f"bar: longest SP={RANKS} / SP=1 >= {SP_BAR}x in every pair -> {'met' if met else 'MISSED'}")
        ok = ok and met
    return 0 if ok else 1


def _child_main(argv: list[str]) -> int:
    """The entry of a child process: one measurement, printed as a JSON line."""
    if argv[0] == "--child-rank":
        model, tokens, fused, sp, cap, rank, port = argv[1:8]
        cap_gb = None if cap == "none" else float(cap)
        res = child_rank(model, int(tokens), bool(int(fused)), int(sp), cap_gb, int(rank), int(port))
    elif argv[0] == "--child-update":
        model, tokens, fused, updates, cap = argv[1:6]
        res = child_update(model, int(tokens), bool(int(fused)), int(updates), None if cap == "none" else float(cap))
    else:
        tokens, vocab, hidden, reps = (int(a) for a in argv[1:5])
        res = child_head(tokens, vocab, hidden, reps)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("--child-"):
        raise SystemExit(_child_main(sys.argv[1:]))
    raise SystemExit(main())
