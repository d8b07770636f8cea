"""The policy's log-prob forward, shared by the actor and the reference: response logits and log-probs of a batch.

`PolicyForward` wraps a loaded causal LM under its role's `TrainedModel`: the
lean forward where it applies (each group's shared prompt computed once), the
Hugging Face forward elsewhere: for a training forward that must run through
the strategy's hooks or activation checkpointing, and for every forward over
FSDP2 shards (the sharded module's own forward gathers one layer at a time;
the lean forward would need the whole model gathered). With packing on
(`use_remove_padding`) the Hugging Face forward runs on each micro-batch's
real tokens in one row (`conveyor.models.packing`), and the LM head and the
log-softmax on its response tokens only. It can replay given
routed experts and record the forward's own routing. `no_grad_log_probs`
runs it over micro-batches, as both the actor's old-log-prob forward and the
reference's forward do, of a fixed number of rows or up to a token budget
(`conveyor.workers.training.batching`); under a multi-rank strategy every rank runs as
many micro-batches as the busiest one (the extra ones are dropped).

With `fused` (`actor_rollout_ref.model.use_fused_kernels`)
the model's LM head computes the log-probs and entropy of the response tokens
(and Σπ², when the old-log-prob forward writes it) itself, block by block
(`conveyor.models.fused_head`): no (tokens, vocabulary) logits exist in the
forward or the backward. Otherwise log-probs and entropy
come from `logprobs_and_entropy` on the model's own logits, the temperature
applied per block: no float32 copy of the full-vocabulary logits is made here.
A caller's `truncation` (the rollout's top-k / top-p / min-p, `conveyor.algos.sampling_mask`)
is applied the same way on every path, padded, packed, lean, sequence-parallel and fused: per
block of rows, after the temperature; None (the reference's forward, a run without truncation)
leaves the full softmax.

Under Ulysses sequence parallelism (the strategy's `sequence_parallel_size` > 1) each rank runs the
packed forward on its slice of the row's tokens (`conveyor.workers.training.sequence_parallel`): the
LM head (fused or not) sees only the slice's predicting positions, and the per-token log-probs,
entropy, Σπ² and recorded routing are gathered over the group into whole rows. Replayed routing is
cut the same way: each rank replays its own tokens' experts.

What it deliberately does not do: read or write the data plane, or decide
whether routing is recorded or replayed (the caller's settings say).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict

from conveyor.algos.logprob import logprobs_and_entropy, sum_pi_squared_from_logits
from conveyor.algos.sampling_mask import Truncation, rollout_truncation
from conveyor.algos.trajectory import response_span
from conveyor.models.fused_head import fused_head_reason, fused_lm_head, head_sum_pi_squared, split_head_output
from conveyor.models.moe_routing import (
    RouterStats,
    RouterStatsRecorder,
    RoutingRecorder,
    replay_routing,
    routed_experts_dtype,
)
from conveyor.models.packing import PackedRows
from conveyor.models.vision import VisionBatch, refuse_pads_without_pixels, unplaceholder
from conveyor.workers.training.batching import TokenBudget, in_row_order, micro_batches, plan_micro_batches, take
from conveyor.workers.training.sequence_parallel import SequenceParallel, SequenceShard, group_budget
from conveyor.workers.training.trained_model import TrainedModel

__all__ = ["PolicyForward", "TokenStats", "sequence_inputs", "micro_batches", "replayed_truncation"]


class _Fuse(NamedTuple):
    """What a fused LM head computes in place of the logits: its `fused_lm_head` settings."""

    with_entropy: bool
    with_sum_pi_squared: bool
    temperature: float
    truncation: Truncation | None = None


class TokenStats(NamedTuple):
    """What a no-grad forward gives per response token (B, R), each masked; optional ones None when not asked for."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    sum_pi_squared: torch.Tensor | None  # Σ_v π_v² of the (temperature-scaled) distribution
    routing: torch.Tensor | None  # the recorded routing (B, P+R, L, K)


logger = logging.getLogger(__name__)


def replayed_truncation(rollout: Any) -> Truncation | None:
    """The rollout's sampling mask the policy's log-probs replay (`actor_rollout_ref.rollout`), or None: greedy
    decoding, no truncation set, or `sampling_mask.replay` off."""
    mask = getattr(rollout, "sampling_mask", None)
    return None if mask is not None and not mask.replay else rollout_truncation(rollout)


def padded_kwargs(
    td: TensorDict, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, config: Any
) -> dict[str, torch.Tensor]:
    """The padded forward's keywords; with images (`VISION_FIELDS` read), their pixels and 3-row M-RoPE positions
    (and the responses' sampled image-pad tokens fed as the engine fed them, `unplaceholder`)."""
    vision = VisionBatch.from_fields(td)
    if vision is None:
        refuse_pads_without_pixels(td["prompts"], config, "the padded forward")
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    prompt_len = td["prompts"].shape[1]
    input_ids = torch.cat([input_ids[:, :prompt_len], unplaceholder(input_ids[:, prompt_len:], config)], dim=1)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": vision.sequence_positions(attention_mask),
        **vision.model_kwargs(),
    }


def packed_kwargs(
    packed: PackedRows,
    td: TensorDict,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    config: Any,
) -> dict[str, Any]:
    """The packed forward's keywords; with images, their pixels and each sample's M-RoPE positions in the row.

    A Qwen-VL text model takes (4, 1, T) positions in a packed row: the plain text positions first (restarting
    at 0 per sequence, as the packed attention's bounds do), then the three M-RoPE rows of each sample, kept as
    the padded forward has them."""
    vision = VisionBatch.from_fields(td)
    if vision is None:
        refuse_pads_without_pixels(td["prompts"], config, "the packed forward")
        return packed.model_kwargs(input_ids, position_ids)
    prompt_len = td["prompts"].shape[1]
    input_ids = torch.cat([input_ids[:, :prompt_len], unplaceholder(input_ids[:, prompt_len:], config)], dim=1)
    rows = torch.cat([position_ids[None], vision.sequence_positions(attention_mask)])  # (4, B, S)
    kwargs = packed.model_kwargs(input_ids, position_ids)
    kwargs["position_ids"] = packed.pack(rows.permute(1, 2, 0)).permute(2, 0, 1)  # (1, T, 4) -> (4, 1, T)
    return {**kwargs, **vision.model_kwargs()}


def _refuse_sharded_vision(td: TensorDict) -> None:
    """Sequence parallelism does not cut images yet: say which key to change rather than lose them."""
    if VisionBatch.from_fields(td) is not None:
        raise ValueError(
            "prompts with images do not run under sequence parallelism yet; set "
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 (docs/vlm.md)"
        )


def sequence_inputs(td: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each (B, P+R), from left-padded prompts and right-padded responses."""
    input_ids = torch.cat([td["prompts"], td["responses"]], dim=1)
    # The span, not the mask: a multi-turn response's tool tokens are context (response_mask 0, attended to).
    attention_mask = torch.cat([td["prompt_mask"].long(), response_span(td["response_mask"]).long()], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


class PolicyForward:
    """Response logits and log-probs of `model` (held under `trained`), with `lean` the lean forward or None."""

    def __init__(
        self,
        model: torch.nn.Module,
        trained: TrainedModel,
        lean: Any,
        moe: Any,
        packed: bool = False,
        fused: bool = False,
    ):
        self.model, self.trained, self.lean, self.moe = model, trained, lean, moe
        # The Hugging Face forwards run packed (`conveyor.models.packing`; the model's attention set up for it).
        self.packed = packed
        reason = fused_head_reason(model) if fused else None
        if reason is not None:
            logger.info("actor_rollout_ref.model.use_fused_kernels: the log-probs come from the logits: %s", reason)
        # The LM head computes the log-probs itself (`conveyor.models.fused_head`), never holding the logits.
        self.fused = fused and reason is None
        # True while `update_replay` holds the replay hooks open (through the backward's recomputation).
        self._held_replay = False
        # The sequence-parallel group (None at size 1): packed rows are split by tokens over it.
        self.sp = SequenceParallel.of(trained.strategy)

    def uses_lean(self, train: bool = False) -> bool:
        """Whether a forward runs the lean forward: not over FSDP2 shards, nor through training hooks or
        checkpointing."""
        if self.lean is None or self.trained.strategy.sharded or self.sp is not None:
            return False
        return not (train and (self.trained.strategy.distributed or self.trained.checkpointing))

    @contextlib.contextmanager
    def update_replay(self, routed_experts: torch.Tensor | None, td: TensorDict):
        """Replay `routed_experts` in an update's Hugging Face forward over `td` *and* in its backward.

        Activation checkpointing recomputes each layer's forward inside `backward()`; the replay hooks
        must still be in force then, or the recomputed forward routes natively (and saves other
        tensors than the original did). Wrap the forward and its backward in this context.
        """
        if routed_experts is None or self.uses_lean(train=True):
            yield
            return
        if self.packed:  # each packed token replays the experts recorded for it
            _, attention_mask, _ = sequence_inputs(td)
            packed = PackedRows.from_masks(attention_mask, response_span(td["response_mask"]))
            routed_experts = packed.pack(routed_experts)
            if self.sp is not None:  # this rank's tokens only
                routed_experts = self.sp.shard(packed).local(routed_experts)
        with replay_routing(self.model, routed_experts):
            self._held_replay = True
            try:
                yield
            finally:
                self._held_replay = False

    def _hf_forward(
        self,
        td: TensorDict,
        routed_experts: torch.Tensor | None,
        record_routing: bool,
        train: bool,
        fuse: _Fuse | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, PackedRows | None, SequenceShard | None]:
        """The Hugging Face forward: logits predicting the response tokens, its routing (B, P+R, L, K), the packing
        and, under sequence parallelism, this rank's slice of it.

        Padded: logits (B, R, V). Packed (`self.packed`): logits (1, N, V) of the N response-span tokens, which
        `PackedRows.responses` places; replayed and recorded routing follow each packed token. Sequence parallel:
        logits (1, n, V) of the n of them in this rank's slice (`SequenceShard.mine`); the routing is the whole
        row's. `fuse`: the LM head returns the response tokens' log-probs [, entropy, Σπ²] (.., 1|2|3) in place
        of the logits.
        """
        input_ids, attention_mask, position_ids = sequence_inputs(td)
        resp_len = td["responses"].shape[1]
        packed = PackedRows.from_masks(attention_mask, response_span(td["response_mask"])) if self.packed else None
        shard = self.sp.shard(packed) if self.sp is not None and packed is not None else None
        held = routed_experts is None or self._held_replay  # `update_replay` installed the replay already
        if packed is not None:
            kwargs = packed_kwargs(packed, td, input_ids, attention_mask, position_ids, self.model.config)
            keep: int | torch.Tensor = packed.predict  # the LM head runs on the predicting positions only
            if shard is not None:  # ids and positions cut from the whole row, so positions stay the row's
                _refuse_sharded_vision(td)
                kwargs, keep = shard.model_kwargs(input_ids, position_ids), shard.keep
            if not held:
                routed_experts = packed.pack(routed_experts)
                if shard is not None:
                    routed_experts = shard.local(routed_experts)
        else:
            kwargs = padded_kwargs(td, input_ids, attention_mask, position_ids, self.model.config)
            keep = resp_len + 1  # only the positions that predict response tokens need the LM head
        replay = contextlib.nullcontext() if held else replay_routing(self.model, routed_experts)
        recorder = RoutingRecorder(self.model) if record_routing else None
        head: Any = contextlib.nullcontext()
        if fuse is not None:
            responses = td["responses"]
            if packed is not None:
                labels = responses[packed.rows, packed.cols][None]
                if shard is not None:
                    labels = labels[:, shard.mine]
            else:  # the last kept position predicts nothing: any label, dropped below
                labels = torch.cat([responses, responses.new_zeros(responses.shape[0], 1)], dim=1)
            head = fused_lm_head(
                self.model,
                labels,
                with_entropy=fuse.with_entropy,
                temperature=fuse.temperature,
                with_sum_pi_squared=fuse.with_sum_pi_squared,
                truncation=fuse.truncation,
            )
        with replay, recorder if recorder is not None else contextlib.nullcontext(), head:
            module = self.trained.forward_module if train else self.model
            out = module(**kwargs, use_cache=False, logits_to_keep=keep)
            own_routing = recorder.pop() if recorder is not None else None
        if packed is None:
            return out.logits[:, :-1, :], own_routing, None, None
        if own_routing is not None:
            if shard is not None:
                own_routing = shard.gather_row(own_routing)
            own_routing = packed.unpack(own_routing, -1)
        return out.logits, own_routing, packed, shard

    def response_logits(
        self, td: TensorDict, routed_experts: torch.Tensor | None, record_routing: bool, train: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, R, V) predicting each response token, and the forward's routing (B, P+R, L, K) when recorded.

        `train`: the update's forward, which under a multi-rank strategy must go through its wrapper.
        """
        # The update's forward goes through the strategy's hooks and the model's activation checkpointing,
        # neither of which the lean forward calls; FSDP2 shards are gathered only by the module's own forward.
        if self.uses_lean(train):
            return self.lean.response_logits(
                td["prompts"],
                td["prompt_mask"],
                td["responses"],
                response_span(td["response_mask"]),
                routed_experts=routed_experts,
                record_routing=record_routing,
            )
        if self.sp is not None:
            raise ValueError(
                "ulysses_sequence_parallel_size > 1 gathers per-token log-probs, never whole-vocabulary logits; "
                "a forward that needs the logits (distillation over the vocabulary) runs with the role's "
                "ulysses_sequence_parallel_size=1"
            )
        logits, own_routing, packed, _ = self._hf_forward(td, routed_experts, record_routing, train)
        if packed is not None:
            logits = packed.responses(logits[0], td["responses"].shape[1])
        return logits, own_routing

    def router_rows(self, td: TensorDict, train: bool = False) -> torch.Tensor | None:
        """Which rows the routers of a forward over `td` see are real tokens: (B*(P+R),) bool for the padded
        Hugging Face forward, None for the packed and the lean forwards (they feed real tokens only)."""
        if self.packed or self.uses_lean(train):
            return None
        return sequence_inputs(td)[1].reshape(-1).bool()

    def routing(self, td: TensorDict) -> torch.Tensor:
        """This forward's own routing (B, P+R, L, K) over `td`, no replay (its logits are not widened to (B, R, V))."""
        if self.uses_lean():
            return self.response_logits(td, None, record_routing=True)[1]
        return self._hf_forward(td, None, True, False)[1]

    def router_stats(self, td: TensorDict) -> RouterStats:
        """This forward's own routing and router health over `td` (no replay): `RouterStats` laid out (B, P+R, ...).

        The Hugging Face forward with the LM head on one position: the routers' logits are read by hooks, which
        the lean forward does not call. Pads carry -1 ids and NaN margins and entropies, and no gate mass.
        """
        input_ids, attention_mask, position_ids = sequence_inputs(td)
        batch, seq = input_ids.shape
        if self.packed:
            packed = PackedRows.from_masks(attention_mask, response_span(td["response_mask"]))
            kwargs = packed_kwargs(packed, td, input_ids, attention_mask, position_ids, self.model.config)
            valid = torch.ones(kwargs["input_ids"].shape[1], dtype=torch.bool, device=input_ids.device)
        else:
            packed = None
            kwargs = padded_kwargs(td, input_ids, attention_mask, position_ids, self.model.config)
            valid = attention_mask.bool().reshape(-1)
        with RouterStatsRecorder(self.model, valid) as recorder:
            self.model(**kwargs, use_cache=False, logits_to_keep=1)
        stats = recorder.result()
        if packed is not None:
            ids, margin = packed.unpack(stats.ids[None], -1), packed.unpack(stats.margin[None], math.nan)
            entropy = packed.unpack(stats.entropy[None], math.nan)
        else:
            fed = valid.view(batch, seq, 1)
            ids = stats.ids.view(batch, seq, *stats.ids.shape[1:]).masked_fill(fed[..., None].logical_not(), -1)
            margin = stats.margin.view(batch, seq, -1).masked_fill(fed.logical_not(), math.nan)
            entropy = stats.entropy.view(batch, seq, -1).masked_fill(fed.logical_not(), math.nan)
        return RouterStats(ids=ids, margin=margin, entropy=entropy, gate_mass=stats.gate_mass)

    def log_probs(
        self,
        td: TensorDict,
        temperature: float,
        with_entropy: bool,
        routed_experts: torch.Tensor | None = None,
        record_routing: bool = False,
        train: bool = False,
        truncation: Truncation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Response log-probs (B, R), entropy (B, R) or None, and this forward's own routing when recorded.

        `truncation`: the rollout's top-k / top-p / min-p, replayed on every token's distribution (None: the full
        softmax at `temperature`).
        """
        stats = self._token_stats(
            td, temperature, with_entropy, False, routed_experts, record_routing, train, truncation
        )
        return stats.log_probs, stats.entropy, stats.routing

    def _token_stats(
        self,
        td: TensorDict,
        temperature: float,
        with_entropy: bool,
        with_sum_pi_squared: bool,
        routed_experts: torch.Tensor | None,
        record_routing: bool,
        train: bool,
        truncation: Truncation | None = None,
    ) -> TokenStats:
        """`log_probs`, plus Σπ² (B, R) of the same distributions when asked for (unmasked here).

        With the fused head on, Σπ² comes from the head like the log-probs: no forward holds the logits.
        """
        if self.sp is not None:
            return self._sequence_parallel_stats(
                td, temperature, with_entropy, with_sum_pi_squared, routed_experts, record_routing, train, truncation
            )
        if self.fused:
            fuse = _Fuse(with_entropy, with_sum_pi_squared, temperature, truncation)
            return self._fused_token_stats(td, fuse, routed_experts, record_routing, train)
        cut = {"temperature": temperature, "truncation": truncation}
        spp = None
        if self.packed and not self.uses_lean(train):
            logits, own_routing, packed, _ = self._hf_forward(td, routed_experts, record_routing, train)
            targets = td["responses"][packed.rows, packed.cols][None]
            log_probs, entropy = logprobs_and_entropy(logits, targets, with_entropy, **cut)
            width = td["responses"].shape[1]
            entropy = packed.responses(entropy[0], width) if entropy is not None else None
            if with_sum_pi_squared:
                spp = packed.responses(sum_pi_squared_from_logits(logits, **cut)[0], width)
            return TokenStats(packed.responses(log_probs[0], width), entropy, spp, own_routing)
        logits, own_routing = self.response_logits(td, routed_experts, record_routing, train)
        # Upcast and temperature per block inside: the logits stay the model's own tensor.
        log_probs, entropy = logprobs_and_entropy(logits, td["responses"], with_entropy, **cut)
        if with_sum_pi_squared:
            spp = sum_pi_squared_from_logits(logits, **cut)
        return TokenStats(log_probs, entropy, spp, own_routing)

    def _sequence_parallel_stats(
        self,
        td: TensorDict,
        temperature: float,
        with_entropy: bool,
        with_sum_pi_squared: bool,
        routed_experts: torch.Tensor | None,
        record_routing: bool,
        train: bool,
        truncation: Truncation | None = None,
    ) -> TokenStats:
        """`_token_stats` on this rank's slice of the packed row, each per-token result gathered into whole rows.

        What crosses ranks is a few floats per response token (log-prob, entropy, Σπ²), never logits.
        """
        fuse = _Fuse(with_entropy, with_sum_pi_squared, temperature, truncation) if self.fused else None
        out, own_routing, packed, shard = self._hf_forward(td, routed_experts, record_routing, train, fuse=fuse)
        assert packed is not None and shard is not None, "sequence parallelism runs packed forwards only"
        if fuse is not None:
            columns = out[0]  # (n, 1|2|3): log-probs [, entropy, Σπ²] from the fused head
        else:
            targets = td["responses"][packed.rows, packed.cols][shard.mine][None]
            cut = {"temperature": temperature, "truncation": truncation}
            log_probs, entropy = logprobs_and_entropy(out, targets, with_entropy, **cut)
            parts = [log_probs[0]] + ([entropy[0]] if entropy is not None else [])
            if with_sum_pi_squared:
                parts.append(sum_pi_squared_from_logits(out, **cut)[0])
            columns = torch.stack([p.float() for p in parts], -1)
        whole = shard.gather_predicted(columns)  # (N, C) over the whole row
        width = td["responses"].shape[1]
        entropy = packed.responses(whole[:, 1], width) if with_entropy else None
        spp = packed.responses(whole[:, -1], width) if with_sum_pi_squared else None
        return TokenStats(packed.responses(whole[:, 0], width), entropy, spp, own_routing)

    def _fused_token_stats(
        self,
        td: TensorDict,
        fuse: _Fuse,
        routed_experts: torch.Tensor | None,
        record_routing: bool,
        train: bool,
    ) -> TokenStats:
        """`_token_stats` with the LM head fused into the log-softmax: the same outputs, no (tokens, vocabulary)
        logits."""
        if self.uses_lean(train):
            with fused_lm_head(
                self.model,
                td["responses"],
                with_entropy=fuse.with_entropy,
                temperature=fuse.temperature,
                with_sum_pi_squared=fuse.with_sum_pi_squared,
                truncation=fuse.truncation,
            ):
                stats, own_routing = self.response_logits(td, routed_experts, record_routing, train)
            packed = None
        else:
            stats, own_routing, packed, _ = self._hf_forward(td, routed_experts, record_routing, train, fuse=fuse)
        log_probs, entropy = split_head_output(stats, fuse.with_entropy)
        spp = head_sum_pi_squared(stats, fuse.with_sum_pi_squared)
        if packed is None:
            return TokenStats(log_probs, entropy, spp, own_routing)
        width = td["responses"].shape[1]
        entropy = packed.responses(entropy[0], width) if entropy is not None else None
        spp = packed.responses(spp[0], width) if spp is not None else None
        return TokenStats(packed.responses(log_probs[0], width), entropy, spp, own_routing)

    @torch.no_grad()
    def no_grad_log_probs(
        self,
        td: TensorDict,
        micro_batch_size: int,
        temperature: float,
        *,
        with_entropy: bool = False,
        replay: bool = False,
        record: bool = False,
        budget: TokenBudget | None = None,
        truncation: Truncation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Masked log-probs (B, R), masked entropy (B, R) or None, and the recorded routing (B, P+R, L, K) or None.

        `replay`: replay `td["routed_experts"]`; `record`: record the forward's own routing, -1 where no token
        was fed (the rollout's convention). `budget`: micro-batches of at most that many tokens (rows x kept columns)
        instead of `micro_batch_size` rows (the outputs come back in row order and width either way).
        `truncation`: the rollout's sampling mask, replayed on each token's distribution (`log_probs`).
        """
        stats = self.no_grad_token_stats(
            td,
            micro_batch_size,
            temperature,
            with_entropy=with_entropy,
            replay=replay,
            record=record,
            budget=budget,
            truncation=truncation,
        )
        return stats.log_probs, stats.entropy, stats.routing

    @torch.no_grad()
    def no_grad_token_stats(
        self,
        td: TensorDict,
        micro_batch_size: int,
        temperature: float,
        *,
        with_entropy: bool = False,
        with_sum_pi_squared: bool = False,
        replay: bool = False,
        record: bool = False,
        budget: TokenBudget | None = None,
        truncation: Truncation | None = None,
    ) -> TokenStats:
        """`no_grad_log_probs`, with Σπ² of each response token's distribution (masked) when asked for."""
        self.model.eval()
        lps, ents, spps, routings = [], [], [], []
        batches = plan_micro_batches(
            td["prompt_mask"],
            td["response_mask"],
            micro_batch_size,
            group_budget(budget, self.sp),
            agree=self.trained.strategy.agree_count,
            packed=self.packed,
        )
        with self.trained.strategy.sharded_no_grad():
            for sl, real in self.trained.passes(batches):
                mb, window = take(td, sl)  # under a budget, without the columns that are padding in all its rows
                routed = mb["routed_experts"].long() if replay else None
                lp, ent, spp, own = self._token_stats(
                    mb, temperature, with_entropy, with_sum_pi_squared, routed, record, False, truncation
                )
                if not real:  # a pass only to pair up with the other ranks' all-gathers
                    continue
                lps.append(window.responses(lp))
                if ent is not None:
                    ents.append(window.responses(ent))
                if spp is not None:
                    spps.append(window.responses(spp))
                if record:
                    routings.append(window.sequence(own))
        mask = td["response_mask"].bool()
        entropy = in_row_order(ents, batches) * mask if ents else None
        spp = in_row_order(spps, batches) * mask if spps else None
        routing = self._fed_routing(td, in_row_order(routings, batches)) if record else None
        return TokenStats(in_row_order(lps, batches) * mask, entropy, spp, routing)

    def _fed_routing(self, td: TensorDict, routing: torch.Tensor) -> torch.Tensor:
        """A forward's routing (B, P+R, L, K) in the rollout's convention: -1 wherever no token was fed (pads)."""
        fed = torch.cat([td["prompt_mask"].bool(), response_span(td["response_mask"]).bool()], dim=1)
        routing = torch.where(fed[:, :, None, None], routing.long(), torch.full_like(routing.long(), -1))
        return routing.to(routed_experts_dtype(self.moe.num_experts))
