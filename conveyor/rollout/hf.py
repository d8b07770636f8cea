"""Batched sampling from a Hugging Face causal LM with a KV cache: the default rollout engine.

`HFEngine.generate` runs one prefill forward over the left-padded prompts and
then one single-token forward per step with a `DynamicCache`, in a decode loop
of our own rather than `model.generate`: it records exactly what the trainer
needs (per-token log-probs, routing aligned with the sequence) and carries
none of generate's per-step machinery (logits processors, stopping criteria,
kwargs plumbing, a rebuilt 4-D attention mask). Output buffers are allocated
once, there is one host sync per step (not per row), and top-k / top-p
filtering only runs when enabled. On a CPU the rollout is most of a training
step; `benchmarks/rollout.py` compares the two.

A row stops at EOS, at `max_new_tokens`, or once its tokens end with one of
the caller's `stop_sequences` (the multi-turn loop, `agent_loop`, ends a turn
at a tool call this way).

What it returns is what the trainer needs: right-padded `responses`, a
`response_mask` up to and including EOS, the log-prob of every sampled token
(`rollout_log_probs`), and for MoE models on request the expert ids each
token was routed to (`routed_experts`).

`rollout_log_probs` are taken under the distribution each token was sampled
from: `softmax(logits / temperature)` after min-p / top-k / top-p truncation
(vLLM's rule and order, `conveyor.algos.sampling_mask`), as vLLM's
`processed_logprobs` are. The trainer's forward replays the same mask
(`rollout.sampling_mask`), so the on-policy ratio is 1 up to float rounding
with or without truncation. Greedy decoding scores under temperature 1.

Given a `LeanForward` (`conveyor.models.lean`; the worker passes one for
Qwen3 and Qwen3-MoE unless `actor_rollout_ref.model.forward_impl` is hf), the
prefill runs once per distinct prompt and the decode steps use its KV cache;
otherwise the Hugging Face forward runs with a `DynamicCache`.

With `actor_rollout_ref.rollout.exact` the log-probs a run keeps are not
these: the actor overwrites them with its old-log-prob forward's, bitwise;
`validate_config` refuses the settings under which that would misreport
(another rollout dtype, bypass mode, off-policy batches).

It deliberately does not batch requests across calls, page the cache, or
serve; faster engines belong in sibling modules of this package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from conveyor.algos.sampling_mask import Truncation, truncate
from conveyor.config.rollout import IN_FLIGHT_KV
from conveyor.models.lean import LeanDecodeState, LeanForward
from conveyor.models.moe_routing import MoEInfo, RoutingRecorder, moe_info
from conveyor.models.packing import sdpa_compatible
from conveyor.models.vision import VisionBatch, refuse_pads_without_pixels, unplaceholder
from conveyor.rollout.base import (
    EngineContext,
    GenerationEngine,
    GenerationOutput,
    SamplingParams,
    engine_spec,
    mask_unfed_routing,
)
from conveyor.weights.local import into_model, place

__all__ = ["HFEngine", "build_engine", "validate_config"]


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The forward keyword that takes the KV cache: `cache` in recent transformers, `past_key_values` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(model: torch.nn.Module) -> DynamicCache:
    config = getattr(model, "config", None)
    try:
        return DynamicCache(config=config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def _filter_top_k_top_p(logits: Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> Tensor:
    """`logits` (B, V) with everything outside the min-p / top-k / nucleus set to -inf, by vLLM's rule (at least
    one token kept; `conveyor.algos.sampling_mask`)."""
    return truncate(logits, Truncation.of(top_k, top_p, min_p))


def _sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of `probs` (B, V), by inverting its cumulative distribution with one uniform per row."""
    # torch.multinomial draws an exponential per vocabulary entry; one uniform
    # per row is far cheaper, and exact up to float rounding of the prefix sums.
    cdf = probs.cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype)
    # (1 - u) lies in (0, 1], so the threshold lies in (0, total]: the first
    # entry reaching it has positive probability, and it always exists.
    threshold = (1.0 - u) * cdf[:, -1:]
    return (cdf < threshold).sum(dim=-1).clamp_(max=probs.shape[-1] - 1)


@dataclass(frozen=True)
class _Sampler:
    """How to pick the next token from logits, and under which distribution to score it."""

    temperature: float
    top_k: int
    top_p: float
    do_sample: bool
    generator: torch.Generator | None
    min_p: float = 0.0

    def filters(self, vocab_size: int) -> bool:
        """Whether min-p / top-k / top-p truncation changes anything at this vocabulary size."""
        return self.do_sample and ((0 < self.top_k < vocab_size) or self.top_p < 1.0 or self.min_p > 0.0)

    def __call__(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """`logits` (B, V) -> (token (B,) long, log_probs (B, V) float32 of the tempered, truncated softmax it
        sampled from)."""
        logits = logits.float()
        if not self.do_sample:
            return logits.argmax(dim=-1), torch.log_softmax(logits, dim=-1)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        if self.filters(logits.shape[-1]):
            logits = _filter_top_k_top_p(logits, self.top_k, self.top_p, self.min_p)
        logp = torch.log_softmax(logits, dim=-1)
        return _sample(logp.exp(), self.generator), logp


class HFEngine(GenerationEngine):
    """Batched sampling with a KV cache from a Hugging Face causal LM (`model`), in our own decode loop."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        eos_token_id: int,
        lean: LeanForward | None = None,
        in_flight_kv: str = "recompute",
    ) -> None:
        if pad_token_id is None:
            raise ValueError("HFEngine: `pad_token_id` is None; the tokenizer needs a pad token")
        if eos_token_id is None:
            raise ValueError("HFEngine: `eos_token_id` is None; the tokenizer needs an EOS token")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_token_id = int(eos_token_id)
        self._cache_kw = _cache_kwarg(model)
        self.capabilities = engine_spec("hf").capabilities(str(next(model.parameters()).device))
        # When given (a LeanForward over `model`), prefill and decode run through it.
        self.lean = lean
        if in_flight_kv not in IN_FLIGHT_KV:
            raise ValueError(f"HFEngine: in_flight_kv must be one of {IN_FLIGHT_KV}, got {in_flight_kv!r}")
        # After an interrupt that changed the weights: "recompute" the cache with them, or "keep" the old one.
        self.in_flight_kv = in_flight_kv

    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        interrupt: Callable[[int], bool] | None = None,
        synced: Callable[[bool], bool] | None = None,
        vision: VisionBatch | None = None,
    ) -> GenerationOutput:
        """Sample up to `params.max_new_tokens` per left-padded prompt (`input_ids`, `attention_mask`: (B, P)).

        `interrupt`, when given, is called after every sampled token that is not the last, with the number
        of tokens sampled so far; when it returns True (it changed the model's weights, say) the KV cache
        is recomputed from the prompts and the tokens so far before the next token is sampled, so the rest
        of the response comes from the weights the model has now (a partial rollout); with
        `in_flight_kv="keep"` the old cache is kept and decoding goes on over it with the new weights.
        `synced`, when given, is called once per step with whether this rank is done and answers whether
        every rank is: decoding goes on until the last rank is done, so every rank runs the same number of
        forwards, as forwards over FSDP2 shards (each one gathers the layers in turn) need. It runs the Hugging
        Face forward (the lean forward bypasses the module hooks that gather the layers).
        Returns a `GenerationOutput` (`routed_experts` with `params.capture_routing` on an MoE model, int16);
        `generator` must live on the model's device. `vision`: the prompts' images and M-RoPE positions (a
        vision-language model): the prefill runs the vision tower, every forward takes 3-row positions.
        """
        _check_inputs(input_ids, attention_mask)
        if vision is None:
            refuse_pads_without_pixels(input_ids, getattr(self.model, "config", None), "HFEngine.generate")
        if vision is not None and self.lean is not None:
            raise ValueError(
                "HFEngine.generate: prompts with images do not take the lean forward; set "
                "actor_rollout_ref.model.forward_impl=hf"
            )
        if synced is not None and interrupt is not None:
            raise ValueError(
                "HFEngine.generate: `synced` and `interrupt` do not combine (a partial rollout runs on one rank)"
            )
        lean = None if synced is not None else self.lean
        model = self.model
        device = next(model.parameters()).device
        input_ids = input_ids.to(device=device, dtype=torch.long)
        prompt_mask = attention_mask.to(device=device, dtype=torch.long)
        if not bool(prompt_mask.any(dim=-1).all()):
            raise ValueError("HFEngine.generate: a row of `attention_mask` is all zeros; every prompt needs a token")
        if not bool((prompt_mask[:, 1:] >= prompt_mask[:, :-1]).all()):
            raise ValueError(
                "HFEngine.generate: `attention_mask` has padding after a real token; pad prompts on the left "
                "(tokenizer.padding_side = 'left')"
            )
        sampler = _Sampler(
            float(params.temperature),
            int(params.top_k),
            float(params.top_p),
            bool(params.do_sample),
            generator,
            float(params.min_p),
        )
        info = moe_info(model) if params.capture_routing else None

        was_training = model.training
        model.eval()
        try:
            hooks = info is not None and lean is None
            margins = info is not None and bool(params.capture_router_margins)
            with RoutingRecorder(model, margins=margins) if hooks else contextlib.nullcontext() as recorder:
                return self._decode(
                    input_ids,
                    prompt_mask,
                    int(params.max_new_tokens),
                    sampler,
                    recorder,
                    info,
                    _stop_tensors(params.stop_sequences, device),
                    interrupt,
                    synced,
                    lean,
                    margins,
                    vision,
                )
        finally:
            model.train(was_training)

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int | None = None) -> float:
        """Copy the given tensors into the model's own (by Hugging Face name); returns the seconds taken.

        Colocated with the actor the engine samples from the trainer's own modules and is never given any; a
        separate replica (`conveyor.workers.ranks.replica`) holds a copy, which this keeps in step.
        """
        import time

        t0 = time.perf_counter()
        own = {
            **dict(self.model.named_parameters(remove_duplicate=False)),
            **dict(self.model.named_buffers(remove_duplicate=False)),
        }
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = own.get(name)
                if target is None:
                    raise KeyError(f"HFEngine.update_weights: the model has no tensor {name!r}")
                place(target, tensor)  # a tensor `weight_target` placed arrived in place
        self.weights_version = version
        return time.perf_counter() - t0

    def weight_targets(self) -> Callable[[str, torch.dtype, tuple[int, ...]], Tensor | None]:
        """Where a weight channel may receive a large tensor straight into (`conveyor.weights.iter_received`'s
        `into`): the model's own tensor of that name, as it is now (ask again for each sync)."""
        return into_model(self.model)

    def _decode(
        self,
        input_ids: Tensor,
        prompt_mask: Tensor,
        steps_max: int,
        sampler: _Sampler,
        recorder: RoutingRecorder | None,
        info: MoEInfo | None,
        stops: Sequence[Tensor] = (),
        interrupt: Callable[[int], bool] | None = None,
        synced: Callable[[bool], bool] | None = None,
        lean: LeanForward | None = None,
        record_margins: bool = False,
        vision: VisionBatch | None = None,
    ) -> GenerationOutput:
        """The prefill forward, then one forward per sampled token; the outputs of `generate`."""
        batch, prompt_len = input_ids.shape
        device = input_ids.device
        # Buffers are made outside inference mode so that callers may edit the
        # returned tensors in place; writing into them inside it is allowed.
        responses = torch.full((batch, steps_max), self.pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((batch, steps_max), dtype=torch.float32, device=device)
        response_mask = torch.zeros((batch, steps_max), dtype=torch.bool, device=device)
        routed = None
        if info is not None:
            routed = torch.full(
                (batch, prompt_len + steps_max, info.num_layers, info.top_k), -1, dtype=torch.int16, device=device
            )
        margins = None
        if routed is not None and record_margins:
            margins = torch.full((batch, prompt_len + steps_max, info.num_layers), math.nan, device=device)
        steps = 0
        # Not inference mode over FSDP2 shards: the all-gather buffers it would allocate there become inference
        # tensors, which the next forward outside inference mode (an old-log-prob pass) may not write into.
        with torch.no_grad() if synced is not None else torch.inference_mode():
            engine = self._engine(
                input_ids, prompt_mask, steps_max, recorder, routed is not None, lean, margins, vision
            )
            logits = engine.prefill()
            if routed is not None:
                routed[:, :prompt_len] = engine.pop_routing(margins, slice(0, prompt_len))
            finished = torch.zeros(batch, dtype=torch.bool, device=device)
            pad = torch.full((batch,), self.pad_token_id, dtype=torch.long, device=device)
            for t in range(steps_max):
                token, logp = sampler(logits)
                token = torch.where(finished, pad, token)
                responses[:, t] = token
                response_mask[:, t] = ~finished
                log_probs[:, t] = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1).masked_fill_(finished, 0.0)
                finished = finished | (token == self.eos_token_id)
                for stop in stops:
                    n = stop.numel()
                    if t + 1 >= n:
                        # A window of real tokens only: the mask is a prefix, so its first column decides.
                        hit = (responses[:, t + 1 - n : t + 1] == stop).all(dim=-1) & response_mask[:, t + 1 - n]
                        finished = finished | hit
                steps = t + 1
                # One host sync per step (not per row) to stop early; the
                # forward below costs far more than this check.
                done = steps == steps_max or bool(finished.all())
                if synced is not None:
                    # A rank that is done keeps stepping (its rows ride along, masked) while another is not.
                    done = synced(done)
                if done:
                    break
                if interrupt is not None and interrupt(steps) and self.in_flight_kv == "recompute":
                    # Resume under the model's weights as they are now: one prefill over each row's prompt and
                    # tokens so far rebuilds the cache, exactly as if generation had started from that prefix.
                    # Rows that finished ride along (their outputs are unused, as in a decode step); their
                    # tokens after EOS count as real here, which changes no unfinished row.
                    sampled = responses[:, :steps]
                    prefix_mask = torch.cat([prompt_mask, prompt_mask.new_ones((batch, steps))], dim=1)
                    prefix_vision = None
                    if vision is not None:
                        # The prompt's pixels again, the tokens so far fed as decoding fed them (a sampled
                        # image pad as vision-end), each at the position decoding gave it.
                        sampled = unplaceholder(sampled, self.model.config)
                        positions = vision.sequence_positions(prefix_mask).permute(1, 0, 2)
                        prefix_vision = dataclasses.replace(vision, positions=positions)
                    prefix = torch.cat([input_ids, sampled], dim=1)
                    engine = self._engine(
                        prefix,
                        prefix_mask,
                        steps_max - steps,
                        recorder,
                        routed is not None,
                        lean,
                        margins,
                        prefix_vision,
                    )
                    logits = engine.prefill()
                    if routed is not None:
                        # Every position fed so far is routed again by the current weights: the routing of
                        # a position is always that of the cache the later tokens were sampled from.
                        routed[:, : prompt_len + steps] = engine.pop_routing(margins, slice(0, prompt_len + steps))
                    continue
                logits = engine.step(token, finished)
                if routed is not None:
                    at = prompt_len + t
                    routed[:, at] = engine.pop_routing(margins, slice(at, at + 1))[:, 0]

        mask = response_mask[:, :steps].contiguous()
        routed_out = (
            mask_unfed_routing(routed[:, : prompt_len + steps], prompt_mask, mask.sum(dim=-1))
            if routed is not None
            else None
        )
        margins_out = None
        if margins is not None and routed_out is not None:
            # The routing rule decides what is known: a margin counts exactly where its token's routing does.
            margins_out = margins[:, : prompt_len + steps].masked_fill((routed_out < 0).any(dim=-1), math.nan)
        return GenerationOutput(
            responses=responses[:, :steps].contiguous(),
            response_mask=mask,
            rollout_log_probs=log_probs[:, :steps].contiguous(),
            routed_experts=routed_out,
            router_margins=margins_out,
        )

    def _engine(
        self,
        input_ids: Tensor,
        prompt_mask: Tensor,
        steps_max: int,
        recorder: RoutingRecorder | None,
        record: bool,
        lean: LeanForward | None,
        margins: Tensor | None = None,
        vision: VisionBatch | None = None,
    ) -> _LeanSteps | _HFSteps:
        if lean is not None:
            return _LeanSteps(lean, input_ids, prompt_mask, steps_max, record, margins is not None)
        return _HFSteps(self.model, self._cache_kw, input_ids, prompt_mask, steps_max, recorder, vision)


class _HFSteps:
    """The prefill and decode forwards through the Hugging Face model with a `DynamicCache`."""

    def __init__(
        self,
        model: PreTrainedModel,
        cache_kw: str,
        input_ids: Tensor,
        prompt_mask: Tensor,
        steps_max: int,
        recorder: RoutingRecorder | None,
        vision: VisionBatch | None = None,
    ) -> None:
        self.model, self.cache_kw, self.recorder = model, cache_kw, recorder
        self.vision = vision
        self.input_ids, self.prompt_mask = input_ids, prompt_mask
        batch, self.prompt_len = input_ids.shape
        # The attention mask of every step is a prefix of this one: the prompt's,
        # then ones (rows that finished keep attending; their outputs are unused).
        full_mask = torch.ones((batch, self.prompt_len + steps_max), dtype=torch.long, device=input_ids.device)
        full_mask[:, : self.prompt_len] = prompt_mask
        # With sdpa, a ready (B, 1, 1, K) boolean mask is used as is, which
        # saves rebuilding the 4-D mask from the 2-D one at every step.
        self.step_masks = full_mask.bool()[:, None, None, :] if self._can_pass_4d_mask() else full_mask
        self.cache = _new_cache(model)
        self.t = 0
        self.next_pos: Tensor | None = None

    def prefill(self) -> Tensor:
        """Last-position logits (B, V) of the prompts."""
        # Left padding: a row's first real token sits at position 0, as in
        # the trainer's forward over prompt + response.
        position_ids = (self.prompt_mask.cumsum(dim=-1) - 1).clamp_(min=0)
        self.next_pos = position_ids[:, -1:] + 1
        if self.vision is not None:
            # M-RoPE: the prompt's 3-row positions from stage 1; a decoded token's are its index + the rope delta
            # on every row (what the trainer's forward gives the response, `VisionBatch.sequence_positions`).
            vision = self.vision
            self.next_pos = (self.next_pos + vision.rope_delta.view(-1, 1)).unsqueeze(0).expand(3, -1, -1)
            positions = vision.positions.permute(1, 0, 2)
            return self._forward(self.input_ids, self.prompt_mask, positions, **vision.model_kwargs())
        return self._forward(self.input_ids, self.prompt_mask, position_ids)

    def step(self, token: Tensor, finished: Tensor) -> Tensor:
        """Logits (B, V) after feeding `token` (B,); rows that `finished` are computed all the same."""
        assert self.next_pos is not None, "prefill first"
        if self.vision is not None:  # a sampled image-pad token has no features: fed as the trainer feeds it
            token = unplaceholder(token, self.model.config)
        logits = self._forward(token.unsqueeze(-1), self.step_masks[..., : self.prompt_len + self.t + 1], self.next_pos)
        self.t += 1
        self.next_pos = self.next_pos + 1
        return logits

    def pop_routing(self, margins: Tensor | None = None, columns: slice | None = None) -> Tensor:
        """Routing (B, S, L, K) of the latest forward; its router margins go to `margins[:, columns]` when given."""
        assert self.recorder is not None
        if margins is None:
            return self.recorder.pop()
        routing, gaps = self.recorder.pop_with_margins()
        margins[:, columns] = gaps
        return routing

    def _can_pass_4d_mask(self) -> bool:
        """Whether decode steps may take a boolean (B, 1, 1, K) padding mask instead of the 2-D one."""
        config = getattr(self.model, "config", None)
        if config is None or not sdpa_compatible(config):
            return False
        # Sliding-window or hybrid layers need masks that a padding mask alone does not express.
        if getattr(config, "sliding_window", None) is not None:
            return False
        layer_types = getattr(config, "layer_types", None) or []
        return all(kind == "full_attention" for kind in layer_types)

    def _forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, **pixels: Tensor) -> Tensor:
        """Last-position logits (B, V) of one forward that extends the cache (`pixels`: the prefill's images)."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: self.cache},
            **pixels,
        )
        return out.logits[:, -1, :]


class _LeanSteps:
    """The prefill and decode forwards through `LeanForward`: each distinct prompt is prefilled once."""

    def __init__(
        self,
        lean: LeanForward,
        input_ids: Tensor,
        prompt_mask: Tensor,
        steps_max: int,
        record: bool,
        record_margins: bool = False,
    ) -> None:
        self.lean, self.input_ids, self.prompt_mask = lean, input_ids, prompt_mask
        self.steps_max, self.record, self.record_margins = steps_max, record, record_margins
        self.state: LeanDecodeState | None = None

    def prefill(self) -> Tensor:
        """Last-position logits (B, V) of the prompts."""
        logits, self.state = self.lean.prefill(
            self.input_ids,
            self.prompt_mask,
            self.steps_max,
            record_routing=self.record,
            record_margins=self.record_margins,
        )
        return logits

    def step(self, token: Tensor, finished: Tensor) -> Tensor:
        """Logits (B, V) after feeding `token` (B,); rows that `finished` leave the cache (zero logits)."""
        assert self.state is not None, "prefill first"
        return self.lean.decode(self.state, token, finished)

    def pop_routing(self, margins: Tensor | None = None, columns: slice | None = None) -> Tensor:
        """Routing (B, S, L, K) of the latest forward; its router margins go to `margins[:, columns]` when given."""
        assert self.state is not None and self.state.routing, "no routing was recorded"
        if margins is not None:
            margins[:, columns] = self.state.margins.pop()
        return self.state.routing.pop()


def _stop_tensors(stop_sequences: Sequence[Sequence[int]], device: torch.device) -> list[Tensor]:
    """Each stop sequence as a (1, n) long tensor on `device`; ValueError for an empty one."""
    out = []
    for seq in stop_sequences:
        ids = [int(i) for i in seq]
        out.append(torch.tensor([ids], dtype=torch.long, device=device))
    return out


def _check_inputs(input_ids: Tensor, attention_mask: Tensor) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"HFEngine.generate: `input_ids` must be (B, P), got shape {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"HFEngine.generate: `attention_mask` shape {tuple(attention_mask.shape)} differs from "
            f"`input_ids` shape {tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("HFEngine.generate: `input_ids` has no prompt tokens")


def build_engine(context: EngineContext) -> HFEngine:
    """The hf engine of a worker: a decode loop over the actor's own modules (and its lean forward, if any)."""
    return HFEngine(
        context.model,
        pad_token_id=context.tokenizer.pad_token_id,
        eos_token_id=context.tokenizer.eos_token_id,
        lean=context.lean,
        in_flight_kv=context.rollout.in_flight_kv,
    )


def validate_config(cfg: Any) -> None:
    """The hf engine's checks of a config: what `rollout.exact` cannot hold to (a ConfigError naming the keys)."""
    from conveyor.config.fields import check

    arr = cfg.actor_rollout_ref
    ro, model = arr.rollout, arr.model
    if not ro.exact:
        return
    key = "actor_rollout_ref.rollout.exact"
    check(
        ro.dtype is None or ro.dtype == model.dtype,
        key,
        f"the hf rollout computes in the actor's dtype, so actor_rollout_ref.rollout.dtype={ro.dtype} differs "
        f"from what its log-probs are compared with (model.dtype={model.dtype}): set rollout.dtype=null or "
        "exact=false",
    )
    check(
        cfg.algorithm.rollout_correction.bypass_mode is not True,
        key,
        "exact=true takes the rollout's log-probs from the old-log-prob forward that "
        "algorithm.rollout_correction.bypass_mode=true skips: set bypass_mode=null or exact=false",
    )
    v1 = cfg.trainer.v1
    check(
        not (v1.is_async and v1.sampler.max_off_policy_threshold > 0),
        key,
        f"off-policy batches (trainer.v1.trainer_mode={v1.trainer_mode}, "
        f"trainer.v1.sampler.max_off_policy_threshold={v1.sampler.max_off_policy_threshold}) were sampled by an "
        "older policy than the old-log-prob forward scores them with: set max_off_policy_threshold=0 or exact=false",
    )
