"""Time the rollout engines against `model.generate` at two model sizes, and print tokens/s and ratios.

Engines: `hf` (`HFEngine.generate`, conveyor's decode loop; also timed with
`capture_routing=True`, to show what recording the MoE routing costs),
`generate` (Hugging Face's `model.generate`) and `vllm` (`VLLMEngine`, a vLLM
engine in this process; on a CPU, vLLM's CPU build). All sample (temperature
1, no top-k / top-p) from the same model and the same left-padded prompts for
the same number of new tokens, and no row stops early (the model has no EOS
id, and the engines get one outside the vocabulary). Repetitions alternate
between the engines and medians are reported, so a noisy neighbour hurts all
alike. Tokens/s counts generated tokens (batch x new tokens) per second.

Sizes (Qwen3-MoE built from config, the character tokenizer):
- `tiny`: the default tiny model with 32-wide heads (hidden 64, 2 heads; vLLM's
  CPU attention needs head_dim >= 32), ~0.3M parameters;
- `50m`: hidden 512, 8 layers, 8 heads, 8 experts (intermediate_size 1024), ~57M parameters;
- `0.5b`: dense Qwen3, hidden 1024, 28 layers, 16 heads, MLP 4096, ~0.44B
  parameters (the GPU check's size: `benchmarks/gpu_check.sh`).

Use `--threads 1` on a shared machine. vLLM's start-up (tens of seconds) is
printed apart and not counted. This script writes its model checkpoints to a
temporary folder and removes them; it installs nothing.

    python benchmarks/rollout.py --threads 1                          # tiny and 50m, every engine
    python benchmarks/rollout.py --sizes tiny --engines hf generate   # no vLLM
    python benchmarks/rollout.py --sizes 0.5b --device cuda --dtype bfloat16 --batch 256 --new-tokens 512
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

#: Model sizes: build_tiny_model arguments.
SIZES: dict[str, dict] = {
    "tiny": dict(arch="qwen3_moe", hidden_size=64, num_heads=2, num_kv_heads=2),
    "50m": dict(
        arch="qwen3_moe",
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1024,
        num_experts=8,
        top_k=2,
    ),
    "0.5b": dict(arch="qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=4096),
}
ENGINES = ("hf", "generate", "vllm")


def make_prompts(tokenizer, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` left-padded arithmetic prompts of mixed length: (input_ids, attention_mask), each (B, P)."""
    gen = torch.Generator().manual_seed(seed)
    nums = torch.randint(0, 1000, (batch, 2), generator=gen).tolist()
    texts = [f"{a}+{b}=" for a, b in nums]
    enc = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def time_it(fn: Callable[[], None]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_size(size: str, args: argparse.Namespace) -> dict[str, float]:
    """Median seconds per call of each engine on the model of `size`; prints one line per engine."""
    tokenizer = build_char_tokenizer()
    dtype = getattr(torch, args.dtype)
    model = build_tiny_model(tokenizer=tokenizer, seed=args.seed, dtype=dtype, **SIZES[size]).eval()
    # No EOS anywhere (config, generation config, engines): every row runs the full length in every engine.
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    never_eos = len(tokenizer) + 1
    model.to(args.device)
    params = sum(p.numel() for p in model.parameters())
    ids, mask = make_prompts(tokenizer, args.batch, args.seed)
    ids, mask = ids.to(args.device), mask.to(args.device)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    expected = (args.batch, args.new_tokens)
    calls: dict[str, Callable[[], None]] = {}
    hf = HFEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=never_eos)

    def run_hf(routing: bool) -> Callable[[], None]:
        def call() -> None:
            out = hf.generate(
                ids, mask, SamplingParams(max_new_tokens=args.new_tokens, capture_routing=routing), generator=gen
            )
            assert out["responses"].shape == expected

        return call

    def run_generate() -> None:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=never_eos,
            )
        assert out.shape == (args.batch, ids.shape[1] + args.new_tokens)

    if "hf" in args.engines:
        calls["hf"] = run_hf(False)
        if size != "0.5b":  # dense: nothing to record
            calls["hf + capture_routing"] = run_hf(True)
    if "generate" in args.engines:
        calls["generate"] = run_generate
    tmp = tempfile.TemporaryDirectory(prefix="conveyor-rollout-bench-")
    if "vllm" in args.engines:
        from conveyor.rollout.vllm import VLLMEngine

        model.save_pretrained(tmp.name)
        engine = VLLMEngine(
            tmp.name,
            hf_config=model.config,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=never_eos,
            dtype=args.dtype,
            max_model_len=ids.shape[1] + args.new_tokens,
            max_num_seqs=args.batch,
            seed=args.seed,
            device=args.device,
            free_cache_engine=False,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        print(f"  (vLLM engine started in {engine.start_time_s:.1f} s)", flush=True)

        def run_vllm() -> None:
            out = engine.generate(ids, mask, SamplingParams(max_new_tokens=args.new_tokens), generator=gen)
            assert out["responses"].shape == expected and bool(out["response_mask"].all())

        calls["vllm"] = run_vllm

    for call in calls.values():
        call()  # warm-up: first calls pay for lazy initialisation
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            times[name].append(time_it(call))
    tokens = args.batch * args.new_tokens
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"size={size} ({params / 1e6:.1f}M parameters) batch={args.batch} new_tokens={args.new_tokens} "
        f"prompt_len={ids.shape[1]} device={args.device} dtype={args.dtype} threads={torch.get_num_threads()} "
        f"repeats={args.repeats}"
    )
    for name, med in medians.items():
        print(f"  {name:22s} {med * 1e3:9.1f} ms  {tokens / med:10.0f} tokens/s")
    base = medians.get("hf")
    for name in ("generate", "vllm"):
        if base and name in medians:
            print(f"  tokens/s ratio {name} / hf: {base / medians[name]:.2f}x")
    # One line for benchmarks/gpu_check.sh's summary: each engine's time per decode step (a step = one new token
    # for every row).
    print(
        "FIGURE: "
        + ", ".join(f"{name} {med / args.new_tokens * 1e3:.1f} ms/decode step" for name, med in medians.items())
        + f" ({size}, batch {args.batch}, {args.dtype})"
    )
    if "vllm" in args.engines:
        engine.close()
    tmp.cleanup()
    return medians


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Parse arguments and benchmark each size; the median seconds per engine, by size."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "50m"], choices=list(SIZES))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM's share of GPU memory")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return {size: bench_size(size, args) for size in args.sizes}


if __name__ == "__main__":
    main()
