"""Smoke test of benchmarks/rollout.py: every engine runs on the tiny size and is timed."""

from __future__ import annotations

import torch
from benchmark_scripts import load_script
from transformers import AutoModelForCausalLM

from conveyor.models import build_char_tokenizer
from conveyor.models.tiny import tiny_config


def test_rollout_benchmark_times_every_engine(capsys):
    bench = load_script("rollout")
    medians = bench.main(["--sizes", "tiny", "--batch", "4", "--new-tokens", "3", "--repeats", "1", "--threads", "1"])
    assert set(medians["tiny"]) == {"hf", "hf + capture_routing", "generate", "vllm"}
    assert all(t > 0 for t in medians["tiny"].values())
    assert not torch.distributed.is_initialized()  # the benchmark closed its engine
    out = capsys.readouterr().out
    assert "tokens/s ratio vllm / hf" in out and "tokens/s ratio generate / hf" in out


def test_the_sizes_are_what_the_docstring_says():
    bench = load_script("rollout")
    assert set(bench.SIZES) == {"tiny", "50m", "0.5b"}
    assert bench.SIZES["tiny"]["hidden_size"] // bench.SIZES["tiny"]["num_heads"] >= 32  # vLLM's CPU attention
    vocab = len(build_char_tokenizer())
    counts = {}
    for size in ("50m", "0.5b"):
        kw = dict(bench.SIZES[size])
        with torch.device("meta"):  # counts parameters without allocating them
            model = AutoModelForCausalLM.from_config(tiny_config(kw.pop("arch"), vocab_size=vocab, **kw))
        counts[size] = sum(p.numel() for p in model.parameters())
    assert 50e6 <= counts["50m"] <= 70e6 and 0.4e9 <= counts["0.5b"] <= 0.6e9, counts
