"""Smoke test of benchmarks/vllm_loop.py: the engine's step loop samples what vLLM's `LLM.generate` samples."""

from __future__ import annotations

import torch
from benchmark_scripts import load_script


def test_the_step_loop_and_llm_generate_sample_the_same_tokens_and_are_both_timed(capsys) -> None:
    bench = load_script("vllm_loop")
    results = bench.main(["--batch", "4", "--prompt-tokens", "32", "--new-tokens", "4", "--repeats", "1"])
    assert results["steps"] > 0 and results["llm_generate"] > 0  # the benchmark asserted equal tokens per pair
    assert results["ratio"] == results["steps"] / results["llm_generate"]
    assert not torch.distributed.is_initialized()  # the benchmark closed its engine
    assert capsys.readouterr().out.splitlines()[-1].startswith("FIGURE vllm_loop steps/llm_generate=")
