"""benchmarks/gateway.py on two sessions: the gateway's rollout samples the built-in loop's tokens, and the table's
figures are there."""

from __future__ import annotations

from benchmark_scripts import load_script


def test_the_gateway_benchmark_measures_both_loops_on_the_same_tokens(capsys):
    bench = load_script("gateway")
    r = bench.measure(2, 1, "callable", max_new_tokens=12)  # asserts inside that both sampled the same tokens
    assert r["sessions"] == 2 and r["builtin_s"] > 0 and r["gateway_s"] > 0 and r["calls"] >= 2
    assert 0 < r["engine_s"] <= r["gateway_s"] and r["ratio"] == r["gateway_s"] / r["builtin_s"]
    assert r["server_cpu_ms_per_call"] > 0 and r["agents_cpu_ms_per_call"] >= 0  # where the CPU went
    assert bench.main(["--sessions", "1", "--rounds", "1", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "sessions" in out and "ms/call" in out and "server ms" in out
