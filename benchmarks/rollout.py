"""Time `HFRollout.generate` against `model.generate` on the tiny MoE model, and print the ratio.

Both contenders sample (temperature 1, no top-k / top-p) from the same tiny
model, the same left-padded prompts and the same number of new tokens; both
get an EOS id outside the vocabulary, so every row runs the full length and
neither stops early. `HFRollout` also runs with `capture_routing=True`, to
show what recording the MoE routing costs. Repetitions alternate between the
contenders and medians are reported, so a noisy neighbour hurts all alike.
Tokens/s counts generated tokens (batch x new tokens) per second of wall time.
Use `--threads 1` on a shared machine: two threads on two busy cores make
the timings swing by several times.

This script does not write files or install anything.

    python benchmarks/rollout.py                      # batch 64, 16 new tokens, qwen3_moe
    python benchmarks/rollout.py --batch 8 --new-tokens 32 --arch mixtral --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from conveyor.models import TINY_ARCHS, build_char_tokenizer, build_tiny_model
from conveyor.rollout.hf import HFRollout


def make_prompts(tokenizer, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` left-padded arithmetic prompts of mixed length: (input_ids, attention_mask), each (B, P)."""
    gen = torch.Generator().manual_seed(seed)
    nums = torch.randint(0, 1000, (batch, 2), generator=gen).tolist()
    texts = [f"{a}+{b}=" for a, b in nums]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def time_it(fn: Callable[[], None]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    """Parse arguments, run both contenders alternately, print tokens/s and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_moe", choices=TINY_ARCHS)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(args.arch, tokenizer, seed=args.seed).eval()
    input_ids, attention_mask = make_prompts(tokenizer, args.batch, args.seed)
    never_eos = len(tokenizer) + 1  # outside the vocabulary: every row runs the full length
    rollout = HFRollout(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=never_eos)
    gen = torch.Generator().manual_seed(args.seed)

    def ours() -> None:
        """One HFRollout.generate call."""
        out = rollout.generate(
            input_ids, attention_mask, max_new_tokens=args.new_tokens, temperature=1.0, do_sample=True, generator=gen
        )
        assert out["responses"].shape == (args.batch, args.new_tokens)

    def ours_routing() -> None:
        """One HFRollout.generate call that also captures the MoE routing."""
        out = rollout.generate(
            input_ids, attention_mask, max_new_tokens=args.new_tokens, temperature=1.0, do_sample=True,
            generator=gen, capture_routing=True,
        )
        assert out["responses"].shape == (args.batch, args.new_tokens)

    def theirs() -> None:
        """One model.generate call with the same settings."""
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=args.new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=never_eos,
            )
        assert out.shape == (args.batch, input_ids.shape[1] + args.new_tokens)

    ours()
    ours_routing()
    theirs()  # warm-up: first calls pay for lazy initialisation
    t_ours, t_routing, t_theirs = [], [], []
    for _ in range(args.repeats):
        t_ours.append(time_it(ours))
        t_routing.append(time_it(ours_routing))
        t_theirs.append(time_it(theirs))
    tokens = args.batch * args.new_tokens
    med_ours, med_theirs = statistics.median(t_ours), statistics.median(t_theirs)
    med_routing = statistics.median(t_routing)
    print(
        f"arch={args.arch} batch={args.batch} new_tokens={args.new_tokens} "
        f"prompt_len={input_ids.shape[1]} threads={torch.get_num_threads()} repeats={args.repeats}"
    )
    print(f"HFRollout.generate : {med_ours * 1e3:8.1f} ms  {tokens / med_ours:10.0f} tokens/s")
    print(f"  + capture_routing: {med_routing * 1e3:8.1f} ms  {tokens / med_routing:10.0f} tokens/s")
    print(f"model.generate     : {med_theirs * 1e3:8.1f} ms  {tokens / med_theirs:10.0f} tokens/s")
    print(f"speed-up (HFRollout / model.generate tokens/s): {med_theirs / med_ours:.2f}x")


if __name__ == "__main__":
    main()
