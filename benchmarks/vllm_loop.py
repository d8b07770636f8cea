"""vLLM generation: conveyor's engine-step loop against vLLM's own `LLM.generate`, same requests, same tokens.

`VLLMEngine.generate` drives vLLM one engine step at a time (`LLMEngine.step`), which partial rollouts need to load
weights between two steps, and uses that one loop for every call. This times it against `LLM.generate` given the
very same requests (each row's `SamplingParams` and seed as the engine builds them, and the same continuation of a
row that stopped where the engine does not stop), alternating which goes first,
with the prefix cache emptied before each call and new prompts for every pair; every pair must sample the same
tokens. The model is `benchmarks/in_flight.py`'s dense Qwen3 from config (no EOS: every row runs the full length).

    python benchmarks/vllm_loop.py                                   # 16 x (256 + 64) tokens, 5 pairs
    python benchmarks/vllm_loop.py --batch 4 --prompt-tokens 32 --new-tokens 4 --repeats 1   # seconds
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from conveyor.models import build_char_tokenizer, build_tiny_model
from conveyor.rollout.base import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from in_flight import MODEL, _prompts, add_size_arguments  # noqa: E402  (a sibling script: the same model and prompts)


def _llm_generate(engine, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, seeds: list[int]) -> list:
    """The rows' tokens from vLLM's `LLM.generate`, each row's requests as the engine builds them: a row that stopped
    at a token the engine does not stop at (the tokenizer's EOS here) continues as a new request, in rounds."""
    from conveyor.rollout.vllm import _Row

    rows = [_Row(ids[i][mask[i].bool()].tolist()) for i in range(ids.shape[0])]
    pending, rounds = list(range(len(rows))), 0
    while pending:
        outputs = engine.llm.generate(
            [{"prompt_token_ids": rows[i].prompt + rows[i].tokens} for i in pending],
            [engine._params(params, seeds[i], rounds, len(rows[i].tokens)) for i in pending],
            use_tqdm=False,
        )
        pending = [i for i, o in zip(pending, outputs) if engine._extend(rows[i], o, params, False, i)]
        rounds += 1
    return [row.tokens for row in rows]


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Time both loops over the same requests; print the medians and their ratio; returns them."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from conveyor.rollout.vllm import VLLMEngine

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer=tokenizer, seed=args.seed, **MODEL).eval()
    model.config.eos_token_id = None
    params = SamplingParams(max_new_tokens=args.new_tokens, do_sample=True)
    times: dict[str, list[float]] = {"steps": [], "llm_generate": []}
    with tempfile.TemporaryDirectory(prefix="conveyor-vllm-loop-") as path:
        model.save_pretrained(path)
        engine = VLLMEngine(
            path,
            hf_config=model.config,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=len(tokenizer) + 1,
            dtype="float32",
            max_model_len=args.prompt_tokens + args.new_tokens,
            max_num_seqs=args.batch,
            seed=args.seed,
            colocated=False,
        )
        try:
            engine.update_weights(iter(model.state_dict().items()), version=0)
            for pair in range(args.repeats + 1):  # the first pair warms up and is dropped
                ids, mask = _prompts(tokenizer, args.batch, args.prompt_tokens, args.seed + 1 + pair)
                seeds = torch.randint(0, 2**31 - 1, (args.batch,), generator=torch.Generator().manual_seed(pair))
                got: dict[str, list] = {}
                for name in ("steps", "llm_generate") if pair % 2 == 0 else ("llm_generate", "steps"):
                    engine.llm.reset_prefix_cache()  # neither call may read the other's prompts' KV
                    t0 = time.perf_counter()
                    if name == "steps":
                        # The engine draws each row's seed from the generator as `seeds` was drawn.
                        out = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(pair))
                        got[name] = [row[m].tolist() for row, m in zip(out["responses"], out["response_mask"].bool())]
                    else:
                        got[name] = _llm_generate(engine, ids, mask, params, seeds.tolist())
                    times[name].append(time.perf_counter() - t0)
                assert got["steps"] == got["llm_generate"], f"pair {pair}: the two loops sampled different tokens"
        finally:
            engine.close()
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}
    print(
        f"vLLM CPU, {args.batch} rows x ({args.prompt_tokens} + {args.new_tokens}) tokens, {args.threads} thread(s), "
        f"median of {args.repeats} alternating pairs, same tokens in every pair"
    )
    for name, seconds in medians.items():
        print(f"{name:<14}{seconds:8.3f} s   {[round(t, 3) for t in times[name][1:]]}")
    ratio = medians["steps"] / medians["llm_generate"]
    print(f"FIGURE vllm_loop steps/llm_generate={ratio:.2f}")
    return {**medians, "ratio": ratio}


if __name__ == "__main__":
    main()
