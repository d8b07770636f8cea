"""What a weight load in the middle of a generation costs, per `rollout.in_flight_kv`, on the hf and vLLM engines.

A partial rollout loads new weights between two sampling steps and the requests in flight go on: over a KV cache
the new weights recompute (`recompute`: one prefill of each request's prompt and tokens so far) or over the one the
old weights computed (`keep`). For each engine, the same left-padded prompts are sampled three ways, each one
engine step at a time with an `interrupt` hook between steps (what partial rollouts run):

  none       the hook never loads anything: the generation's own cost
  keep       halfway (once every row has sampled half its tokens) the hook loads a perturbed copy of the weights,
             and the requests keep their KV
  recompute  the same load, and the requests' KV is recomputed under the new weights

The load's own seconds (`update_weights`) are timed inside the hook and taken out, so `extra s` is what the KV
policy costs beyond the generation: for `keep` about nothing, for `recompute` the prefill of every row's prompt and
half its response. Repetitions alternate between the modes, every call with new prompts (nothing for vLLM's prefix
cache to reuse); medians are printed. The model is a dense Qwen3 built
from config (the character tokenizer, no EOS: every row runs the full length).

    python benchmarks/in_flight.py                                      # hf and vllm, 16 x (256 + 64) tokens
    python benchmarks/in_flight.py --engines hf --prompt-tokens 32 --new-tokens 4 --repeats 1   # seconds
    python benchmarks/in_flight.py --engines vllm --dtype bfloat16   # on a GPU (benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from conveyor.models import build_char_tokenizer, build_tiny_model
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFEngine

MODES = ("none", "keep", "recompute")
ENGINES = ("hf", "vllm")
#: The model: a dense Qwen3 with 64-wide heads (vLLM's CPU attention needs 32 or more).
MODEL = dict(arch="qwen3", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768)


def _prompts(tokenizer, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` prompts of `length` random characters (no padding: all the same length)."""
    gen = torch.Generator().manual_seed(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789+-*= "
    texts = [
        "".join(alphabet[i] for i in torch.randint(0, len(alphabet), (length,), generator=gen)) for _ in range(batch)
    ]
    enc = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _hook(engine, states: list[dict], half: int, loads: list[float]) -> Callable:
    """An interrupt that loads the next of `states` once every row has sampled `half` tokens (once per call)."""
    done = []

    def interrupt(sampled) -> bool:
        counts = [sampled] if isinstance(sampled, int) else sampled
        if done or min(counts) < half:
            return False
        done.append(True)
        state = states.pop(0)
        states.append(state)
        t0 = time.perf_counter()
        engine.update_weights(iter(state.items()), version=len(loads))
        loads.append(time.perf_counter() - t0)
        return True

    return interrupt


def bench_engine(name: str, engine, tokenizer, args, states: list[dict]) -> dict[str, tuple[float, float]]:
    """Per mode: (median seconds of the generation without the load, median seconds of the load)."""
    params = SamplingParams(max_new_tokens=args.new_tokens, do_sample=True)
    gen = torch.Generator().manual_seed(args.seed)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    loads: dict[str, list[float]] = {m: [] for m in MODES}
    calls = 0
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for mode in MODES:
            # New prompts every call: vLLM's prefix cache must not serve one call's prompts to the next.
            calls += 1
            ids, mask = _prompts(tokenizer, args.batch, args.prompt_tokens, args.seed + calls)
            engine.in_flight_kv = "recompute" if mode == "none" else mode
            took: list[float] = []
            hook = _hook(engine, states, args.new_tokens // 2, took) if mode != "none" else (lambda sampled: False)
            t0 = time.perf_counter()
            out = engine.generate(ids, mask, params, generator=gen, interrupt=hook)
            seconds = time.perf_counter() - t0 - sum(took)
            assert out["responses"].shape == (ids.shape[0], args.new_tokens) and bool(out["response_mask"].all())
            assert (mode == "none") == (not took), f"{name} {mode}: the load did not happen once"
            times[mode].append(seconds)
            loads[mode].append(sum(took))
    engine.in_flight_kv = "recompute"
    return {m: (statistics.median(times[m][1:]), statistics.median(loads[m][1:])) for m in MODES}


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch's sizes, repetitions, threads and seed (shared with benchmarks/vllm_loop.py)."""
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> dict[str, dict[str, tuple[float, float]]]:
    """Time each engine's generation with no load, a load keeping the KV and one recomputing it; print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    add_size_arguments(parser)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens: at least 2 (the load happens halfway)")
    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer()
    dtype = getattr(torch, args.dtype)
    model = build_tiny_model(tokenizer=tokenizer, seed=args.seed, dtype=dtype, **MODEL).eval()
    model.config.eos_token_id = None
    never_eos = len(tokenizer) + 1
    other = build_tiny_model(tokenizer=tokenizer, seed=args.seed + 1, dtype=dtype, **MODEL).eval()
    # Two weight sets to alternate between, so every load changes every weight.
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in (other, model)]
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    results: dict[str, dict[str, tuple[float, float]]] = {}
    if "hf" in args.engines:
        engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=never_eos)
        results["hf"] = bench_engine("hf", engine, tokenizer, args, states)
    if "vllm" in args.engines:
        from conveyor.rollout.vllm import VLLMEngine

        with tempfile.TemporaryDirectory(prefix="conveyor-in-flight-") as path:
            model.save_pretrained(path)
            t0 = time.perf_counter()
            engine = VLLMEngine(
                path,
                hf_config=model.config,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=never_eos,
                dtype=args.dtype,
                max_model_len=args.prompt_tokens + args.new_tokens,
                max_num_seqs=args.batch,
                seed=args.seed,
                colocated=False,
            )
            print(f"vllm engine start: {time.perf_counter() - t0:.1f} s (not counted)")
            try:
                engine.update_weights(iter(model.state_dict().items()), version=0)
                results["vllm"] = bench_engine("vllm", engine, tokenizer, args, states)
            finally:
                engine.close()
    print(
        f"dense Qwen3 {params_m:.1f}M from config, {args.batch} rows x ({args.prompt_tokens} prompt + "
        f"{args.new_tokens} new) tokens, a load after {args.new_tokens // 2}; {args.threads} thread(s), "
        f"median of {args.repeats}"
    )
    print(f"{'engine':<8}{'mode':<11}{'generation s':>14}{'extra s':>9}{'extra %':>9}{'load s':>8}")
    for name, rows in results.items():
        base = rows["none"][0]
        for mode in MODES:
            seconds, load = rows[mode]
            extra = seconds - base
            print(f"{name:<8}{mode:<11}{seconds:>14.3f}{extra:>9.3f}{100 * extra / base:>8.1f}%{load:>8.3f}")
    # One line for benchmarks/gpu_check.sh's summary: each engine's extra time per KV policy.
    extra = {
        name: {m: rows[m][0] / rows["none"][0] - 1 for m in ("keep", "recompute")} for name, rows in results.items()
    }
    print(
        "FIGURE: " + "; ".join(f"{n} keep {e['keep']:+.1%}, recompute {e['recompute']:+.1%}" for n, e in extra.items())
    )
    return results


if __name__ == "__main__":
    main()
