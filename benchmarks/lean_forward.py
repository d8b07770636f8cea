"""Time conveyor's lean forward against the Hugging Face forward on a GRPO batch, and print the ratios.

The batch is what a GRPO step hands the model: `--prompts` arithmetic prompts
(left-padded, as the trainer pads them), each repeated `--n` times, and
responses of mixed lengths 1 to `--response-len` (right-padded). Two jobs are
timed on the same tiny model (float32, train mode for the first, eval for the
second):

- train: the forward over prompt + response and the backward of the summed
  response log-probs, as the actor's update does (`LeanForward.response_logits`
  against `model(...)` with the trainer's attention mask and positions);
- rollout: `HFEngine.generate` of `--response-len` new tokens from the same
  prompts (an EOS id outside the vocabulary, so every row runs the full
  length), with and without a `LeanForward`.

Repetitions alternate between the contenders and medians are reported. The
token counts printed are the positions each forward computes: prompt and
response for every row (Hugging Face) against each distinct prompt once plus
the fed response tokens (lean). Use `--threads 1` on a shared machine.

This script does not write files or install anything.

    python benchmarks/lean_forward.py --threads 1
    python benchmarks/lean_forward.py --prompts 4 --n 2 --repeats 2      # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from conveyor.models import build_char_tokenizer, build_tiny_model
from conveyor.models.lean import LeanForward
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFEngine


def make_batch(tokenizer, prompts: int, n: int, response_len: int, seed: int) -> dict[str, torch.Tensor]:
    """`prompts` x `n` rows: left-padded prompts repeated n times and random right-padded responses."""
    gen = torch.Generator().manual_seed(seed)
    nums = torch.randint(0, 100, (prompts, 2), generator=gen).tolist()
    enc = tokenizer([f"{a}+{b}=" for a, b in nums], padding=True, return_tensors="pt")
    ids = enc["input_ids"].repeat_interleave(n, 0)
    mask = enc["attention_mask"].bool().repeat_interleave(n, 0)
    rows = prompts * n
    responses = torch.randint(4, len(tokenizer), (rows, response_len), generator=gen)
    lengths = torch.randint(1, response_len + 1, (rows,), generator=gen)
    rmask = torch.arange(response_len)[None] < lengths[:, None]
    return {
        "prompts": ids,
        "prompt_mask": mask,
        "responses": responses.masked_fill(~rmask, tokenizer.pad_token_id),
        "response_mask": rmask,
    }


def hf_logits(model, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """Response logits (B, R, V) from the Hugging Face forward, as the trainer calls it."""
    ids = torch.cat([b["prompts"], b["responses"]], dim=1)
    att = torch.cat([b["prompt_mask"], b["response_mask"]], dim=1).long()
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False, logits_to_keep=b["responses"].shape[1] + 1
    )
    return out.logits[:, :-1]


def backward_of(logits: torch.Tensor, b: dict[str, torch.Tensor]) -> None:
    """Backward of the summed log-probs of the response tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, b["responses"][..., None])[..., 0]
    (logp * b["response_mask"]).sum().backward()


def median_ms(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median wall milliseconds of each function, run alternately `repeats` times after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Parse arguments, time both jobs with both forwards, print the figures; returns them."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "qwen3"])
    parser.add_argument("--prompts", type=int, default=32, help="distinct prompts (data.train_batch_size)")
    parser.add_argument("--n", type=int, default=8, help="rows per prompt (actor_rollout_ref.rollout.n)")
    parser.add_argument("--response-len", type=int, default=6, help="longest response (data.max_response_length)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(args.arch, tokenizer, seed=args.seed)
    lean = LeanForward(model)
    b = make_batch(tokenizer, args.prompts, args.n, args.response_len, args.seed)
    rows, plen = b["prompts"].shape
    hf_tokens = rows * (plen + args.response_len)
    lean_tokens = int(b["prompt_mask"][:: args.n].sum()) + int(b["response_mask"][:, 1:].sum())

    def train_hf() -> None:
        model.zero_grad(set_to_none=True)
        backward_of(hf_logits(model, b), b)

    def train_lean() -> None:
        model.zero_grad(set_to_none=True)
        logits, _ = lean.response_logits(b["prompts"], b["prompt_mask"], b["responses"], b["response_mask"])
        backward_of(logits, b)

    never_eos = len(tokenizer) + 1
    engines = {
        "hf": HFEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=never_eos),
        "lean": HFEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=never_eos, lean=lean),
    }
    gen = torch.Generator().manual_seed(args.seed)

    def rollout(engine: HFEngine) -> Callable[[], None]:
        def run() -> None:
            out = engine.generate(
                b["prompts"], b["prompt_mask"].long(), SamplingParams(max_new_tokens=args.response_len), generator=gen
            )
            assert out["responses"].shape == (rows, args.response_len)

        return run

    model.train()
    train = median_ms({"hf": train_hf, "lean": train_lean}, args.repeats)
    model.eval()
    roll = median_ms({"hf": rollout(engines["hf"]), "lean": rollout(engines["lean"])}, args.repeats)

    print(
        f"arch={args.arch} rows={rows} ({args.prompts} prompts x {args.n}) prompt_len={plen} "
        f"response_len<={args.response_len} threads={torch.get_num_threads()} repeats={args.repeats}"
    )
    print(
        f"positions per training forward: Hugging Face {hf_tokens}, lean {lean_tokens} "
        f"({hf_tokens / lean_tokens:.2f}x fewer)"
    )
    print(f"{'job':28s} {'Hugging Face ms':>16s} {'lean ms':>10s} {'ratio':>7s}")
    print(
        f"{'train: forward + backward':28s} {train['hf']:16.1f} {train['lean']:10.1f} "
        f"{train['hf'] / train['lean']:6.2f}x"
    )
    print(f"{'rollout: generate':28s} {roll['hf']:16.1f} {roll['lean']:10.1f} {roll['hf'] / roll['lean']:6.2f}x")
    return {
        "train_hf_ms": train["hf"],
        "train_lean_ms": train["lean"],
        "rollout_hf_ms": roll["hf"],
        "rollout_lean_ms": roll["lean"],
        "hf_tokens": float(hf_tokens),
        "lean_tokens": float(lean_tokens),
    }


if __name__ == "__main__":
    main()
