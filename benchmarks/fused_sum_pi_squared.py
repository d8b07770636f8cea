"""The old-log-prob forward's LM head when it also writes Σπ²: fused against the logits, peak memory and speed.

An optimal-token-baseline run's old-log-prob forward computes, per response
token, the log-prob, the entropy and Σ_v π_v² of the temperature-scaled
distribution. The logits path (`use_fused_kernels=false`) makes the
(tokens, vocabulary) logits with the LM head, then reduces them
(`logprobs_and_entropy`, `sum_pi_squared_from_logits`); the fused head
(`fused_linear_logprobs(..., with_sum_pi_squared=True)`) computes all three
a block at a time and never holds them. Each way runs, without gradient, in
its own child process (one torch thread) on the same random hidden states and
head weight; after one warm-up forward, reported: the resident set's peak
during the next forward above what the process held before it (VmHWM, reset
through /proc/self/clear_refs), the median seconds of `--reps` forwards, and
the largest relative difference of the two ways' Σπ² (the fused one should
equal the logits path's within float32 rounding). Memory and time do not
depend on the weights' values; the correctness of Σπ² on peaked and masked
distributions is tested in tests/algos/test_fused_logprob.py.

    python benchmarks/fused_sum_pi_squared.py                 # 2048 tokens x the 151,936 vocabulary
    python benchmarks/fused_sum_pi_squared.py --smoke         # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MB = 1 << 20


def _status_kb(field: str) -> int:
    from conveyor.workers.ranks.perf import status_kb

    kb = status_kb(field)
    if kb is None:
        raise RuntimeError(f"/proc/self/status has no {field}: these measurements need Linux")
    return kb


def child(way: str, tokens: int, vocab: int, hidden: int, reps: int, out: str | None) -> dict:
    """One way's measurement in this process: peak bytes added by one forward, median seconds, and its Σπ²."""
    import torch
    import torch.nn.functional as F

    from conveyor.algos.fused_logprob import fused_linear_logprobs
    from conveyor.algos.logprob import logprobs_and_entropy, sum_pi_squared_from_logits

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * 0.05
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    temperature = 0.7

    def fused() -> torch.Tensor:
        *_, spp = fused_linear_logprobs(h, w, y, with_entropy=True, with_sum_pi_squared=True, temperature=temperature)
        return spp

    def logits() -> torch.Tensor:
        z = F.linear(h, w)[None]
        logprobs_and_entropy(z, y[None], True, temperature=temperature)
        return sum_pi_squared_from_logits(z, temperature=temperature)[0]

    fn = fused if way == "fused" else logits
    times, peak, spp = [], 0, None
    with torch.no_grad():
        # The first forward warms up (one-time buffers of the math libraries); the second's peak is read.
        for rep in range(reps + 1):
            if rep == 1:
                Path("/proc/self/clear_refs").write_text("5")
                before = _status_kb("VmRSS") * 1024
            start = time.perf_counter()
            spp = fn()
            if rep == 1:
                peak = _status_kb("VmHWM") * 1024 - before
            if rep:
                times.append(time.perf_counter() - start)
    assert spp is not None
    if out is not None:
        torch.save(spp, out)
    return {"way": way, "added": peak, "seconds": statistics.median(times)}


def run(tokens: int, vocab: int, hidden: int, reps: int, folder: Path) -> dict:
    """Both ways, each in a fresh child process; their peaks, times, ratios and Σπ² difference."""
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = {}
    for way in ("logits", "fused"):
        out = folder / f"{way}.pt"
        args = [way, str(tokens), str(vocab), str(hidden), str(reps), str(out)]
        done = subprocess.run(
            [sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"child {way} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        res[way] = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    fused, logits = torch.load(folder / "fused.pt"), torch.load(folder / "logits.pt")
    diff = ((fused - logits).abs() / logits).max().item()
    return {
        "mean_spp": logits.mean().item(),
        "tokens": tokens,
        "vocab": vocab,
        "hidden": hidden,
        "logits_added_mb": res["logits"]["added"] / MB,
        "fused_added_mb": res["fused"]["added"] / MB,
        "peak_ratio": res["logits"]["added"] / max(res["fused"]["added"], 1),
        "logits_s": res["logits"]["seconds"],
        "fused_s": res["fused"]["seconds"],
        "speed_ratio": res["logits"]["seconds"] / res["fused"]["seconds"],
        "max_rel_diff": diff,
    }


def main(argv: list[str] | None = None) -> int:
    """Print the table of one run (or, with --child, one way's JSON measurement)."""
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a small vocabulary and few tokens: seconds")
    p.add_argument("--tokens", type=int, default=2048, help="response tokens in the forward")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3's by default)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the LM head's input")
    p.add_argument("--reps", type=int, default=3, help="timed forwards per way (after one warm-up), at least 1")
    p.add_argument("--child", nargs=6, metavar="ARG", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        way, tokens, vocab, hidden, reps, out = ns.child
        print(json.dumps(child(way, int(tokens), int(vocab), int(hidden), int(reps), out)))
        return 0
    if ns.reps < 1:
        p.error(f"--reps must be at least 1, got {ns.reps}")
    tokens, vocab, hidden = (64, 4096, 32) if ns.smoke else (ns.tokens, ns.vocab, ns.hidden)
    with tempfile.TemporaryDirectory() as tmp:
        r = run(tokens, vocab, hidden, ns.reps, Path(tmp))
    print(f"old-log-prob head with Σπ², {r['tokens']} tokens x {r['vocab']} vocabulary, hidden {r['hidden']}")
    print("| way | peak added (MB) | seconds (median) |")
    print("|---|---|---|")
    print(f"| logits | {r['logits_added_mb']:.0f} | {r['logits_s']:.3f} |")
    print(f"| fused | {r['fused_added_mb']:.0f} | {r['fused_s']:.3f} |")
    print(f"peak ratio (logits / fused): {r['peak_ratio']:.2f}x")
    print(f"speed ratio (logits s / fused s): {r['speed_ratio']:.2f}x")
    print(f"Σπ² max |fused - logits| / logits: {r['max_rel_diff']:.2e} (mean Σπ² {r['mean_spp']:.3g})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
