"""conveyor.weights: bucketing, expert naming, the gloo transport, the FSDP2 gather, and a real vLLM engine.

The two-rank cases run tests/rollout/weight_sync_ranks.py (two spawned gloo processes). The vLLM cases
start vLLM's CPU build over tiny saved MoE models (~20-30 s each on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conveyor import weights as ws
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.base import SamplingParams

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _t(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


# ------------------------------------------------------------------ buckets
def test_buckets_group_in_order_and_never_exceed_the_size_except_a_lone_big_tensor() -> None:
    named = [(str(i), _t(n)) for i, n in enumerate([10, 20, 70, 1, 100, 250, 30, 30, 40])]
    out = list(ws.buckets(iter(named), 100))
    assert [[n for n, _ in b] for b in out] == [["0", "1", "2"], ["3"], ["4"], ["5"], ["6", "7", "8"]]
    assert [n for b in out for n, _ in b] == [n for n, _ in named]  # nothing dropped, order kept
    for b in out:
        assert sum(t.numel() for _, t in b) <= 100 or len(b) == 1
    assert list(ws.buckets(iter([]), 100)) == []
    assert [len(b) for b in ws.buckets(iter([("a", _t(100)), ("b", _t(100))]), 100)] == [1, 1]  # exact fit
    assert [len(b) for b in ws.buckets(iter([("a", _t(0)), ("b", _t(0))]), 1)] == [2]  # empty tensors
    for bad in (0, -1):
        with pytest.raises(ValueError, match="bucket_bytes"):
            list(ws.buckets(iter(named), bad))


def test_buckets_are_lazy_and_the_in_process_path_passes_the_tensors_themselves() -> None:
    pulled = []

    def stream():
        for i in range(6):
            pulled.append(i)
            yield str(i), _t(40)

    it = ws.buckets(stream(), 100)
    assert [n for n, _ in next(it)] == ["0", "1"] and pulled == [0, 1, 2]  # one tensor ahead, no more
    tensors = [(str(i), _t(8)) for i in range(5)]
    seen = []
    stats = ws.stream_to(iter(tensors), lambda b: seen.extend(b), bucket_bytes=16)
    assert all(a is b for (_, a), (_, b) in zip(seen, tensors))  # no copy
    assert (stats.buckets, stats.tensors, stats.bytes, stats.max_bucket_bytes) == (3, 5, 40, 16)


def test_pack_is_one_aligned_copy_that_unpacks_bit_for_bit_as_views() -> None:
    named = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),
        ("c", torch.arange(4)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.empty(0, 3)),
        ("t", torch.randn(4, 6).t()),
    ]
    buffer, table = ws.pack(named)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.device.type == "cpu"
    assert [name for name, *_ in table] == [name for name, _ in named]
    assert all(offset % 64 == 0 for *_, offset in table)  # every tensor starts aligned
    out = list(ws.unpack(buffer, table))
    for (name, want), (got_name, got) in zip(named, out, strict=True):
        assert got_name == name and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), name
        if got.numel():  # views of the buffer, not copies...
            assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    named[0][1].add_(1.0)  # ...of copies: the source may change after packing
    assert not torch.equal(out[0][1], named[0][1])


def test_shared_slots_hand_weights_to_another_mapping_and_never_overwrite_a_slot_in_use() -> None:
    named = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),
        ("c", torch.arange(4)),
        ("empty", torch.empty(0, 3)),
        ("t", torch.randn(4, 6).t()),
    ]
    table, nbytes = ws.layout(named)
    slots = ws.SharedSlots(nbytes)
    try:
        with pytest.raises(ValueError, match="holds no sync"):
            slots.handle(0)
        first = slots.write(named, table, nbytes)
        path, size, offset, n, got_table = slots.handle(first)
        assert os.path.exists(path) and size == 2 * nbytes and n == nbytes and got_table == table
        mapped = ws.map_shared(path, size)  # what a replica maps: the same memory, not a copy of the file
        second = slots.write([(k, v + 1) for k, v in named], table, nbytes)
        assert {first, second} == {0, 1}
        assert slots.write(named, table, nbytes) is None  # both in use: the caller sends another way, it never waits
        for slot, add in ((first, 0), (second, 1)):
            _, _, offset, n, _ = slots.handle(slot)
            for (name, want), (got_name, got) in zip(named, ws.unpack(mapped[offset : offset + n], table), strict=True):
                assert got_name == name and torch.equal(got, want + add)
        slots.release(first)
        assert slots.write([(k, v * 0) for k, v in named], table, nbytes) == first
        _, _, offset, n, _ = slots.handle(first)
        assert all(not got.any() for _, got in ws.unpack(mapped[offset : offset + n], table))
        slots.release(second)
        # Another layout that fits (a delta sync's) takes the slot; its handle names that layout and size.
        small = [("a", named[0][1] * 3)]
        small_table, small_bytes = ws.layout(small)
        assert slots.write(small, small_table, small_bytes) == second
        _, _, offset, n, got_table = slots.handle(second)
        assert n == small_bytes and got_table == small_table
        assert torch.equal(next(ws.unpack(mapped[offset : offset + n], got_table))[1], named[0][1] * 3)
        slots.release(second)
        bigger = named + [("d", torch.randn(16))]
        assert slots.write(bigger, *ws.layout(bigger)) is None  # larger than a slot: sent another way
        slots.unlink()
        slots.unlink()
        assert not os.path.exists(path)
        _, _, offset, n, _ = slots.handle(first)
        assert torch.equal(next(ws.unpack(mapped[offset : offset + n], table))[1], named[0][1] * 0)  # still mapped
    finally:
        slots.unlink()


def test_staging_reuses_its_buffer_only_when_no_view_of_it_is_alive() -> None:
    staging = ws.Staging("cpu")
    first = staging.get(64)
    ptr = first.data_ptr()
    del first
    again = staging.get(32)
    assert again.data_ptr() == ptr  # reused: nothing else held it
    kept = again[:8].view(torch.int32)  # a consumer keeps a view (vLLM's reload keeps a layer's tensors)
    del again
    fresh = staging.get(64)
    assert fresh.data_ptr() != ptr and kept.data_ptr() == ptr  # new memory; the kept view is untouched
    del fresh
    assert staging.get(128).numel() == 128  # grows to a larger bucket


# ------------------------------------------------------------------ expert names
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_per_expert_layout_is_the_checkpoint_transformers_saves_as_views(arch, tok, tmp_path) -> None:
    model = build_tiny_model(arch, tok, seed=0, hidden_size=64, num_heads=2, num_kv_heads=2, num_experts=4)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    fused = dict(model.state_dict())
    ours = list(ws.engine_names(ws.iter_weights(model), layout="per_expert", model_type=model.config.model_type))
    assert sorted(n for n, _ in ours) == sorted(saved)
    for name, tensor in ours:
        assert torch.equal(tensor, saved[name]), name
    # The split tensors are views of the fused parameters (no copy of a layer), contiguous for the transport.
    bases = {t.untyped_storage().data_ptr() for n, t in fused.items() if ".experts." in n}
    experts = [t for n, t in ours if ".experts." in n]
    assert experts and all(t.untyped_storage().data_ptr() in bases and t.is_contiguous() for t in experts)
    # "fused" hands the trainer's tensors over as they are; a dense model passes through either way.
    assert [n for n, _ in ws.engine_names(fused.items(), layout="fused", model_type=arch)] == list(fused)
    dense = build_tiny_model("qwen3", tok, hidden_size=64, num_heads=2, num_kv_heads=2)
    assert [n for n, _ in ws.engine_names(ws.iter_weights(dense), model_type="qwen3")] == list(dense.state_dict())
    with pytest.raises(ValueError, match="layout"):
        list(ws.engine_names(fused.items(), layout="stacked"))


def test_iter_weights_strips_wrapper_names_and_moves_to_a_device(tok) -> None:
    model = build_tiny_model("qwen3", tok, hidden_size=64, num_heads=2, num_kv_heads=2)
    wrapped = torch.nn.Module()
    wrapped._orig_mod = model  # what torch.compile's wrapper inserts
    names = [n for n, _ in ws.iter_weights(wrapped, device="cpu")]
    assert names == list(model.state_dict())


# ------------------------------------------------------------------ two ranks
@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    """The two-rank cases, run once in one pair of spawned gloo processes; the folder of what each rank wrote."""
    out = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "weight_sync_ranks.py"), "transport,apart,fsdp2", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_gloo_transport_is_bit_exact_and_holds_one_bucket_at_a_time(ranks) -> None:
    sys.path.insert(0, str(HERE))
    from weight_sync_ranks import BUCKET, transport_tensors

    sent = dict(transport_tensors())
    got = torch.load(ranks / "transport_1.pt")
    for received in (got["received"], got["lazy"]):
        assert list(received) == list(sent)
        for name, tensor in sent.items():
            r = received[name]
            assert r.dtype == tensor.dtype and r.shape == tensor.shape, name
            assert torch.equal(_bits(r), _bits(tensor)), name  # bit for bit
    assert got["buckets"] == torch.load(ranks / "transport_0.pt")["buckets"] > 2
    # What the receiver had alive: one bucket (at most BUCKET, or one tensor over it), none of the earlier ones.
    big = max(t.numel() * t.element_size() for t in sent.values())
    assert all(size <= BUCKET or size == big for size in got["sizes"]) and max(got["sizes"]) == big
    assert got["alive_before"] == [0] * got["buckets"]
    assert got["lazy_alive"] == [0] * len(sent)


def test_large_tensors_travel_alone_and_land_where_the_receiver_says_when_they_fit(ranks) -> None:
    sys.path.insert(0, str(HERE))
    from weight_sync_ranks import apart_tensors

    sent = dict(apart_tensors())
    got = torch.load(ranks / "apart_1.pt")
    assert list(got["received"]) == list(sent)  # packed and lone tensors come back in the sender's order
    for name, tensor in sent.items():
        r = got["received"][name]
        assert r.dtype == tensor.dtype and r.shape == tensor.shape, name
        assert torch.equal(_bits(r), _bits(tensor)), name
    # Only contiguous targets of the right dtype and shape, for tensors that travel alone (256 bytes or more, or
    # a bucket's only tensor: i.half, after h.big's bucket of one), are written in place.
    assert got["placed"] == ["wide.float", "h.big", "i.half"]
    for name in got["placed"]:
        assert torch.equal(got["targets"][name], sent[name])
    for name in ("a.weight", "g.transposed", "d.ids", "wide.wrong_shape", "wide.strided"):
        assert not got["targets"][name].any(), name  # untouched: the stream handed its own tensor


def test_copy_into_skips_a_tensor_received_in_place_and_copies_the_rest() -> None:
    model = torch.nn.Linear(4, 3)
    into = ws.into_model(model)
    weight = into("weight", torch.float32, (3, 4))
    assert weight is not None and weight.data_ptr() == model.weight.data_ptr() and not weight.requires_grad
    weight.copy_(torch.ones(3, 4))  # what a broadcast into it does
    ws.copy_into(model)([("weight", weight), ("bias", torch.full((3,), 2.0))])
    assert torch.equal(model.weight.detach(), torch.ones(3, 4)) and torch.equal(
        model.bias.detach(), torch.full((3,), 2.0)
    )
    assert into("missing", torch.float32, (1,)) is None


def test_fsdp2_two_ranks_stream_the_whole_state_dict_one_tensor_at_a_time(ranks, tok) -> None:
    whole = build_tiny_model("qwen3_moe", tok, seed=0, hidden_size=64, num_heads=2, num_kv_heads=2)
    want = dict(ws.engine_names(whole.state_dict().items(), layout="per_expert", model_type="qwen3_moe"))
    total = sum(p.numel() for p in whole.parameters())
    for rank in (0, 1):
        got = torch.load(ranks / f"fsdp2_{rank}.pt")
        assert list(got["tensors"]) == list(want)
        assert all(torch.equal(got["tensors"][n], t) for n, t in want.items())
        assert got["local_numel"] <= total // 2 + 64  # each rank held its shard only
        # Gathered tensors alive at once while streaming: the one handed on and the generator's current one.
        assert got["peak_alive"] <= 2 < len(want)


# ------------------------------------------------------------------ vLLM
def _prompts(tok):
    enc = tok(
        ["1+2=", "12+345=", "7*8=", "100-1=", "9+9=", "31+4="], padding=True, padding_side="left", return_tensors="pt"
    )
    return enc["input_ids"], enc["attention_mask"]


def _engine(model, tok, path):
    from conveyor.rollout.vllm import VLLMEngine

    model.save_pretrained(path)
    tok.save_pretrained(path)
    return VLLMEngine(
        str(path),
        hf_config=model.config,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        max_model_len=64,
        max_num_seqs=8,
        seed=0,
    )


def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.5 if ".experts." in name else 0.05))


def _greedy_pair(engine, model, tok):
    from conveyor.rollout.hf import HFEngine

    ids, mask = _prompts(tok)
    greedy = SamplingParams(max_new_tokens=8, do_sample=False)
    theirs = engine.generate(ids, mask, greedy)
    ours = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).generate(ids, mask, greedy)
    same = torch.equal(theirs["response_mask"], ours["response_mask"]) and torch.equal(
        theirs["responses"] * theirs["response_mask"], ours["responses"] * ours["response_mask"]
    )
    return same, theirs, ours


def _stream_into(engine, model, layout: str, bucket_bytes: int = 1 << 14) -> None:
    """The streamed sync an in-process engine gets: gathered, renamed and bucketed lazily, one reload call."""
    named = ws.engine_names(ws.iter_weights(model), layout=layout, model_type=model.config.model_type)
    from conveyor.rollout.vllm import reload_vllm

    reload_vllm(engine.llm, (item for bucket in ws.buckets(named, bucket_bytes) for item in bucket))


def test_vllm_qwen3_moe_serves_the_streamed_per_expert_weights(tok, tmp_path) -> None:
    pytest.importorskip("vllm")
    model = build_tiny_model(
        "qwen3_moe", tok, seed=0, hidden_size=64, num_heads=2, num_kv_heads=2, initializer_range=0.3
    )
    engine = _engine(model, tok, tmp_path)
    try:
        before = _greedy_pair(engine, model, tok)[1]
        for step, layout in enumerate(["per_expert", "fused", "per_expert"]):
            _perturb(model, seed=step + 1)
            _stream_into(engine, model, layout)
            same, theirs, ours = _greedy_pair(engine, model, tok)
            assert same, (layout, theirs["responses"], ours["responses"])
            assert not torch.equal(theirs["responses"], before["responses"])  # the sync changed what it serves
            before = theirs
    finally:
        engine.close()


def test_vllm_mixtral_refuses_fused_expert_names_and_serves_per_expert(tok, tmp_path) -> None:
    """The trainer's state-dict names (experts fused) fail on Mixtral, vLLM's module being block_sparse_moe; the
    engine's own update_weights sends them per expert and serves the trainer's policy."""
    pytest.importorskip("vllm")
    model = build_tiny_model("mixtral", tok, seed=0, hidden_size=64, num_heads=2, num_kv_heads=2, initializer_range=0.3)
    engine = _engine(model, tok, tmp_path)
    try:
        _perturb(model, seed=5)
        with pytest.raises(ValueError, match="layers.0.mlp"):
            _stream_into(engine, model, "fused")  # the trainer's own names
        _stream_into(engine, model, "per_expert")
        same, theirs, ours = _greedy_pair(engine, model, tok)
        assert same, (theirs["responses"], ours["responses"])
        _perturb(model, seed=6)
        engine.update_weights(ws.iter_weights(model), version=2)  # what the actor worker calls
        same, theirs, ours = _greedy_pair(engine, model, tok)
        assert same, (theirs["responses"], ours["responses"])
    finally:
        engine.close()


def test_an_hf_engine_names_its_own_tensors_and_loads_one_received_in_place_without_a_copy(tok) -> None:
    from conveyor.models.tiny import build_tiny_model
    from conveyor.rollout.hf import HFEngine

    engine = HFEngine(
        build_tiny_model("qwen3", tok, seed=0), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    source = build_tiny_model("qwen3", tok, seed=1)
    into = engine.weight_targets()
    name = "model.embed_tokens.weight"
    target = into(name, torch.float32, tuple(source.get_parameter(name).shape))
    assert target is not None and target.data_ptr() == engine.model.get_parameter(name).data_ptr()
    assert into("no.such.tensor", torch.float32, (1,)) is None
    target.copy_(source.get_parameter(name).detach())  # what the channel's broadcast into it does
    named = [(n, target if n == name else t.detach()) for n, t in source.state_dict().items()]
    engine.update_weights(iter(named), version=3)
    for n, t in source.state_dict().items():
        assert torch.equal(engine.model.state_dict()[n], t), n
    assert engine.weights_version == 3
