"""Reward-model scoring throughput: the reward-model role against the same Hugging Face model called in a loop.

A tiny Qwen3 sequence classifier made larger (by default hidden 256, 4 layers, about 3M parameters) is built from
config with the character tokenizer and saved as a checkpoint. A batch of `--samples` prompt + response pairs of
random lengths (prompts 8-48 tokens, responses 1-`--max-response` tokens) is written to the memory data plane with
a rule reward, as stage 3 leaves it. Then, in one process on one thread:

- role: `RewardModelWorker.compute_rm_score` over the batch (one rank, micro-batches of `--micro-batch` sequences,
  or `--token-budget` tokens), which reads the fields, builds each row's ids, scores, sums and writes back;
- loop: the checkpoint loaded with `AutoModelForSequenceClassification.from_pretrained`, called on one unpadded
  row at a time, the ids already built (what a reward function that wraps a model does).

Each side runs `--repeats` times, alternating; the figure is sequences per second (median, and min-max over the
repeats), and the ratio role / loop of the medians. The two sides' scores are compared (max abs difference), so
a fast wrong answer cannot pass.

`--judge` measures the generative judge the same way: `JudgeWorker.compute_judge_score` (the hf engine, batches
of `--micro-batch` judgements of `--judge-tokens` greedy tokens) against `model.generate` on one prompt at a time,
on a tiny random causal LM (no retries: its judgements are noise, scored as unparsable), in judgements per second.

    python benchmarks/reward_model.py                 # the default size
    python benchmarks/reward_model.py --smoke         # a quick check
    python benchmarks/reward_model.py --judge         # the judge's throughput

`measure(...)` and `measure_judge(...)` return the figures as a dict, for another script to print beside its own
(benchmarks/rewards.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _batch(data_plane, tokenizer, samples: int, max_response: int, seed: int):
    """`samples` rows of random prompt and response ids with a rule reward, in partition "bench"."""
    gen = torch.Generator().manual_seed(seed)
    vocab = range(4, len(tokenizer))  # characters, no special tokens
    lo, hi = vocab.start, vocab.stop
    p_len = torch.randint(8, 49, (samples,), generator=gen)
    r_len = torch.randint(1, max_response + 1, (samples,), generator=gen)
    pw, rw = int(p_len.max()), int(r_len.max())
    prompts = torch.full((samples, pw), tokenizer.pad_token_id, dtype=torch.long)
    responses = torch.full((samples, rw), tokenizer.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(samples, pw, dtype=torch.bool)
    response_mask = torch.zeros(samples, rw, dtype=torch.long)
    rule = torch.zeros(samples, rw)
    for i in range(samples):
        p, r = int(p_len[i]), int(r_len[i])
        prompts[i, pw - p :] = torch.randint(lo, hi, (p,), generator=gen)
        prompt_mask[i, pw - p :] = True
        responses[i, :r] = torch.randint(lo, hi, (r,), generator=gen)
        response_mask[i, :r] = 1
        rule[i, r - 1] = float(i % 2)
    keys = [f"bench/s{i}" for i in range(samples)]
    fields = {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
        "rm_scores": rule,
    }
    meta = data_plane.kv_batch_put(keys=keys, partition_id="bench", fields=fields)
    rows = [prompts[i, pw - int(p_len[i]) :].tolist() + responses[i, : int(r_len[i])].tolist() for i in range(samples)]
    return meta, rows


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(
    *,
    samples: int = 256,
    hidden: int = 256,
    layers: int = 4,
    max_response: int = 96,
    micro_batch: int = 16,
    token_budget: int | None = None,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, float]:
    """Sequences/s of the role and of the loop (median, min, max over `repeats`), their ratio, and the largest
    difference between their scores."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.models.reward_model import build_tiny_reward_model
    from conveyor.models.tokenizer import build_char_tokenizer
    from conveyor.workers.ranks.reward_model import RewardModelWorker, reward_model_settings

    hf_logging.disable_progress_bar()
    tok = build_char_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rm"
        build_tiny_reward_model(
            tok, seed=seed, hidden_size=hidden, num_layers=layers, intermediate_size=2 * hidden
        ).save_pretrained(str(path))
        tok.save_pretrained(str(path))
        overrides = [
            "reward_model.enable=true",
            f"reward_model.model.path={path}",
            f"reward_model.micro_batch_size_per_gpu={micro_batch}",
        ]
        if token_budget is not None:
            overrides += [
                "reward_model.use_dynamic_bsz=true",
                f"reward_model.forward_max_token_len_per_gpu={token_budget}",
            ]
        cfg = load_config(None, overrides)
        dp = make_data_plane("memory")
        worker = RewardModelWorker(reward_model_settings(cfg), policy_tokenizer=tok, data_plane=dp)
        plain = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
        meta, rows = _batch(dp, tok, samples, max_response, seed)

        def role() -> torch.Tensor:
            worker.compute_rm_score(meta)
            return dp.kv_batch_get(keys=meta.keys, partition_id="bench", select_fields=["rm_model_score"])[
                "rm_model_score"
            ]

        def loop() -> torch.Tensor:
            out = []
            with torch.no_grad():
                for ids in rows:
                    out.append(float(plain(input_ids=torch.tensor([ids])).logits[0, 0]))
            return torch.tensor(out)

        role(), loop()  # warm-up: first-call allocations and lazy initialisation on both sides
        rates: dict[str, list[float]] = {"role": [], "loop": []}
        scores: dict[str, torch.Tensor] = {}
        for _ in range(repeats):
            for name, fn in (("role", role), ("loop", loop)):
                t0 = time.perf_counter()
                scores[name] = fn()
                rates[name].append(samples / (time.perf_counter() - t0))
    role_s, loop_s = _spread(rates["role"]), _spread(rates["loop"])
    return {
        **{f"role_seq_per_s_{k}": v for k, v in role_s.items()},
        **{f"loop_seq_per_s_{k}": v for k, v in loop_s.items()},
        "ratio": role_s["median"] / loop_s["median"],
        "max_abs_diff": float((scores["role"] - scores["loop"]).abs().max()),
        "samples": float(samples),
        "parameters": float(sum(p.numel() for p in plain.parameters())),
    }


def measure_judge(
    *, samples: int = 64, hidden: int = 64, layers: int = 2, tokens: int = 16, micro_batch: int = 16, repeats: int = 3
) -> dict[str, float]:
    """Judgements/s of the judge worker and of a `generate` loop (median, min, max over `repeats`), their ratio, and
    the share of judgements whose text differs between the two (greedy on both sides: 0 expected)."""
    from transformers.utils import logging as hf_logging

    from conveyor.config import load_config
    from conveyor.data_plane import make_data_plane
    from conveyor.models.tiny import build_tiny_model
    from conveyor.models.tokenizer import build_char_tokenizer
    from conveyor.tasks.prompts import PromptEncoder
    from conveyor.workers.ranks.judge import JudgeWorker, judge_settings

    hf_logging.disable_progress_bar()
    tok = build_char_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "judge"
        model = build_tiny_model("qwen3", tok, hidden_size=hidden, num_layers=layers, intermediate_size=2 * hidden)
        model.save_pretrained(str(path))
        tok.save_pretrained(str(path))
        cfg = load_config(
            None,
            [
                "reward_model.judge.enable=true",
                f"reward_model.judge.model.path={path}",
                f"reward_model.judge.max_new_tokens={tokens}",
                f"reward_model.judge.micro_batch_size={micro_batch}",
                "reward_model.judge.max_retries=0",
            ],
        )
        dp = make_data_plane("memory")
        worker = JudgeWorker(judge_settings(cfg), policy_tokenizer=tok, data_plane=dp)
        gen = torch.Generator().manual_seed(0)
        records = [
            {"prompt": [{"role": "user", "content": f"{int(a)}+{int(b)}="}], "reward_model": {"ground_truth": "0"}}
            for a, b in torch.randint(0, 100, (samples, 2), generator=gen)
        ]
        for r in records:
            r["data_source"] = "bench"
        fields, _ = PromptEncoder(tok, 64, "error").fields(records, [f"j/p{i}" for i in range(samples)], range(samples))
        responses = torch.randint(4, len(tok), (samples, 8), generator=gen)
        fields.update(
            {"responses": responses, "response_mask": torch.ones(samples, 8), "rm_scores": torch.zeros(samples, 8)}
        )
        meta = dp.kv_batch_put(keys=[f"j/p{i}/s0" for i in range(samples)], partition_id="j", fields=fields)
        texts = tok.batch_decode(responses.tolist(), skip_special_tokens=True)
        prompt_ids = worker.prompt_ids([r["prompt"][0]["content"] for r in records], texts, ["0"] * samples)
        plain = model.eval()

        def role() -> None:
            worker.compute_judge_score(meta)

        def loop() -> list[str]:
            out = []
            with torch.no_grad():
                for ids in prompt_ids:
                    seq = plain.generate(
                        input_ids=torch.tensor([ids]),
                        max_new_tokens=tokens,
                        do_sample=False,
                        pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id,
                    )[0, len(ids) :]
                    out.append(tok.decode(seq, skip_special_tokens=True))
            return out

        role(), loop()
        rates: dict[str, list[float]] = {"role": [], "loop": []}
        for _ in range(repeats):
            for name, fn in (("role", role), ("loop", loop)):
                t0 = time.perf_counter()
                fn()
                rates[name].append(samples / (time.perf_counter() - t0))
        looped = loop()[:4]
        batched = worker.judge(prompt_ids[:4], attempt=0)
    role_s, loop_s = _spread(rates["role"]), _spread(rates["loop"])
    return {
        **{f"role_seq_per_s_{k}": v for k, v in role_s.items()},
        **{f"loop_seq_per_s_{k}": v for k, v in loop_s.items()},
        "ratio": role_s["median"] / loop_s["median"],
        "differ_frac": sum(a != b for a, b in zip(looped, batched)) / len(looped),
        "samples": float(samples),
        "parameters": float(sum(p.numel() for p in model.parameters())),
    }


def report_judge(result: dict[str, float]) -> str:
    """The judge's figures as printed lines."""
    return "\n".join(
        [
            f"judge: {result['parameters'] / 1e6:.2f}M parameters, {int(result['samples'])} judgements",
            "side        judgements/s median   (min - max)",
            f"judge role  {result['role_seq_per_s_median']:10.1f}   ({result['role_seq_per_s_min']:.1f} - "
            f"{result['role_seq_per_s_max']:.1f})",
            f"generate    {result['loop_seq_per_s_median']:10.1f}   ({result['loop_seq_per_s_min']:.1f} - "
            f"{result['loop_seq_per_s_max']:.1f})",
            f"ratio judge role / generate loop: {result['ratio']:.2f}x   "
            f"(texts differing: {result['differ_frac']:.2f})",
        ]
    )


def report(result: dict[str, float]) -> str:
    """The figures as printed lines."""
    return "\n".join(
        [
            f"reward model: {result['parameters'] / 1e6:.1f}M parameters, {int(result['samples'])} sequences",
            "side        seq/s median   (min - max)",
            f"role        {result['role_seq_per_s_median']:10.1f}   ({result['role_seq_per_s_min']:.1f} - "
            f"{result['role_seq_per_s_max']:.1f})",
            f"hf loop     {result['loop_seq_per_s_median']:10.1f}   ({result['loop_seq_per_s_min']:.1f} - "
            f"{result['loop_seq_per_s_max']:.1f})",
            f"ratio role / loop: {result['ratio']:.2f}x   (scores differ by at most {result['max_abs_diff']:.2e})",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Measure and print; 0 when the two sides' scores agree."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-response", type=int, default=96)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=None, help="tokens per forward (use_dynamic_bsz)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="a tiny size, one repeat")
    ap.add_argument("--judge", action="store_true", help="measure the generative judge instead")
    ap.add_argument("--judge-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.judge:
        jsize = (
            dict(samples=8, tokens=4, repeats=1) if args.smoke else dict(tokens=args.judge_tokens, repeats=args.repeats)
        )
        result = measure_judge(**jsize, micro_batch=args.micro_batch)
        print(report_judge(result))
        return 0
    size = dict(samples=args.samples, hidden=args.hidden, layers=args.layers, max_response=args.max_response)
    if args.smoke:
        size = dict(samples=24, hidden=64, layers=2, max_response=16)
    result = measure(
        **size,
        micro_batch=args.micro_batch,
        token_budget=args.token_budget,
        repeats=1 if args.smoke else args.repeats,
    )
    print(report(result))
    return 0 if result["max_abs_diff"] < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
