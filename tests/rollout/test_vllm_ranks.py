"""The vllm rollout in every rank of a trainer's torch.distributed world (two gloo ranks, vLLM's CPU build).

One spawn of two ranks runs every case; each rank builds a VLLMEngine over the tiny Qwen3-MoE (tensor
parallel 1: each rank its own replica), as the actor's ranks do under placement=colocated. The ranks write what their
engines returned; the tests compare it here with the hf rollout on the same weights. An engine starts in
~5-30 s on 2 cores (the first pays for vLLM's imports); the module takes about a minute.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.base import SamplingParams
from conveyor.rollout.hf import HFEngine
from conveyor.rollout.vllm import replica_layout

WORLD = 2
PROMPTS = ["1+2=", "12+345=", "7*8=", "100-1=", "9+9=", "31+4="]
# (name, architecture, tensor parallel size)
# Tensor parallel 2 over both ranks (one replica) trains in tests/rollout/test_placement.py; here the engine
# alone, one per rank.
CASES = [("moe", "qwen3_moe", 1)]
NEW_TOKENS = 8


def _model(arch: str, tok):
    return build_tiny_model(arch, tok, seed=0, hidden_size=64, num_heads=2, num_kv_heads=2, initializer_range=0.3)


def _perturbed(model):
    """The trainer's update: the same seeded noise on every rank, enough to change the greedy tokens."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _prompts(tok):
    enc = tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _all_reduce_sum(rank: int) -> float:
    t = torch.tensor([float(rank + 1)])
    tdist.all_reduce(t)
    return float(t)


def _rank_main(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(minutes=5))
    from vllm.distributed import parallel_state

    from conveyor.rollout.vllm import VLLMEngine

    tok = build_char_tokenizer()
    ids, mask = _prompts(tok)
    for name, arch, tp in CASES:
        model = _model(arch, tok)
        engine = VLLMEngine(
            str(Path(root) / arch),
            hf_config=model.config,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            max_model_len=64,
            max_num_seqs=16,
            seed=0,
            tensor_model_parallel_size=tp,
        )
        out = {
            "replica": engine.replica,
            "replica_ranks": engine.replica_ranks,
            "num_replicas": engine.num_replicas,
            "tp_ranks": parallel_state.get_tp_group().ranks,
            "start_s": engine.start_time_s,
            "sum_after_start": _all_reduce_sum(rank),
            "llm_kwargs": engine.llm_kwargs,
        }
        greedy = SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False)
        out["before"] = engine.generate(ids, mask, greedy)
        rows = (ids.repeat(2, 1), mask.repeat(2, 1))
        # No generator: each request samples from the engine's seed, which is its replica's.
        out["sampled"] = engine.generate(*rows, SamplingParams(max_new_tokens=NEW_TOKENS))
        # Per-request seeds from the same generator on every rank: the same samples whatever the replica.
        out["seeded"] = engine.generate(
            *rows, SamplingParams(max_new_tokens=NEW_TOKENS), generator=torch.Generator().manual_seed(5)
        )
        engine.update_weights(_perturbed(model).state_dict().items(), version=1)
        out["after"] = engine.generate(ids, mask, greedy)
        engine.close()
        out["sum_after_close"] = _all_reduce_sum(rank)
        out["trainer_world"] = tdist.is_initialized() and tdist.get_world_size()
        out["vllm_groups_left"] = [
            g is not None for g in (parallel_state._WORLD, parallel_state._TP, parallel_state._DP, parallel_state._EP)
        ]
        torch.save(out, Path(root) / f"{name}_{rank}.pt")
    tdist.barrier()
    tdist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each rank's engines returned, per case: {name: [rank 0's, rank 1's]}."""
    root = tmp_path_factory.mktemp("vllm-ranks")
    tok = build_char_tokenizer()
    for arch in {case[1] for case in CASES}:
        _model(arch, tok).save_pretrained(root / arch)
        tok.save_pretrained(root / arch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(port, str(root)), nprocs=WORLD, join=True)
    return {name: [torch.load(root / f"{name}_{r}.pt", weights_only=False) for r in range(WORLD)] for name, *_ in CASES}


def _hf_greedy(model, tok):
    ids, mask = _prompts(tok)
    return HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).generate(
        ids, mask, SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False)
    )


def _masked(out):
    return out["responses"] * out["response_mask"], out["response_mask"]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_masked(a), _masked(b)))


@pytest.mark.parametrize("name,arch,tp", CASES)
def test_each_replica_serves_the_trainers_weights_before_and_after_a_sync(ranks, name, arch, tp) -> None:
    tok = build_char_tokenizer()
    model = _model(arch, tok)
    hf_before = _hf_greedy(model, tok)
    hf_after = _hf_greedy(_perturbed(model), tok)
    assert not _same(hf_before, hf_after)  # the update changes the policy's greedy tokens
    for rank, out in enumerate(ranks[name]):
        assert out["replica"] == rank // tp and out["num_replicas"] == WORLD // tp
        assert out["replica_ranks"] == out["tp_ranks"] == list(range(rank // tp * tp, (rank // tp + 1) * tp))
        assert _same(out["before"], hf_before), f"rank {rank}"
        assert _same(out["after"], hf_after), f"rank {rank}"
    assert _same(ranks[name][0]["before"], ranks[name][1]["before"])


@pytest.mark.parametrize("name,arch,tp", CASES)
def test_replicas_seed_apart_and_request_seeds_repeat(ranks, name, arch, tp) -> None:
    a, b = ranks[name]
    assert torch.equal(a["seeded"]["responses"], b["seeded"]["responses"])
    if tp == 1:  # two replicas, seeds 0 and 1
        assert not torch.equal(a["sampled"]["responses"], b["sampled"]["responses"])
    else:  # one replica over both ranks: its TP ranks must sample alike
        assert torch.equal(a["sampled"]["responses"], b["sampled"]["responses"])


@pytest.mark.parametrize("name,arch,tp", CASES)
def test_the_trainers_group_outlives_the_engine(ranks, name, arch, tp) -> None:
    for out in ranks[name]:
        assert out["sum_after_start"] == out["sum_after_close"] == 3.0
        assert out["trainer_world"] == WORLD
        assert out["vllm_groups_left"] == [False] * 4


@pytest.mark.parametrize("name,arch,tp", CASES)
def test_engines_in_a_trainers_world_turn_custom_all_reduce_off(ranks, name, arch, tp) -> None:
    import vllm

    for out in ranks[name]:
        kwargs = out["llm_kwargs"]
        assert kwargs["distributed_executor_backend"] == "external_launcher"
        # vLLM's own IPC all-reduce buffers would sit beside the trainer's on every device (verl turns it off too).
        assert kwargs["disable_custom_all_reduce"] is True
        assert set(kwargs) <= {f.name for f in dataclasses.fields(vllm.EngineArgs)}


def test_replicas_are_runs_of_tensor_parallel_ranks() -> None:
    assert [replica_layout(r, 4, 1) for r in range(4)] == [(r, [r]) for r in range(4)]
    assert [replica_layout(r, 4, 2) for r in range(4)] == [(0, [0, 1]), (0, [0, 1]), (1, [2, 3]), (1, [2, 3])]
    with pytest.raises(ValueError, match="must divide"):
        replica_layout(0, 3, 2)
