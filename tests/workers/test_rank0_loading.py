"""Loading under fsdp2 over two gloo ranks: only rank 0 reads the checkpoint, every rank's shards come out exact.

The ranks run in one subprocess (`loading_ranks.py`) that builds an actor on a
dense model with tied embeddings, an actor and a reference on an MoE model, and
a critic; each rank gathers every parameter and buffer (non-persistent ones,
the rotary tables, included) with `full_tensor`. They must equal the tensors
of a plain one-process load exactly, and a forward through the shards must
give its logits (values) within 1e-6.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conveyor.models.loading import build_causal_lm_on_meta, load_causal_lm, save_pretrained_checkpoint
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.models.value_head import ValueModel
from conveyor.workers.training.loading import load_role_model, loads_from_rank0, non_persistent_buffers

RANKS_SCRIPT = Path(__file__).with_name("loading_ranks.py")
WORLD = 2
INPUT_IDS = [[5, 9, 12, 7, 3, 21], [8, 8, 14, 2, 30, 11]]
STRATEGY = {
    "actor": "actor_rollout_ref.actor.strategy=fsdp2",
    "reference": "actor_rollout_ref.ref.strategy=fsdp2",
    "critic": "critic.strategy=fsdp2",
}
CASES = {
    "dense-actor": ("dense", "actor"),
    "moe-actor": ("moe", "actor"),
    "moe-reference": ("moe", "reference"),
    "moe-critic": ("moe", "critic"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tok = build_char_tokenizer()
    root = tmp_path_factory.mktemp("ckpts")
    # Random-looking weights (initializer_range): a wrong or missing piece shows in the logits.
    dense = build_tiny_model("qwen3", tok, seed=1, initializer_range=0.2, tie_word_embeddings=True)
    assert dense.lm_head.weight is dense.model.embed_tokens.weight
    moe = build_tiny_model("qwen3_moe", tok, seed=2, initializer_range=0.2)
    return {
        "dense": save_pretrained_checkpoint(dense, tok, root / "dense"),
        "moe": save_pretrained_checkpoint(moe, tok, root / "moe"),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loading_ranks")
    cases, outs = [], {}
    for name, (model, role) in CASES.items():
        out = root / name
        out.mkdir()
        outs[name] = out
        overrides = [
            f"actor_rollout_ref.model.path={checkpoints[model]}",
            "actor_rollout_ref.model.forward_impl=hf",
            STRATEGY[role],
        ]
        cases.append({"role": role, "model_path": str(checkpoints[model]), "overrides": overrides, "out": str(out)})
    (root / "spec.json").write_text(json.dumps({"world": WORLD, "input_ids": INPUT_IDS, "cases": cases}))
    done = subprocess.run(
        [sys.executable, str(RANKS_SCRIPT), str(root / "spec.json")], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return outs


def _plain(path: Path, role: str) -> torch.nn.Module:
    model = load_causal_lm(path)
    return ValueModel.from_causal_lm(model) if role == "critic" else model


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_holds_the_checkpoints_tensors(checkpoints, ranks, case: str) -> None:
    model_name, role = CASES[case]
    plain = _plain(checkpoints[model_name], role)
    want = {name: p.detach() for name, p in plain.named_parameters()}
    want.update({name: b for name, b in plain.named_buffers()})
    assert any("inv_freq" in name for name in non_persistent_buffers(plain))
    full_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    for rank in range(WORLD):
        got = torch.load(ranks[case] / f"tensors_{rank}.pt", weights_only=True)
        assert got["strategy"] == "fsdp2"
        assert set(got["tensors"]) == set(want)
        for name, tensor in want.items():
            assert got["tensors"][name].dtype == tensor.dtype, name
            assert torch.equal(got["tensors"][name], tensor), f"rank {rank}: {name} differs from the checkpoint"
        # Each rank keeps its shards only (a little over half: uneven dims round up).
        assert got["local_param_bytes"] < 0.6 * full_bytes


@pytest.mark.parametrize("case", list(CASES))
def test_forward_through_the_shards_matches_a_plain_load(checkpoints, ranks, case: str) -> None:
    model_name, role = CASES[case]
    plain = _plain(checkpoints[model_name], role).eval()
    input_ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        if role == "critic":
            want = plain(input_ids, torch.ones_like(input_ids))
        else:
            want = plain(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    for rank in range(WORLD):
        got = torch.load(ranks[case] / f"forward_{rank}.pt", weights_only=True)
        # The weights are equal bit for bit (above); a forward through the shards on other threads may sum in
        # another order, which some CPUs' kernels (AVX-512 MKL) show in the last bits.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_meta_build_matches_the_loaded_model(checkpoints) -> None:
    """The skeleton the other ranks start from: the same names, shapes and dtypes, in eval mode, no storage."""
    for path in checkpoints.values():
        loaded = load_causal_lm(path, dtype="bfloat16")
        meta = build_causal_lm_on_meta(path, dtype="bfloat16")
        assert not meta.training
        assert {n: (p.shape, p.dtype) for n, p in meta.state_dict().items()} == {
            n: (p.shape, p.dtype) for n, p in loaded.state_dict().items()
        }
        assert {n: (b.shape, b.dtype) for n, b in non_persistent_buffers(meta).items()} == {
            n: (b.shape, b.dtype) for n, b in non_persistent_buffers(loaded).items()
        }
        assert all(t.is_meta for t in meta.state_dict().values())


def test_one_rank_and_dp_load_as_before(checkpoints) -> None:
    assert not loads_from_rank0("none", 1) and not loads_from_rank0("dp", 2) and not loads_from_rank0("fsdp2", 1)
    assert loads_from_rank0("fsdp2", 2)
    model = load_role_model(
        checkpoints["moe"], strategy_name="dp", world_size=2, rank=1, device=torch.device("cpu"), dtype="float32"
    )
    assert not any(p.is_meta for p in model.parameters())
    skeleton = load_role_model(
        checkpoints["moe"], strategy_name="fsdp2", world_size=2, rank=1, device=torch.device("cpu"), dtype="float32"
    )
    assert all(p.is_meta for p in skeleton.parameters())
