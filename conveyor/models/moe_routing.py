"""Capture and replay of Mixture-of-Experts routing in Hugging Face causal LMs.

The rollout records, for every token and every sparse MoE layer, the top-k
experts the router chose (`RoutingRecorder`); the trainer can then force its
own forward over the same tokens through those experts (`replay_routing`,
"routing replay") so the training forward computes log-probs of the same
sub-network that sampled the tokens, while the router still gets gradients
through its own softmax probabilities at the replayed ids.
`compute_routing_agreement` measures how often the two forwards would have
routed alike without replay.

Both mechanisms are plain `torch` module hooks, installed only inside their
context and removed on exit, so a model outside a context runs untouched.
The router (`block.gate`) of each sparse block returns
`(router_logits, routing_weights, expert_ids)`; recording reads `expert_ids`
from that output and replay replaces the last two entries. What differs
between architectures (only whether the top-k weights are renormalised) sits
in the small `_ARCHS` table keyed by the sparse block's class name.
`moe_layers`, `MoELayer.replay` and `stack_routing` are the one
implementation of finding the sparse layers, replaying a router's output and
laying out recorded ids; the lean forward (`conveyor.models.lean`) calls them
too, so both forwards replay and record alike.

It deliberately does not compute load-balance metrics (that is
`conveyor.metrics.moe_load_balance`), store routing anywhere, or support
routers that do not follow the Hugging Face v5 `*TopKRouter` contract.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "REPLAY_MODES",
    "MoEInfo",
    "MoELayer",
    "moe_info",
    "moe_layers",
    "sparse_decoder_layers",
    "stack_routing",
    "RoutingRecorder",
    "replay_routing",
    "check_routed_experts",
    "compute_routing_agreement",
    "routed_experts_dtype",
    "router_margin",
    "RouterStats",
    "RouterStatsRecorder",
]


# actor_rollout_ref.actor.router_replay.mode: no replay; R2, the updates replay the routing of the
# old-log-prob forward (recorded there); R3, every training forward replays the rollout's routing.
REPLAY_MODES: tuple[str, ...] = ("disabled", "R2", "R3")


@dataclass(frozen=True)
class _Arch:
    """How one architecture's sparse block exposes and post-processes its router."""

    router_attr: str
    renormalize: Callable[[nn.Module], bool]


def _router_flag(router: nn.Module) -> bool:
    return bool(router.norm_topk_prob)


# Keyed by sparse-block class name so that matching needs no import of every
# modeling module. Mixtral always renormalises its top-k; the others follow
# `config.norm_topk_prob`, copied onto the router.
_ARCHS: dict[str, _Arch] = {
    "MixtralSparseMoeBlock": _Arch("gate", lambda router: True),
    "Qwen3MoeSparseMoeBlock": _Arch("gate", _router_flag),
    "OlmoeSparseMoeBlock": _Arch("gate", _router_flag),
    "Qwen2MoeSparseMoeBlock": _Arch("gate", _router_flag),
    # Qwen3-VL-MoE's text router always renormalises its top-k (its config has no norm_topk_prob).
    "Qwen3VLMoeTextSparseMoeBlock": _Arch("gate", lambda router: True),
}


@dataclass(frozen=True)
class MoELayer:
    """One sparse MoE layer: its block, its router, and how its architecture post-processes the router."""

    block: nn.Module
    router: nn.Module
    arch: _Arch

    def replay(
        self, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor], recorded: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's `output` (logits (N, E), weights (N, K), ids (N, K)) routed through `recorded` (N, K) ids.

        A row of `recorded` holding any -1 (unknown routing) keeps the router's own choice. The router
        has no call that weighs given ids, so this is the one place that repeats its arithmetic: a
        float32 softmax of the logits, gathered at the ids, optionally renormalised, cast back. The
        gather keeps the router trainable through its probabilities at the replayed ids. `recorded` may
        lie on another device: the router's output says where the forward computes.
        """
        logits, own_weights, own_ids = output
        recorded = recorded.to(device=own_ids.device, dtype=own_ids.dtype)
        chosen = torch.where((recorded < 0).any(dim=-1, keepdim=True), own_ids, recorded)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, chosen)
        # Read at each call, as the router reads its own flag.
        if self.arch.renormalize(self.router):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(own_weights.dtype), chosen


@dataclass
class MoEInfo:
    """Shape of a model's routing: sparse MoE layers, experts per layer, experts per token."""

    num_layers: int
    num_experts: int
    top_k: int


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The sparse MoE layers of `model` in depth order (dense layers are skipped); empty for a dense model."""
    # `named_modules` walks registration order, which for decoder stacks is
    # depth order; dense layers (e.g. Qwen3-MoE `mlp_only_layers`) are skipped.
    layers = []
    for _, module in model.named_modules():
        arch = _ARCHS.get(type(module).__name__)
        if arch is not None:
            layers.append(MoELayer(module, getattr(module, arch.router_attr), arch))
    return layers


def sparse_decoder_layers(model: nn.Module) -> list[int]:
    """The decoder-layer index of each sparse MoE layer of `model`, in `moe_layers` order (dense layers left out).

    Engines that number routing by absolute decoder layer (vLLM's captured `routed_experts`) are read at
    these indices: conveyor's (.., L, K) routing counts the sparse layers only.
    """
    out = []
    for name, module in model.named_modules():
        if type(module).__name__ in _ARCHS:
            parts = name.split(".")
            index = next((int(p) for p in reversed(parts) if p.isdigit()), None)
            if index is None:
                raise ValueError(f"sparse MoE block {name!r} is not inside a numbered decoder layer")
            out.append(index)
    return out


def _require_moe_layers(model: nn.Module) -> list[MoELayer]:
    layers = moe_layers(model)
    if not layers:
        raise ValueError(
            f"model {type(model).__name__} has no sparse MoE layer this module knows (known blocks: {sorted(_ARCHS)})"
        )
    return layers


def moe_info(model: nn.Module) -> MoEInfo | None:
    """Routing shape of `model`, or None for a dense model."""
    layers = moe_layers(model)
    if not layers:
        return None
    experts = {int(layer.router.num_experts) for layer in layers}
    top_ks = {int(layer.router.top_k) for layer in layers}
    if len(experts) != 1 or len(top_ks) != 1:
        raise ValueError(
            f"model {type(model).__name__} mixes MoE layer shapes (num_experts {sorted(experts)}, "
            f"top_k {sorted(top_ks)}); a single (B, S, L, K) routing tensor cannot describe it"
        )
    return MoEInfo(num_layers=len(layers), num_experts=experts.pop(), top_k=top_ks.pop())


def routed_experts_dtype(num_experts: int) -> torch.dtype:
    """Smallest signed integer dtype holding expert ids 0..num_experts-1 and -1."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    # The largest id is num_experts - 1: int8 holds 128 experts (Qwen3-30B-A3B's), ids 0..127 and -1.
    if num_experts - 1 <= torch.iinfo(torch.int8).max:
        return torch.int8
    if num_experts - 1 <= torch.iinfo(torch.int16).max:
        return torch.int16
    raise ValueError(f"num_experts={num_experts} does not fit int16 expert ids")


def stack_routing(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """Expert ids (N, L, K) int16 from one (N, K) tensor per MoE layer, on the first layer's device."""
    device = per_layer[0].device
    return torch.stack([ids.to(device) for ids in per_layer], dim=1).to(torch.int16)


def router_margin(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The gap between the k-th and the (k+1)-th largest router logit of each token: logits (N, E) -> (N,) float32.

    Computed from the top-(k+1) values only. 0 is a tie: an arbitrarily small change of the hidden state may swap
    the last chosen expert for the first one left out. With k = E (every expert chosen) there is no such expert and
    the margin is +inf.
    """
    if top_k >= logits.shape[-1]:
        return torch.full(logits.shape[:-1], math.inf, dtype=torch.float32, device=logits.device)
    top = torch.topk(logits.detach().float(), top_k + 1, dim=-1).values
    return top[..., top_k - 1] - top[..., top_k]


def _block_hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    hidden = args[0] if args else kwargs.get("hidden_states")
    assert isinstance(hidden, torch.Tensor) and hidden.dim() == 3, "sparse block input must be (B, S, H)"
    return hidden


class RoutingRecorder:
    """Context manager recording each forward's top-k expert ids per MoE layer; `pop()` gives (B, S, L, K)."""

    def __init__(self, model: nn.Module, margins: bool = False) -> None:
        self._layers = _require_moe_layers(model)
        self._handles: list[RemovableHandle] = []
        # With `margins`, each layer also keeps its tokens' router margins (`router_margin`), for `pop_with_margins`.
        self._margins = margins
        # The forward in progress: its (B, S) and one (B*S, K) tensor per layer (and one (B*S,) margin per layer).
        self._shape: tuple[int, int] | None = None
        self._current: list[torch.Tensor] = []
        self._current_margins: list[torch.Tensor] = []
        self._done: list[tuple[tuple[int, int], list[torch.Tensor], list[torch.Tensor]]] = []

    def __enter__(self) -> RoutingRecorder:
        if self._handles:
            raise RuntimeError("RoutingRecorder is already active; it cannot be entered twice")
        try:
            first = self._layers[0].block
            self._handles.append(first.register_forward_pre_hook(self._start_forward, with_kwargs=True))
            for index, layer in enumerate(self._layers):
                self._handles.append(layer.router.register_forward_hook(self._make_router_hook(index)))
        except BaseException:
            self._remove_hooks()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._shape = None
        self._current = []
        self._current_margins = []

    def _start_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = _block_hidden(args, kwargs)
        self._shape = (hidden.shape[0], hidden.shape[1])
        self._current = []
        self._current_margins = []

    def _make_router_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            # Accept a layer only as the next one of the forward begun at the
            # first block; a gradient-checkpointing recompute in backward runs
            # the layers in reverse and so never completes a record.
            if self._shape is None or len(self._current) != index:
                return
            self._current.append(output[2].detach())
            if self._margins:
                self._current_margins.append(router_margin(output[0], output[2].shape[-1]))
            if index == len(self._layers) - 1:
                self._done.append((self._shape, self._current, self._current_margins))
                self._shape = None
                self._current = []
                self._current_margins = []

        return hook

    @staticmethod
    def _assemble(shape: tuple[int, int], per_layer: list[torch.Tensor]) -> torch.Tensor:
        stacked = stack_routing(per_layer)  # (B*S, L, K)
        return stacked.reshape(shape[0], shape[1], *stacked.shape[1:])

    def pop(self) -> torch.Tensor:
        """Routing of the most recent complete forward, (B, S, L, K) int16 on the model's device; clears all."""
        if not self._done:
            raise RuntimeError("RoutingRecorder.pop: no complete forward was recorded since the last pop")
        shape, per_layer, _ = self._done[-1]
        self._done = []
        return self._assemble(shape, per_layer)

    def pop_with_margins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`pop()` and the same forward's router margins (B, S, L) float32 (recorded with `margins=True`)."""
        if not self._margins:
            raise RuntimeError("RoutingRecorder.pop_with_margins: the recorder was made without margins=True")
        if not self._done:
            raise RuntimeError("RoutingRecorder.pop_with_margins: no complete forward was recorded since the last pop")
        shape, per_layer, margins = self._done[-1]
        self._done = []
        return self._assemble(shape, per_layer), torch.stack(margins, dim=1).view(shape[0], shape[1], -1)

    def pop_all(self) -> list[torch.Tensor]:
        """Routing of every complete forward since the last pop, in order, each (B, S_i, L, K) int16; clears all."""
        done, self._done = self._done, []
        return [self._assemble(shape, per_layer) for shape, per_layer, _ in done]


@dataclass
class RouterStats:
    """What a `RouterStatsRecorder` saw of one forward's routers over N tokens (in the forward's flat order).

    `ids` (N, L, K) int16 top-k ids; `margin` (N, L) float32 (`router_margin`); `entropy` (N, L) float32, nats, of
    the router's softmax; `gate_mass` (L, E) float64, the softmax probabilities summed over the valid tokens.
    """

    ids: torch.Tensor
    margin: torch.Tensor
    entropy: torch.Tensor
    gate_mass: torch.Tensor


class RouterStatsRecorder:
    """Context manager over one Hugging Face forward of N = B*S tokens: per MoE layer, its routing and router health.

    `valid` (N,) bool marks the tokens whose softmax mass counts (pads do not). It reads the router's own logits,
    so it costs a top-(k+1), a softmax and an (N, E) reduction per layer: meant for a metrics pass, not every
    forward. The lean forward never calls the sparse block, so give this the Hugging Face forward.
    """

    def __init__(self, model: nn.Module, valid: torch.Tensor) -> None:
        self._layers = _require_moe_layers(model)
        self._valid = valid.reshape(-1)
        self._handles: list[RemovableHandle] = []
        self._per_layer: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(
            self._layers
        )

    def __enter__(self) -> RouterStatsRecorder:
        for index, layer in enumerate(self._layers):
            self._handles.append(layer.router.register_forward_hook(self._make_hook(index)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _make_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            logits, _, ids = output
            logits = logits.detach()
            if logits.shape[0] != self._valid.shape[0]:
                raise ValueError(
                    f"RouterStatsRecorder: MoE layer {index} routes {logits.shape[0]} tokens but `valid` marks "
                    f"{self._valid.shape[0]}; record an unpacked forward over the (B, S) it was given"
                )
            log_p = torch.log_softmax(logits.float(), dim=-1)
            entropy = -(log_p.exp() * log_p).sum(dim=-1)
            valid = self._valid.to(device=logits.device, dtype=torch.float32)
            # (N,) @ (N, E): the mass summed over valid tokens without an (N, E) masked copy.
            mass = (valid @ log_p.exp()).double()
            self._per_layer[index] = (ids.detach(), router_margin(logits, ids.shape[-1]), entropy, mass)

        return hook

    def result(self) -> RouterStats:
        """The recorded forward's `RouterStats` (on the device the routers computed on)."""
        if any(entry is None for entry in self._per_layer):
            raise RuntimeError("RouterStatsRecorder.result: not every MoE layer ran since the recorder was entered")
        entries = [e for e in self._per_layer if e is not None]
        return RouterStats(
            ids=stack_routing([e[0] for e in entries]),
            margin=torch.stack([e[1] for e in entries], dim=1),
            entropy=torch.stack([e[2] for e in entries], dim=1),
            gate_mass=torch.stack([e[3] for e in entries]),
        )


def check_routed_experts(
    model: nn.Module, routed_experts: torch.Tensor, batch_seq: tuple[int, int] | None = None
) -> None:
    """Raise ValueError unless `routed_experts` is a (B, S, L, K) integer tensor of valid ids for `model`'s MoE
    layers."""
    _require_moe_layers(model)
    info = moe_info(model)
    assert info is not None
    if not isinstance(routed_experts, torch.Tensor) or routed_experts.dim() != 4:
        shape = tuple(routed_experts.shape) if isinstance(routed_experts, torch.Tensor) else type(routed_experts)
        raise ValueError(f"routed_experts must be a (B, S, L, K) tensor, got {shape}")
    if routed_experts.dtype.is_floating_point or routed_experts.dtype.is_complex or routed_experts.dtype == torch.bool:
        raise ValueError(f"routed_experts must hold integer expert ids, got dtype {routed_experts.dtype}")
    num_layers, top_k = routed_experts.shape[2:]
    if (num_layers, top_k) != (info.num_layers, info.top_k):
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts.shape)} but the model has "
            f"{info.num_layers} MoE layers with top_k={info.top_k} (expected (B, S, {info.num_layers}, {info.top_k}))"
        )
    if batch_seq is not None and tuple(routed_experts.shape[:2]) != tuple(batch_seq):
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts.shape)} but the forward is over inputs of shape "
            f"{tuple(batch_seq)}; the first two dimensions must match (B, S)"
        )
    # One host sync buys a clear error instead of an index failure deep in a kernel.
    if routed_experts.numel() and (
        bool((routed_experts < -1).any()) or bool((routed_experts >= info.num_experts).any())
    ):
        raise ValueError(f"routed_experts ids must lie in [-1, {info.num_experts - 1}]")


@contextlib.contextmanager
def replay_routing(model: nn.Module, routed_experts: torch.Tensor) -> Iterator[None]:
    """Route every MoE layer of forwards over (B, S) inputs through `routed_experts: (B, S, L, K)`."""
    layers = _require_moe_layers(model)
    check_routed_experts(model, routed_experts)
    batch, seq, _, top_k = routed_experts.shape

    handles: list[RemovableHandle] = []
    try:
        for index, layer in enumerate(layers):
            # Not moved to the router's parameters' device: under FSDP2's CPU offload those live on the host
            # between forwards while the router computes on the GPU. The hook moves them where it computes.
            ids = routed_experts[:, :, index, :].reshape(batch * seq, top_k).long()
            handles.append(
                layer.block.register_forward_pre_hook(_make_shape_check(routed_experts.shape, index), with_kwargs=True)
            )
            # prepend: run before any other hook (a recorder, HF output capture) so they see the replayed routing.
            handles.append(layer.router.register_forward_hook(_make_replay_hook(layer, ids), prepend=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _make_shape_check(shape: torch.Size, index: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = _block_hidden(args, kwargs)
        if tuple(hidden.shape[:2]) != tuple(shape[:2]):
            raise ValueError(
                f"routed_experts has shape {tuple(shape)} but MoE layer {index} sees a forward over inputs "
                f"of shape {tuple(hidden.shape[:2])}; the first two dimensions must match (B, S)"
            )

    return hook


def _make_replay_hook(layer: MoELayer, ids: torch.Tensor) -> Callable[..., tuple]:
    placed = [ids]  # the ids on the device the router last computed on: one copy per context, not per call

    def hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
        assert output[2].shape == ids.shape, "shape check on the sparse block must have caught this"
        if placed[0].device != output[2].device:
            placed[0] = ids.to(output[2].device)
        return layer.replay(output, placed[0])

    return hook


def compute_routing_agreement(
    train_experts: torch.Tensor, rollout_experts: torch.Tensor, valid_mask: torch.Tensor
) -> float:
    """Fraction of (token, layer) pairs whose top-k expert set matches; `*_experts: (B, S, L, K)`, `valid_mask: (B, S)`.

    Counted over tokens where `valid_mask` is true and, per layer, the ids on
    both sides are all >= 0 (-1 marks unknown routing). Order within the top-k
    does not matter. Returns NaN when no pair qualifies.
    """
    if train_experts.dim() != 4:
        raise ValueError(f"train_experts must be (B, S, L, K), got shape {tuple(train_experts.shape)}")
    if rollout_experts.shape != train_experts.shape:
        raise ValueError(
            f"rollout_experts has shape {tuple(rollout_experts.shape)} but train_experts has "
            f"shape {tuple(train_experts.shape)}"
        )
    if valid_mask.shape != train_experts.shape[:2]:
        raise ValueError(
            f"valid_mask has shape {tuple(valid_mask.shape)} but the experts tensors are "
            f"{tuple(train_experts.shape)}; expected (B, S) = {tuple(train_experts.shape[:2])}"
        )
    train = train_experts.long()
    rollout = rollout_experts.to(device=train.device, dtype=torch.long)
    known = (rollout >= 0).all(dim=-1) & (train >= 0).all(dim=-1)  # (B, S, L)
    counted = known & valid_mask.to(device=train.device, dtype=torch.bool).unsqueeze(-1)
    # Ids within one top-k are distinct, so sorted equality is set equality.
    same = (train.sort(dim=-1).values == rollout.sort(dim=-1).values).all(dim=-1)
    total = int(counted.sum())
    if total == 0:
        return math.nan
    return float((same & counted).sum()) / total
