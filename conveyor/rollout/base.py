"""The rollout engine interface: what every engine takes, returns, declares and is built from.

An engine (`GenerationEngine`) turns left-padded prompts into sampled
responses. Every engine takes the same `SamplingParams` and returns the same
`GenerationOutput`, with one routing convention (`mask_unfed_routing`), and
declares what it can do on a device (`EngineCapabilities`). The agent loop,
the actor worker and the run plan talk to engines through this module only;
none of them tests an engine's name.

`ROLLOUT_ENGINES` maps `actor_rollout_ref.rollout.name` to an `EngineSpec`
(`register_rollout_engine` adds one, from a `trainer.plugins` file too):
the module that implements the engine (imported only when the engine is
checked or built, so choosing among engines imports none of them), its
declared capabilities on a device, and the module's own hooks:
`validate_config(cfg)` for the engine's keys, `check_servable(...)` for a
model it cannot serve, and `build_engine(context)` to build one in a worker
from an `EngineContext`.

It deliberately does not place engines (the worker group does) or move
weights between processes (`conveyor.weights`).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from conveyor.registry import lookup, registrar

__all__ = [
    "served_dtype",
    "EngineCapabilities",
    "EngineContext",
    "EngineSpec",
    "ROLLOUT_ENGINES",
    "GenerationEngine",
    "GenerationOutput",
    "SamplingParams",
    "engine_spec",
    "mask_unfed_routing",
    "register_rollout_engine",
]


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
    """What one rollout engine can do on one device."""

    returns_routing: bool  # it reports each fed token's routed experts (routed_experts), for R3 and the metrics
    stop_sequences: bool  # it stops at token sequences (what the multi-turn agent loop needs)
    interruptible: bool  # it calls a hook between tokens that may change the weights (partial rollouts)
    shares_trainer_modules: bool  # it samples from the very modules and numerics the actor trains
    multi_rank: bool  # one engine per actor rank works
    # Its routers choose experts with the actor's loss-free balancing bias (router.bias_update_rate), which
    # reaches it with the weights (a buffer beside each router's weight).
    selection_bias: bool = False
    # It claims rollout.gpu_memory_utilization of each GPU for its own weights and KV cache (and sleeps to give it
    # back when rollout.free_cache_engine): the memory accounting sizes it (workers/training/memory_budget.py).
    claims_gpu_fraction: bool = False


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch: the one copy of the sampling defaults every engine and the agent loop use.

    `top_k` 0 (or -1), `top_p` 1 and `min_p` 0 mean no truncation (applied in vLLM's order: temperature, min-p,
    top-k, top-p; `conveyor.algos.sampling_mask`); `do_sample=False` is greedy decoding, scored at
    temperature 1. A row stops at EOS, at `max_new_tokens`, or once its tokens end with one of
    `stop_sequences` (token-id lists), which stays in the response like EOS.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    do_sample: bool = True
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    capture_routing: bool = False  # return routed_experts where the model is MoE and the engine can
    capture_router_margins: bool = False  # with capture_routing: also router_margins, where the engine can

    def __post_init__(self) -> None:
        # Lists from callers become tuples: the params are hashable and cannot change under an engine.
        object.__setattr__(self, "stop_sequences", tuple(tuple(int(i) for i in s) for s in self.stop_sequences))
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"SamplingParams: `max_new_tokens` must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"SamplingParams: `temperature` must be > 0 when sampling, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams: `top_p` must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams: `min_p` must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams: `top_k` must be >= 0 (or -1 for off), got {self.top_k}")
        if any(not s for s in self.stop_sequences):
            raise ValueError("SamplingParams: a stop sequence is empty; give at least one token id")

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (no sampling, no truncation, scored at temperature 1)."""
        return not self.do_sample

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` (e.g. a smaller max_new_tokens for the agent loop's later turns)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, eq=False)
class GenerationOutput(Mapping):
    """What every engine returns for B left-padded prompts of width P, read like a dict of its present fields.

    `responses` (B, R) long, right-padded with the pad token; `response_mask` (B, R) bool, through EOS (for
    multi-turn, the model's tokens); `rollout_log_probs` (B, R) float32, the sampled tokens' log-probs, 0 off
    the mask; `routed_experts` (B, P+R, L, K) integer, -1 where unknown (see `mask_unfed_routing`), or None;
    `router_margins` (B, P+R, L) float, each fed token's gap between its k-th and (k+1)-th router logit, NaN
    where the routing is unknown, or None.
    The agent loop adds `tool_rewards` (B,) and `metrics`. R is the number of steps taken (<= max_new_tokens).
    The agent gateway may return more rows than prompts (a session cut into several samples): `source_rows` (B',)
    gives each row's prompt row, `prompts` / `prompt_mask` (B', P) each row's own prompt columns, and
    `sample_fields` more per-row fields to write (tensors with B' rows, or lists of B' values).
    """

    responses: Tensor
    response_mask: Tensor
    rollout_log_probs: Tensor
    routed_experts: Tensor | None = None
    router_margins: Tensor | None = None
    tool_rewards: Tensor | None = None
    metrics: dict[str, float] | None = None
    prompts: Tensor | None = None
    prompt_mask: Tensor | None = None
    source_rows: Tensor | None = None
    sample_fields: dict[str, Any] | None = None

    def _present(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str) -> Any:
        value = getattr(self, key, None) if key in _OUTPUT_FIELDS else None
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())

    def to(self, device: torch.device | str) -> GenerationOutput:
        """The same output with its tensors on `device`."""
        moved = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.items()}
        return GenerationOutput(**moved)

    def replace(self, **changes: Any) -> GenerationOutput:
        """A copy with `changes`."""
        return dataclasses.replace(self, **changes)


_OUTPUT_FIELDS = frozenset(f.name for f in dataclasses.fields(GenerationOutput))


def mask_unfed_routing(routed: Tensor, prompt_mask: Tensor, span_lengths: Tensor) -> Tensor:
    """`routed` (B, P+R, L, K) with -1 wherever a token was never routed: the one routing rule of every engine.

    Known: the prompt's real tokens, and every response token up to, not including, the last of the row's
    span (`span_lengths` (B,), the response tokens through the last model token): the last sampled token
    is never fed through the model. Unknown (-1): left pads, that last token, the pads after it, and any
    (token, layer) whose K experts are all one id (K > 1), which no top-k router picks: an engine's
    placeholder for a token it did not compute (a prefix-cache hit, say).
    """
    batch, width = routed.shape[:2]
    prompt_len = prompt_mask.shape[1]
    steps = width - prompt_len
    fed = torch.arange(steps, device=routed.device).unsqueeze(0) < (span_lengths.to(routed.device).view(-1, 1) - 1)
    known = torch.cat([prompt_mask.to(routed.device).bool(), fed], dim=1)[:, :, None]
    if routed.shape[-1] > 1:
        known = known & ~(routed == routed[..., :1]).all(dim=-1)
    return routed.masked_fill(~known[..., None], -1)


class GenerationEngine(abc.ABC):
    """One rollout engine in one process: generate, take new weights, sleep and wake, close.

    `capabilities` are the engine's on its device. `weights_version` is the actor's optimizer-step count of
    the weights it serves (None: unknown, e.g. after a sleep that released them): the worker syncs when it
    differs from its own.
    """

    capabilities: EngineCapabilities
    pad_token_id: int
    eos_token_id: int
    weights_version: int | None = None

    @abc.abstractmethod
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        interrupt: Callable[[Any], bool] | None = None,
        synced: Callable[[bool], bool] | None = None,
    ) -> GenerationOutput:
        """Sample per left-padded prompt (`input_ids`, `attention_mask`: (B, P)) under `params`.

        `generator` seeds the sampling (on the engine's device). `interrupt` (interruptible engines only) is
        called between sampling steps with the tokens sampled so far: one int where every row advances together
        (hf), a list of one count per row where they do not (vllm); True means the weights changed and the rest
        of the response comes from the new ones (`rollout.in_flight_kv`: over a recomputed or a kept KV cache).
        `synced` (engines that share the trainer's modules only) makes every rank step until all are done.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int | None = None) -> float:
        """Load the trainer's weights (Hugging Face names; consumed one at a time) in place; returns seconds."""

    def sleep(self) -> None:
        """Release the engine's device memory between rollouts (no-op where it holds none of its own)."""

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Reclaim what `sleep` released: `tags` "weights" or "kv_cache", or both (None)."""

    def close(self) -> None:
        """Release what the engine holds outside Python's reach (threads, process groups)."""

    def check_call(self, params: SamplingParams, *, interrupt: Any = None, synced: Any = None) -> None:
        """Refuse (ValueError) what this engine does not declare: stop sequences, interrupts, rank sync."""
        caps, name = self.capabilities, type(self).__name__
        if params.stop_sequences and not caps.stop_sequences:
            raise ValueError(f"{name} does not stop at token sequences")
        if interrupt is not None and not caps.interruptible:
            raise ValueError(f"{name} cannot be interrupted between tokens (partial rollouts)")
        if synced is not None and not caps.shares_trainer_modules:
            raise ValueError(f"{name} does not decode over the trainer's shards (`synced`)")


@dataclasses.dataclass(frozen=True)
class EngineContext:
    """What a worker gives an engine module's `build_engine`: the trainer's model and the run's settings."""

    model_path: str  # the checkpoint the actor loaded (an engine with its own copy loads it)
    model: torch.nn.Module  # the actor's module (an engine that shares the trainer's modules samples from it)
    tokenizer: Any
    rollout: Any  # actor_rollout_ref.rollout (RolloutConfig)
    model_dtype: str  # actor_rollout_ref.model.dtype
    trust_remote_code: bool
    max_model_len: int | None  # the run plan's (engines that hold a KV cache of their own)
    seed: int  # trainer.seed; an engine adds the rank for its own stream
    rank: int
    world_size: int
    device: torch.device
    lean: Any = None  # the actor's LeanForward, or None (conveyor.models.lean)
    moe: Any = None  # the actor's MoEInfo, or None for a dense model
    lm_head_fp32: bool = False  # actor_rollout_ref.model.lm_head_fp32: the engine's LM head computes in float32


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """A registered rollout engine: its name, where it lives, and its capabilities on a device."""

    name: str
    module: str
    capabilities: Callable[[str], EngineCapabilities]

    def _hook(self, name: str) -> Callable[..., Any] | None:
        return getattr(importlib.import_module(self.module), name, None)

    def validate_config(self, cfg: Any) -> None:
        """The engine's own checks of a config (`module.validate_config`): a ConfigError naming the key."""
        check = self._hook("validate_config")
        if check is not None:
            check(cfg)

    def check_model(
        self, hf_config: Any, *, device: str, max_model_len: int | None, source: str, length_key: str
    ) -> None:
        """Refuse (ValueError) a model this engine cannot serve, before anything is built (`module.check_servable`).

        An engine whose module defines no `check_servable` serves what the trainer can run.
        """
        check = self._hook("check_servable")
        if check is not None:
            check(hf_config, device=device, max_model_len=max_model_len, source=source, length_key=length_key)

    def build(self, context: EngineContext) -> GenerationEngine:
        """The engine, built by its module's `build_engine(context)` in the calling worker's process."""
        build = self._hook("build_engine")
        if build is None:
            raise TypeError(f"rollout engine module {self.module} defines no build_engine(context)")
        return build(context)


def _hf(device: str) -> EngineCapabilities:
    return EngineCapabilities(
        returns_routing=True,
        stop_sequences=True,
        interruptible=True,
        shares_trainer_modules=True,
        multi_rank=True,
        selection_bias=True,
    )


def _vllm(device: str) -> EngineCapabilities:
    # vLLM returns routed experts from its V2 model runner only, which runs on CUDA.
    return EngineCapabilities(
        returns_routing=torch.device(device).type == "cuda",
        stop_sequences=True,
        interruptible=True,
        shares_trainer_modules=False,
        multi_rank=True,
        claims_gpu_fraction=True,
    )


ROLLOUT_ENGINES: dict[str, EngineSpec] = {}
"""`actor_rollout_ref.rollout.name` -> the engine's `EngineSpec`; the config's choices and the conformance suite's."""


def register_rollout_engine(spec: EngineSpec, *, overwrite: bool = False) -> EngineSpec:
    """Make `spec` selectable as actor_rollout_ref.rollout.name=<its name> (e.g. from a `trainer.plugins` file)."""
    if not isinstance(spec, EngineSpec):
        raise ValueError(f"register_rollout_engine takes an EngineSpec, got {type(spec).__name__}")
    return registrar(ROLLOUT_ENGINES, spec.name, "rollout engine", overwrite=overwrite)(spec)


register_rollout_engine(EngineSpec("hf", "conveyor.rollout.hf", _hf))
register_rollout_engine(EngineSpec("vllm", "conveyor.rollout.vllm", _vllm))


def engine_spec(name: str) -> EngineSpec:
    """The registered engine `name`; a ValueError naming the key and the valid names otherwise."""
    return lookup(ROLLOUT_ENGINES, name, "actor_rollout_ref.rollout.name")


def served_dtype(rollout: Any, model_dtype: str, device_type: str) -> str:
    """The dtype `rollout.name`'s engine holds weights in on `device_type`: the model's where it samples from the
    trainer's own modules (its capability says so), else its own (`rollout.dtype`, else bf16 on CUDA)."""
    if engine_spec(rollout.name).capabilities(device_type).shares_trainer_modules:
        return model_dtype
    return rollout.engine_dtype(model_dtype, device_type)
