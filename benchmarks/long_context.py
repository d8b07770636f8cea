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

    python benchmarks/long_context.py            # long: each try is a whole update of up to 16k+ tokens
    python benchmarks/long_context.py --smoke    # a small vocabulary, seconds (the suite runs it)

Bar: the fused head cuts the 4096-token update's peak resident set (the whole
process) by at least half; exit status 1 when missed (not checked under
--smoke).
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
PROMPT = 64
OVER_CAP = 3  # a child's exit status when its resident set went over the cap


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


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


def build_model(path: Path, vocab: int, hidden: int, layers: int, intermediate: int) -> int:
    """Save the dense model and the char tokenizer at `path`; its parameter count."""
    import transformers

    from conveyor.models.loading import save_pretrained_checkpoint
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer

    transformers.utils.logging.disable_progress_bar()
    tok = build_char_tokenizer()
    heads = max(4, hidden // 64)
    model = build_tiny_model(
        "qwen3",
        tok,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        intermediate_size=intermediate,
        max_position_embeddings=65536,
        tie_word_embeddings=True,
    )
    params = sum(p.numel() for p in model.parameters())
    save_pretrained_checkpoint(model, tok, path)
    return params


def longest(model: str, fused: bool, cap_gb: float, start: int, resolution: int, limit: int) -> tuple[int, list]:
    """The longest response (tokens) whose update stays under the cap: doubling, then bisection; and every try."""
    tries = []

    def fits(tokens: int) -> bool:
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


def main(argv: list[str] | None = None) -> int:
    """Run the three measurements and print their tables; 1 when the bar is missed (not under --smoke)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a small vocabulary and short responses: seconds")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--head-tokens", type=int, default=512)
    ap.add_argument("--update-tokens", type=int, default=4096)
    ap.add_argument("--cap-gb", type=float, default=6.0)
    ap.add_argument("--start", type=int, default=2048)
    ap.add_argument("--resolution", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=3)
    ns = ap.parse_args(argv)
    if ns.smoke:
        ns.vocab, ns.hidden, ns.layers, ns.intermediate = 4096, 64, 2, 128
        ns.head_tokens, ns.update_tokens, ns.cap_gb, ns.start, ns.resolution, ns.limit, ns.reps = (
            256,
            256,
            float("inf"),
            128,
            128,
            256,
            1,
        )
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        params = build_model(Path(model), ns.vocab, ns.hidden, ns.layers, ns.intermediate)
        print(
            f"model: qwen3 (dense, tied embeddings) {params / 1e6:.1f}M float32 parameters, vocabulary {ns.vocab}, "
            f"hidden {ns.hidden}, {ns.layers} layers; one rank, 1 thread, packed Hugging Face forward, "
            f"no activation checkpointing; prompt {PROMPT} tokens"
        )
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
    if ns.smoke:
        return 0
    print(f"bar: peak cut >= {BAR}x -> {'met' if cut >= BAR else 'MISSED'}")
    return 0 if cut >= BAR else 1


def _child_main(argv: list[str]) -> int:
    """The entry of a child process: one measurement, printed as a JSON line."""
    if argv[0] == "--child-update":
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
