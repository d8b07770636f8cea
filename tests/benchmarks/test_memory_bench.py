"""Smoke test: the memory benchmark runs 1 and 2 fsdp2 ranks of a tiny MoE through every phase, and accounts."""

from __future__ import annotations

import re

import pytest
from benchmark_scripts import spawning_script

PHASES = ("rollout", "old_log_prob", "ref", "update_actor")


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    with spawning_script("memory", monkeypatch) as module:
        yield module


def test_memory_benchmark_smoke(bench, capsys: pytest.CaptureFixture[str]) -> None:
    status = bench.main(["--smoke"])
    out = capsys.readouterr().out
    assert status == 0, out[-2000:]
    for phase in PHASES:
        assert re.search(rf"^{phase}\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+x", out, re.M), out
    assert out.count("loading, rank") == 2 and "worst phase ratio" in out


def test_accounting_shrinks_with_the_ranks_and_counts_what_the_settings_move(bench) -> None:
    from conveyor.models.tiny import tiny_config
    from conveyor.models.tokenizer import build_char_tokenizer

    lay = bench.layout_of(tiny_config("qwen3_moe", vocab_size=len(build_char_tokenizer())))
    one, two = (bench.account(lay, bench.cpu_setup(w)) for w in (1, 2))
    for phase in PHASES:
        # The state halves; what two ranks add is only the gathered layers.
        assert two[phase]["actor parameters"] == one[phase]["actor parameters"] / 2
        assert "gathered weights" not in one[phase] or one[phase]["gathered weights"] == 0
    offloaded = bench.account(lay, bench.cpu_setup(2, ref_offload=True, optimizer_offload=True))
    assert "reference parameters" not in offloaded["ref"] and "optimizer state" not in offloaded["old_log_prob"]
    assert bench.total(offloaded["old_log_prob"]) < bench.total(two["old_log_prob"])
    # The meta-device count is the model's own.
    assert lay.params == sum(
        p.numel()
        for p in __import__("transformers")
        .AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", vocab_size=len(build_char_tokenizer())))
        .parameters()
    )


def test_real_model_accounting_prints_both_models(bench, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--account", "--response-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3-8B: 8.19B parameters" in out and "Qwen3-30B-A3B: 30.53B parameters" in out
    moe = out[out.index("Qwen3-30B-A3B: 30.53B") :]
    # The hf rollout's rows are docs/distributed.md's table as it was before the vllm rows came.
    cells = r"rollout\s+{}\s+old_log_prob\s+{}\s+ref\s+{}\s+update_actor\s+{}\s+"
    assert re.search(r"recipe\s+" + cells.format(88.3, 51.7, 51.7, 75.1) + "does not", moe)
    assert re.search(r"\+ optimizer_offload\s+" + cells.format(23.9, 19.6, 19.6, 61.1) + "fits", moe)
    # Sequence parallelism of the largest size Qwen3-30B-A3B's 4 key/value heads allow: the no-grad phases shrink.
    assert re.search(r"\+ sequence parallel, sp=4\s+" + cells.format(23.9, 19.2, 19.2, 61.1) + "fits", moe)
    # The vllm rows: the defaults' weights outgrow the engine's share; the example fits.
    rows = moe[moe.index("vllm rollout") :].splitlines()
    assert re.search(r"rollout defaults.* weights\s+61.1 .*does not fit: the vLLM engine's weights", rows[1]), rows[1]
    assert re.search(r"tensor_model_parallel_size=4 .*trainer\s+45.8 .*rollout\s+85.8 .*does not fit", rows[2])
    assert re.search(r"the example: tp 4, utilization 0.6 .*weights\s+15.3 .*rollout\s+63.3 .*fits$", rows[4]), rows[4]


def test_memory_benchmark_lora_smoke(bench, capsys: pytest.CaptureFixture[str]) -> None:
    # One rank in full fine-tuning (actor + reference loaded) against LoRA (the actor alone: it serves the reference).
    assert bench.main(["--smoke", "--lora", "4"]) == 0
    out = capsys.readouterr().out
    for phase in PHASES:
        assert re.search(rf"^{phase}\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+x", out, re.M), out
    assert "models loaded: full ['actor', 'ref'], LoRA ['actor']" in out


def test_long_responses_run_through_the_endpoints_at_their_full_length(bench, capsys) -> None:
    # The GPU check's 4096-token step, small: every response token is real, so each phase sees the whole length.
    status = bench.main(["--smoke", "--long", "96"])
    out = capsys.readouterr().out
    assert status == 0, out[-2000:]
    assert "2 responses of 96 tokens" in out
    # On the CPU, in this long-lived process, a phase's resident peak can sit below the baseline taken before
    # the model was built (memory freed since): the figures may be negative here; the GPU's are allocator bytes.
    for phase in PHASES[1:]:
        assert re.search(rf"^{phase}\s+-?[0-9.]+\s+[0-9.]+\s+-?[0-9.]+x", out, re.M), out
    import torch.distributed as tdist

    assert not tdist.is_initialized()  # the one-rank group it made is gone: later tests start without one
    assert out.splitlines()[-1].startswith("FIGURE: 96-token responses")
