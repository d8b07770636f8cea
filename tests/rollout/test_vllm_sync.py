"""The vllm engine across weight syncs, on vLLM's real CPU build: what it serves after a sync, and when it holds
weights.

One engine serves the module, built through the registry as a worker builds it (`build_engine`: no checkpoint read,
`load_format="dummy"`), over a tiny dense Qwen3 with 32-wide heads. Its prompts share a prefix of several full KV
blocks, as a system prompt or a chat template does, so that vLLM's prefix cache has old-weight blocks to reuse after a
sync. The engine starts in ~10-30 s on 2 cores; every test after that takes a few seconds.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from test_conformance import LOGP_TOL  # tests/rollout is on sys.path (rootdir import mode)
from test_hf_rollout import _teacher_forced_log_probs

from conveyor.config.rollout import RolloutConfig
from conveyor.models.tiny import build_tiny_model
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.protocol import KVBatchMeta
from conveyor.rollout.base import EngineContext, SamplingParams, engine_spec
from conveyor.rollout.hf import HFEngine
from conveyor.weights import cast_weights, engine_names, iter_weights

pytest.importorskip("vllm")

# 297 characters: with vLLM's CPU block size, several full blocks every prompt shares.
PREFIX = (
    "you are a careful calculator. read the sum, add the numbers digit by digit, carry where needed, "
    "and write the answer after the equals sign. " * 2
)[:297]
SUFFIXES = ["1+2=", "12+345=", "7*8=", "100-1=", "9+9=", "31+4="]
NEW_TOKENS = 8
MAX_MODEL_LEN = 320


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _model(tok):
    return build_tiny_model("qwen3", tok, seed=0, hidden_size=64, num_heads=2, num_kv_heads=2, initializer_range=0.3)


def _context(model, tok, path, **rollout) -> EngineContext:
    return EngineContext(
        model_path=str(path),
        model=model,
        tokenizer=tok,
        rollout=RolloutConfig(max_num_seqs=8, **rollout),
        model_dtype="float32",
        trust_remote_code=False,
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
    )


@pytest.fixture(scope="module")
def built(tok, tmp_path_factory):
    """(the trainer's model, the engine built from the registry, what it did before its first sync)."""
    path = tmp_path_factory.mktemp("sync-model")
    model = _model(tok).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    engine = engine_spec("vllm").build(_context(model, tok, path))
    first: dict = {"holds_weights": engine.holds_weights}
    ids, mask = _prompts(tok)
    try:
        _greedy(engine, ids, mask)
    except RuntimeError as err:
        first["error"] = str(err)
    engine.update_weights(model.state_dict().items(), version=0)
    yield model, engine, first
    engine.close()
    assert not torch.distributed.is_initialized()


def _prompts(tok):
    enc = tok([PREFIX + s for s in SUFFIXES], padding=True, padding_side="left", return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _greedy(engine, ids, mask):
    return engine.generate(ids, mask, SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False))


def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _gap(engine, model, tok) -> tuple[float, bool]:
    """(the largest |engine - trainer| log-prob of the engine's greedy tokens, whether its tokens are the trainer's)."""
    ids, mask = _prompts(tok)
    out = _greedy(engine, ids, mask)
    ref = _teacher_forced_log_probs(model, ids, mask, out, 1.0)[0] * out["response_mask"]
    ours = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).generate(
        ids, mask, SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False)
    )
    same = torch.equal(out["responses"] * out["response_mask"], ours["responses"] * ours["response_mask"])
    return float((out["rollout_log_probs"] - ref).abs().max()), same


def test_the_prompts_share_full_kv_blocks(built, tok) -> None:
    _, engine, _ = built
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    assert len(tok(PREFIX)["input_ids"]) >= 2 * block, f"the shared prefix must span several {block}-token blocks"
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching


def test_on_a_cpu_a_step_prefills_whole_prompts_only(built) -> None:
    # A prompt split over two steps has its first chunk's token discarded and the request's generator rewound,
    # which a CPU generator cannot do: seeded batches overrunning the step budget mid-prompt failed
    # (tests/benchmarks/test_in_flight_bench.py runs one).
    _, engine, _ = built
    scheduler = engine.llm.llm_engine.vllm_config.scheduler_config
    assert not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens >= MAX_MODEL_LEN


def test_a_worker_s_engine_reads_no_checkpoint_and_refuses_to_sample_before_its_first_sync(built) -> None:
    _, engine, first = built
    assert engine.llm_kwargs["load_format"] == "dummy"
    assert first["holds_weights"] is False and "update_weights first" in first["error"]
    assert engine.holds_weights


def test_after_each_sync_the_engine_serves_the_new_weights_not_cached_old_kv(built, tok) -> None:
    model, engine, _ = built
    trained = _model(tok).eval()
    trained.load_state_dict(model.state_dict())
    gap, same = _gap(engine, trained, tok)  # fills the prefix cache with blocks of these weights
    assert gap < LOGP_TOL and same
    for version in (1, 2):
        _perturb(trained, version)
        engine.update_weights(trained.state_dict().items(), version=version)
        gap, same = _gap(engine, trained, tok)
        # Reusing the old weights' KV blocks of the shared prefix puts the engine nats away (4-6 measured).
        assert gap < LOGP_TOL and same, f"sync {version}: log-probs off by {gap:.3g}"
    engine.update_weights(model.state_dict().items(), version=0)


def _switching(engine, new, at: int, rows=min):
    """An `interrupt` that loads `new`'s weights once `rows` (min: every row, max: some row) of the per-row counts
    of sampled tokens reaches `at`; the counts then."""
    counts: list[list[int]] = []

    def interrupt(sampled: list[int]) -> bool:
        if counts or rows(sampled) < at:
            return False
        counts.append(list(sampled))
        engine.update_weights(new.state_dict().items(), version=7)
        return True

    return interrupt, counts


def _perturbed(model, tok, seed: int):
    new = _model(tok).eval()
    new.load_state_dict(model.state_dict())
    _perturb(new, seed)
    return new


def _split(out, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the response tokens each row sampled before the switch, those after it), as masks."""
    cols = torch.arange(out["responses"].shape[1])[None]
    before = cols < torch.tensor(counts)[:, None]
    real = out["response_mask"].bool()
    return before & real, ~before & real


def test_weights_loaded_mid_generation_apply_from_the_next_token_over_a_recomputed_cache(built, tok) -> None:
    model, engine, _ = built
    new = _perturbed(model, tok, 11)
    ids, mask = _prompts(tok)
    _greedy(engine, ids, mask)  # the prefix cache now holds the old weights' blocks of the shared prefix
    interrupt, counts = _switching(engine, new, 3)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False)
    try:
        out = engine.generate(ids, mask, params, interrupt=interrupt)
        assert len(counts) == 1 and len(counts[0]) == len(SUFFIXES) and min(counts[0]) >= 3
        before, after = _split(out, counts[0])
        assert after.any()
        old_lp = _teacher_forced_log_probs(model, ids, mask, out, 1.0)[0]
        new_lp = _teacher_forced_log_probs(new, ids, mask, out, 1.0)[0]
        got = out["rollout_log_probs"]
        # Each token's log-prob is that of the weights that sampled it, the new ones over a cache they computed.
        assert float((got - old_lp)[before].abs().max()) < LOGP_TOL
        assert float((got - new_lp)[after].abs().max()) < LOGP_TOL
        assert float((old_lp - new_lp)[after].abs().max()) > 0.05  # the two weights really differ there
        # Nothing cached under the old weights is served afterwards (the prompts share full blocks).
        gap, same = _gap(engine, new, tok)
        assert gap < LOGP_TOL and same, f"after an in-flight update: log-probs off by {gap:.3g}"
    finally:
        engine.update_weights(model.state_dict().items(), version=0)


def test_keeping_the_kv_in_flight_decodes_the_new_weights_over_the_old_cache_and_caches_nothing_stale(
    built, tok
) -> None:
    model, engine, _ = built
    new = _perturbed(model, tok, 12)
    ids, mask = _prompts(tok)
    _greedy(engine, ids, mask)  # the prefix cache now holds the old weights' blocks of the shared prefix
    # Twice the prompts: 8 run at once (max_num_seqs), 4 wait, and have not started when the weights load.
    ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)
    interrupt, counts = _switching(engine, new, 3, rows=max)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, do_sample=False)
    engine.in_flight_kv = "keep"
    try:
        out = engine.generate(ids, mask, params, interrupt=interrupt)
        assert len(counts) == 1 and counts[0].count(0) == 4
        before, after = _split(out, counts[0])
        got = out["rollout_log_probs"]
        old_lp = _teacher_forced_log_probs(model, ids, mask, out, 1.0)[0]
        assert float((got - old_lp)[before].abs().max()) < LOGP_TOL
        # The reference, row by row: the old weights' cache of the prompt and every token fed before the switch
        # (all but the last one sampled), then the new weights over the rest of the sequence on top of it.
        new_lp = _teacher_forced_log_probs(new, ids, mask, out, 1.0)[0]
        checked = 0
        for i, n in enumerate(counts[0]):
            prompt = ids[i][mask[i].bool()]
            length = int(out["response_mask"][i].sum())
            if n == 0:
                # Not started at the load: it started under the new weights, reading nothing the old ones cached.
                assert float((got[i, :length] - new_lp[i, :length]).abs().max()) < LOGP_TOL, i
                continue
            if length <= n:
                continue  # the row ended before the switch
            seq = torch.cat([prompt, out["responses"][i, :length]])[None]
            cut = prompt.numel() + n - 1
            with torch.no_grad():
                cache = model(input_ids=seq[:, :cut]).past_key_values
                logits = new(input_ids=seq[:, cut:-1], past_key_values=cache).logits[0]
            want = torch.log_softmax(logits.float(), -1).gather(-1, seq[0, cut + 1 :, None])[:, 0]
            assert float((got[i, n:length] - want).abs().max()) < LOGP_TOL, i
            checked += 1
        assert checked >= len(SUFFIXES) // 2
        kept = after & (torch.tensor(counts[0]) > 0)[:, None]
        assert float((got - new_lp)[kept].abs().max()) > 0.01  # not what recomputing the cache gives
        gap, same = _gap(engine, new, tok)  # the generation's blocks were dropped when it ended
        assert gap < LOGP_TOL and same, f"after an in-flight update that kept the KV: log-probs off by {gap:.3g}"
    finally:
        engine.in_flight_kv = "recompute"
        engine.update_weights(model.state_dict().items(), version=0)


def test_sleeping_is_for_an_engine_colocated_with_a_trainer_on_a_device_with_sleep_mode(built) -> None:
    from conveyor.rollout.vllm import sleeps_between_rollouts

    _, engine, _ = built
    assert engine.sleeps is False  # vLLM's CPU build has no sleep mode
    assert engine.llm_kwargs["enable_sleep_mode"] is False
    # A separate replica keeps its weights: its group syncs only when the actor's change.
    for free in (True, False):
        for available in (True, False):
            assert sleeps_between_rollouts(free, colocated=False, sleep_mode_available=available) is False
            assert sleeps_between_rollouts(free, colocated=True, sleep_mode_available=available) is (free and available)


def test_the_registry_builds_a_separate_replica_that_never_sleeps(tok, monkeypatch) -> None:
    from conveyor.rollout import vllm as adapter

    made = {}
    monkeypatch.setattr(adapter, "VLLMEngine", lambda path, **kwargs: made.update(kwargs))
    model = _model(tok)
    for placement in ("colocated", "separate"):
        engine_spec("vllm").build(_context(model, tok, "unused", placement=placement, free_cache_engine=True))
        assert made["colocated"] is (placement == "colocated") and made["load_format"] == "dummy"


def test_what_the_adapter_gives_vllm_llm_are_engine_args(built) -> None:
    import vllm

    _, engine, _ = built
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    assert set(engine.llm_kwargs) <= fields, set(engine.llm_kwargs) - fields
    assert {"load_format", "disable_custom_all_reduce", "dtype"} <= fields
    assert engine.llm_kwargs["dtype"] == "float32" and engine.dtype == torch.float32


def test_keeping_the_kv_in_flight_schedules_synchronously_and_recomputing_leaves_vllm_s_default(built) -> None:
    import vllm

    from conveyor.rollout.vllm import in_flight_scheduling

    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    assert in_flight_scheduling("keep") == {"async_scheduling": False} and "async_scheduling" in fields
    assert in_flight_scheduling("recompute") == {}
    _, engine, _ = built  # built with the default, recompute: vLLM decides
    assert "async_scheduling" not in engine.llm_kwargs


def test_the_engine_dtype_is_bf16_on_a_gpu_unless_set_and_the_model_s_on_a_cpu() -> None:
    assert RolloutConfig().engine_dtype("float32", "cuda") == "bfloat16"
    assert RolloutConfig().engine_dtype("float32", "cpu") == "float32"
    assert RolloutConfig(dtype="float32").engine_dtype("float32", "cuda") == "float32"
    assert RolloutConfig(dtype="bfloat16").engine_dtype("float32", "cpu") == "bfloat16"


def test_the_sync_casts_each_tensor_to_the_engine_s_dtype_before_it_leaves() -> None:
    fp32 = torch.randn(4, 3)
    named = [("w", fp32), ("steps", torch.arange(3)), ("h", torch.randn(2, dtype=torch.bfloat16))]
    seen = []

    def source():
        for item in named:
            seen.append(item[0])
            yield item

    out = cast_weights(source(), torch.bfloat16)
    assert seen == []  # lazy: one tensor at a time
    got = dict(out)
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], fp32.to(torch.bfloat16))
    assert got["steps"].dtype == torch.int64  # integer tensors keep their dtype
    assert got["h"].data_ptr() == named[2][1].data_ptr()  # already at the dtype: no copy
    assert dict(cast_weights(iter(named), None))["w"].dtype == torch.float32


def test_the_rollout_group_sends_at_the_replica_s_dtype() -> None:
    from conveyor.weights import staged_copy

    fp32 = torch.randn(3)
    assert staged_copy(fp32, torch.bfloat16).dtype == torch.bfloat16
    same = staged_copy(fp32, torch.float32)
    assert torch.equal(same, fp32) and same.data_ptr() != fp32.data_ptr()  # a copy the update cannot change


def test_workers_in_other_processes_get_picklable_buckets_of_whole_layers(built, tok) -> None:
    """vLLM's mp and ray executors pickle collective_rpc's arguments: a generator does not pickle. Forced onto the
    in-process engine, the bucketed path's calls must pickle, and several reload calls must leave it serving."""
    from conveyor.rollout.vllm import executor_in_process, reload_vllm

    model, engine, _ = built
    assert executor_in_process(engine.llm)  # this engine's worker is in this process: the lazy stream path
    trained = _model(tok).eval()
    trained.load_state_dict(model.state_dict())
    _perturb(trained, 7)
    calls = []
    real = engine.llm.collective_rpc

    def recording(method, args=(), **kwargs):
        pickle.dumps(args)  # what vLLM's message queue does to them
        calls.append([name for name, _ in args[0]])
        return real(method, args=args, **kwargs)

    with pytest.raises(TypeError):  # what reached vLLM's mp executor before: the lazy stream itself
        pickle.dumps((iter_weights(trained),))
    engine.llm.collective_rpc = recording
    try:
        named = engine_names(cast_weights(iter_weights(trained), engine.dtype), model_type="qwen3")
        reload_vllm(engine.llm, named, bucket_bytes=64 << 10, in_process=False)
    finally:
        del engine.llm.collective_rpc
    engine.llm.reset_prefix_cache()
    assert len(calls) > 2
    layers = [{n.split(".layers.")[1].split(".")[0] for n in names if ".layers." in n} for names in calls]
    assert all(not (a & b) for i, a in enumerate(layers) for b in layers[i + 1 :])  # no layer in two calls
    gap, same = _gap(engine, trained, tok)
    assert gap < LOGP_TOL and same
    engine.update_weights(model.state_dict().items(), version=0)


def test_layer_buckets_keep_each_layer_whole_within_the_size() -> None:
    from conveyor.rollout.vllm import layer_buckets

    t = torch.zeros(256)  # 1 KiB
    named = [("model.embed_tokens.weight", t)] + [(f"model.layers.{i}.{p}", t) for i in range(3) for p in "abc"]
    out = list(layer_buckets(iter(named), 3 << 10))  # a layer fills a bucket; the embeddings do not
    assert [[n for n, _ in b] for b in out] == [
        [named[0][0]],
        [n for n, _ in named[1:4]],
        [n for n, _ in named[4:7]],
        [n for n, _ in named[7:]],
    ]
    assert [len(b) for b in layer_buckets(iter(named), 1 << 20)] == [10]
    with pytest.raises(ValueError, match="model.layers.0 do not come together"):
        list(layer_buckets(iter(named + [("model.layers.0.d", t)]), 1 << 20))


def test_tensor_parallel_without_a_trainer_world_runs_vllm_s_multiprocess_executor(built, tmp_path) -> None:
    """The case the bucketed path is for: vLLM's own choice of executor for tp 2 outside a trainer's world."""
    from vllm.config import ParallelConfig

    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend not in ("uni", "external_launcher")


class _Actor:
    """The actor's two sync endpoints over a trainer model: its optimizer-step count and its weight stream."""

    def __init__(self, model, **_):
        self.model, self.version = model, 0

    def weights_version(self) -> int:
        return self.version

    def weight_stream(self):
        return iter_weights(self.model)


class _Replica:
    """A rollout worker's two endpoints over the real engine; after each generation the engine is left as vLLM's
    level-2 sleep leaves the adapter (`VLLMEngine.sleep`: no weights, version unknown), which the CPU build lacks."""

    def __init__(self, engine, prompts, **_):
        self.engine, self.prompts, self.loads = engine, prompts, 0

    def load_weights(self, named, version):
        self.loads += 1
        return self.engine.update_weights(named, version=version)

    def generate_sequences(self, meta):
        _greedy(self.engine, *self.prompts)
        self.engine.holds_weights, self.engine.weights_version = False, None
        return meta


def test_the_rollout_group_syncs_again_after_a_sleep_released_the_weights(built, tok) -> None:
    from conveyor.workers.placement.group import LocalWorkerGroup, WorkerSpec
    from conveyor.workers.placement.roles import ActorGroup, ReplicaGroup

    model, engine, _ = built
    actor = ActorGroup(LocalWorkerGroup(WorkerSpec("actor", _Actor, {"model": model})))
    replica = LocalWorkerGroup(WorkerSpec("rollout", _Replica, {"engine": engine, "prompts": _prompts(tok)}))
    group = ReplicaGroup(replica, actor, bucket_bytes=1 << 20)
    assert group.dtype == torch.float32  # the in-process replica's engine says what it holds
    meta = KVBatchMeta(keys=["a"], partition_id="p", fields=[], tags=[{}], extra_info={})
    try:
        # Validation, then step 1's rollout, at the same actor version: the second must sync again.
        for _ in range(3):
            group.generate_sequences(meta)
        assert replica.worker.loads == 3
    finally:
        engine.update_weights(model.state_dict().items(), version=0)
