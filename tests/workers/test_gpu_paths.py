"""The fsdp2 paths a GPU run takes differently, by contract on the CPU (two gloo ranks where it matters).

- The process group a CUDA role creates maps CPU tensors to gloo (param_offload's collectives run on them),
  in one helper both the one-rank group and the Ray ranks use.
- CPU-offloaded FSDP2 shards: the strategy's gradient clipping and the weight sync's gathers give what the
  same model gives without offload.
- The root unit stays gathered from a training forward to its backward, also after a no-grad pass.
- LoRA's merged weights streamed one tensor at a time equal PEFT's merged model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from gpu_paths_ranks import add_lora, load_model  # tests/workers on sys.path
from test_strategies import BASE
from torch.distributed.distributed_c10d import Backend, BackendConfig

from conveyor.config import load_config
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.training import strategy as strategy_mod
from conveyor.workers.training.strategy import collective_device, process_group_backend

RANKS_SCRIPT = Path(__file__).with_name("gpu_paths_ranks.py")


def test_a_cuda_role_maps_cpu_tensors_to_gloo() -> None:
    backend = process_group_backend("cuda")
    assert BackendConfig(Backend(backend)).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    assert process_group_backend("cpu") == "gloo"


@pytest.mark.parametrize(
    "config, device, expected",
    [
        ("cpu:gloo,cuda:nccl", "cuda", "cuda"),  # the strategy's counts and sums stay on the GPU
        ("cpu:gloo,cuda:nccl", "cpu", "cpu"),
        ("cuda:nccl", "cuda", "cuda"),
        ("cpu:gloo,cuda:gloo", "cuda", "cpu"),  # gloo's collectives on GPU tensors copy through the host anyway
        ("cpu:gloo,cuda:gloo", "cpu", "cpu"),
    ],
)
def test_small_collectives_run_where_the_group_serves_them(monkeypatch, config, device, expected) -> None:
    monkeypatch.setattr(tdist, "get_backend_config", lambda group=None: config)
    assert collective_device(torch.device(device)) == torch.device(expected)


def test_one_rank_group_and_ray_ranks_use_the_same_backend(monkeypatch) -> None:
    from conveyor.workers.placement.ray_rank import _RankActor

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(tdist, "init_process_group", lambda backend, **kw: calls.append(("init", backend)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the rank's rendezvous variables stay in this test
    strategy_mod.ensure_process_group(torch.device("cuda", 0))
    _RankActor.init_process_group(types.SimpleNamespace(rank=1, world_size=2), "127.0.0.1", 1234, "cuda")
    _RankActor.init_process_group(types.SimpleNamespace(rank=1, world_size=2), "127.0.0.1", 1234, "cpu")
    mapped = process_group_backend("cuda")
    assert calls == [("init", mapped), ("set_device", 0), ("init", mapped), ("init", "gloo")]


@pytest.fixture(scope="module")
def model_path() -> str:
    return prepare_default_model(load_config(None, BASE))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Path:
    out = tmp_path_factory.mktemp("gpu-paths")
    done = subprocess.run(
        [sys.executable, str(RANKS_SCRIPT), model_path, str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_offloaded_shards_clip_and_stream_as_resident_ones(ranks: Path) -> None:
    got = torch.load(ranks / "offload.pt", weights_only=False)
    off, plain = got["offload"], got["plain"]
    assert off["offloaded"] and not plain["offloaded"]
    assert off["grad_devices"] == ["cpu"]
    assert off["norm"].item() > 0.05  # the clip scaled the gradients
    torch.testing.assert_close(off["norm"], plain["norm"], rtol=1e-6, atol=0)
    assert off["grads"].keys() == plain["grads"].keys() and off["weights"].keys() == plain["weights"].keys()
    for name in plain["grads"]:
        torch.testing.assert_close(off["grads"][name], plain["grads"][name], rtol=1e-6, atol=1e-9)
    for name in plain["weights"]:
        torch.testing.assert_close(off["weights"][name], plain["weights"][name], rtol=0, atol=0)


def test_the_root_is_gathered_once_per_training_micro_batch(ranks: Path) -> None:
    counts = json.loads((ranks / "root.json").read_text())
    # Each layer gathered for its forward and again for its backward; the root once, kept for the backward.
    expected = 2 * (2 * counts["layers"] + 1)
    assert {k: counts[k] for k in ("fresh", "sharded_no_grad", "full_params")} == {
        "fresh": expected,
        "sharded_no_grad": expected,
        "full_params": expected,
    }


def test_streamed_lora_merge_equals_peft_merged_model(ranks: Path, model_path: str) -> None:
    streamed = torch.load(ranks / "lora.pt", weights_only=True)
    # The same adapters in one process, merged by PEFT itself.
    merged = add_lora(load_model(model_path)).merge_and_unload().state_dict()
    base = load_model(model_path).state_dict()
    changed = [name for name in merged if not torch.equal(merged[name], base[name])]
    assert any("q_proj" in n for n in changed) and any("experts" in n for n in changed), changed
    assert list(streamed) == list(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=1e-6, atol=1e-7)
