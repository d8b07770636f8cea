"""Smoke test of benchmarks/in_flight.py: both engines load weights mid-generation under both KV policies.

Its 16 prompts of 270 tokens overrun vLLM's 4096-token step budget in the middle of a prompt: a seeded batch that
once failed on the CPU build (a prompt split over two steps has its generator rewound, which a CPU generator
cannot do), so this also runs what the engine's whole-prompt scheduling on a CPU fixed.
"""

from __future__ import annotations

import torch
from benchmark_scripts import load_script


def test_in_flight_benchmark_times_each_kv_policy_on_both_engines(capsys) -> None:
    bench = load_script("in_flight")
    results = bench.main(["--batch", "16", "--prompt-tokens", "270", "--new-tokens", "4", "--repeats", "1"])
    assert set(results) == {"hf", "vllm"}
    for rows in results.values():
        assert set(rows) == {"none", "keep", "recompute"}
        assert all(seconds > 0 for seconds, _ in rows.values())
        assert rows["none"][1] == 0 and rows["keep"][1] > 0 and rows["recompute"][1] > 0  # a load, timed apart
    assert not torch.distributed.is_initialized()  # the benchmark closed its engine
    out = capsys.readouterr().out
    assert "16 rows x (270 prompt + 4 new) tokens, a load after 2" in out
    assert out.splitlines()[-1].startswith("FIGURE: hf keep ") and "vllm keep" in out.splitlines()[-1]
