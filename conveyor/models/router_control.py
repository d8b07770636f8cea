"""Controls on the MoE routers of a Hugging Face causal LM: freezing, the load-balancing loss, loss-free balancing.

- `freeze_routers(model)` stops every router's weights from training (no gradient, so no optimizer state).
- `load_balancing_loss(logits, num_experts, top_k, mask)` is the Switch-Transformer auxiliary loss exactly
  as transformers' `load_balancing_loss_func` computes it (`router_aux_loss_coef` there), from router
  logits that `RouterTap` collects during a forward.
- `install_selection_bias(model)` gives every router a per-expert bias (`e_score_correction_bias`, DeepSeek-V3's
  name, a persistent float32 buffer: checkpoints and weight streams carry it) that shifts the logits for the
  choice of the top-k experts only; the gating weights stay the router's own softmax probabilities at the
  chosen experts. `RouterTap` counts each router's own choices over real tokens, and `update_selection_bias`
  moves each bias against its expert's deviation from the mean load: by a fixed rate whatever the deviation
  (`sign`, DeepSeek-V3's auxiliary-loss-free balancing), or by the rate times the deviation relative to the
  mean, clipped to the rate (`proportional`, which stops moving as the load evens out); either with an optional
  dead band of relative deviations inside which a bias stays where it is (`selection_bias_step`).

The bias goes into the router's own forward (an instance attribute in place of the class's `forward`), not
into a hook: a recorder then records the biased choice and a replay (`conveyor.models.moe_routing`) still
replaces it, whichever hooks were registered first. Only the routers `conveyor.models.moe_routing` knows are
touched; their output contract `(logits, weights, ids)` is kept.

What it deliberately does not do: decide whether a control is on (the run's settings), reduce counts over
ranks (the caller all-reduces what `RouterTap` counted), or add the loss to the objective (the actor does).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from torch import nn

from conveyor.models.moe_routing import REPLAY_MODES, MoELayer, moe_layers

__all__ = [
    "REPLAY_CHOICES",
    "BIAS_NAME",
    "freeze_routers",
    "router_parameter_names",
    "load_balancing_loss",
    "install_selection_bias",
    "has_selection_bias",
    "selection_biases",
    "update_selection_bias",
    "selection_bias_step",
    "BIAS_UPDATES",
    "RouterTap",
]

#: actor_rollout_ref.actor.router.bias_update: how a selection bias moves from the measured load.
BIAS_UPDATES: tuple[str, ...] = ("sign", "proportional")

#: actor_rollout_ref.actor.router_replay.mode: a replay mode, or auto (the run plan picks one).
REPLAY_CHOICES: tuple[str, ...] = (*REPLAY_MODES, "auto")

#: The buffer each router's selection bias is kept in (DeepSeek-V3's Hugging Face name for the same bias).
BIAS_NAME = "e_score_correction_bias"


def router_parameter_names(model: nn.Module) -> list[str]:
    """Full names of the MoE routers' parameters of `model`, in depth order (empty for a dense model)."""
    routers = {id(layer.router) for layer in moe_layers(model)}
    out = []
    for name, module in model.named_modules():
        if id(module) in routers:
            out.extend(f"{name}.{p}" for p, _ in module.named_parameters(recurse=False))
    return out


def freeze_routers(model: nn.Module) -> int:
    """Stop every MoE router's parameters from training (call before the optimizer is built); how many."""
    count = 0
    for layer in moe_layers(model):
        for param in layer.router.parameters():
            param.requires_grad_(False)
            count += 1
    if count == 0:
        raise ValueError(
            f"actor_rollout_ref.actor.router.freeze: {type(model).__name__} has no MoE router conveyor knows; "
            "set it to false"
        )
    return count


def load_balancing_loss(
    logits: list[torch.Tensor], num_experts: int, top_k: int, mask: list[torch.Tensor | None] | None = None
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss over every layer's router `logits` (each (N_i, E)), float32 scalar.

    transformers' `load_balancing_loss_func`: the share of top-k assignments and the mean router probability of
    each expert, both over all (token, layer) rows, multiplied, summed and times `num_experts`. `mask` gives one
    (N_i,) row mask per layer (None: every row counts), as its `attention_mask` does.
    """
    if not logits:
        raise ValueError("load_balancing_loss: no router logits were collected")
    device = logits[0].device
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for i, layer_logits in enumerate(logits):
        probs = torch.softmax(layer_logits.to(device).float(), dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        m = mask[i] if mask is not None else None
        weight = (
            torch.ones(probs.shape[0], dtype=torch.float32, device=device)
            if m is None
            else m.to(device=device, dtype=torch.float32)
        )
        assigned = assigned.scatter_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * weight[:, None]).sum(dim=0)
        rows = rows + weight.sum()
    return (assigned / rows * (prob_sum / rows)).sum() * num_experts


def _biased_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's own forward, its top-k chosen on logits + bias; the weights as its class computes them."""
    logits, weights, ids = type(self).forward(self, hidden_states)
    bias = getattr(self, BIAS_NAME)
    chosen = torch.topk(logits.float() + bias.to(logits.device), int(self.top_k), dim=-1).indices
    layer: MoELayer = self._conveyor_layer
    # The gating weights of the chosen experts, from the unbiased logits (what replay computes for given ids).
    return layer.replay((logits, weights, ids), chosen.to(ids.dtype))


def install_selection_bias(model: nn.Module) -> int:
    """Give every MoE router of `model` a zero selection bias and the forward that uses it; how many routers.

    Idempotent. The bias is a persistent float32 buffer on the router's device, so it is saved and loaded with
    the model's state dict and streamed with its weights.
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError(
            f"actor_rollout_ref.actor.router.bias_update_rate: {type(model).__name__} has no MoE router conveyor "
            "knows; set it to 0"
        )
    for layer in layers:
        router = layer.router
        if BIAS_NAME in router._buffers:
            continue
        weight = next(iter(router.parameters()))
        device = weight.device if weight.device.type != "meta" else torch.device("cpu")
        router.register_buffer(BIAS_NAME, torch.zeros(int(router.num_experts), dtype=torch.float32, device=device))
        router._conveyor_layer = layer
        router.forward = types.MethodType(_biased_forward, router)
    return len(layers)


def has_selection_bias(model: nn.Module) -> bool:
    """Whether the routers of `model` carry a selection bias (`install_selection_bias`)."""
    layers = moe_layers(model)
    return bool(layers) and all(BIAS_NAME in layer.router._buffers for layer in layers)


def selection_biases(model: nn.Module) -> torch.Tensor:
    """Every router's selection bias stacked, (L, E) float32."""
    return torch.stack([getattr(layer.router, BIAS_NAME).detach().float().cpu() for layer in moe_layers(model)])


def selection_bias_step(load: torch.Tensor, rate: float, rule: str = "sign", dead_band: float = 0.0) -> torch.Tensor:
    """The change of each selection bias from the load `load` (L, E) of one update, (L, E) float32.

    With `d = (mean - load) / mean`, an expert's deviation relative to its layer's mean load (positive when it
    is under-loaded): `sign` moves by `rate * sign(d)` (DeepSeek-V3, Megatron-LM, torchtitan), `proportional` by
    `rate * clip(d, -1, 1)` (the same step far from balance, a step that shrinks to nothing at balance). An
    expert with `|d| <= dead_band` does not move, nor does any expert of a layer that saw no token.
    """
    if rule not in BIAS_UPDATES:
        raise ValueError(f"selection_bias_step: rule must be one of {BIAS_UPDATES}, got {rule!r}")
    load = load.float()
    mean = load.mean(dim=1, keepdim=True)
    dev = (mean - load) / mean.clamp_min(torch.finfo(torch.float32).tiny)
    step = rate * (torch.sign(dev) if rule == "sign" else dev.clamp(-1.0, 1.0))
    # `>` (not `>=`) so that dead_band=0 keeps an expert at exactly the mean still, as sign(0) does.
    moving = (dev.abs() > dead_band) & (mean > 0)
    return torch.where(moving, step, torch.zeros_like(step))


@torch.no_grad()
def update_selection_bias(
    model: nn.Module, load: torch.Tensor, rate: float, rule: str = "sign", dead_band: float = 0.0
) -> dict[str, float]:
    """Move each router's bias toward balance from `load` (L, E) assignments (`selection_bias_step`); metrics.

    The `sign` rule is DeepSeek-V3's: an expert above the mean load of its layer loses `rate`, one below gains
    it (so the step is the same whatever the batch size). Every rank must pass the same (global) load so that
    their biases stay equal.
    """
    layers = moe_layers(model)
    load = load.float()
    if load.shape != (len(layers), int(layers[0].router.num_experts)):
        raise ValueError(
            f"update_selection_bias: load has shape {tuple(load.shape)}, the model's routers need "
            f"({len(layers)}, {int(layers[0].router.num_experts)})"
        )
    step = selection_bias_step(load, rate, rule, dead_band)
    for layer, delta in zip(layers, step):
        bias = getattr(layer.router, BIAS_NAME)
        bias.add_(delta.to(bias.device))
    biases = selection_biases(model)
    moved = step.abs().max(dim=1).values
    mean = load.mean(dim=1)
    seen = mean > 0
    vio = ((load.max(dim=1).values - mean)[seen] / mean[seen]) if bool(seen.any()) else torch.zeros(1)
    # The update's own (biased) routing: what the bias acts on, beside the rollout's rollout/moe/max_vio.
    return {
        "actor/moe/selection_bias/abs_max": float(biases.abs().max()),
        "actor/moe/update_max_vio/max": float(vio.max()),
        # How far the update moved a bias this step: near the rate without settling, near 0 when settled.
        "actor/moe/selection_bias/step_max": float(moved.max()),
    }


class RouterTap:
    """During a forward: each MoE router's logits (for the load-balancing loss) and its own choices' counts.

    `rows(mask)` says, for the forwards that follow, which router input rows are real tokens ((N,) bool, as the
    padded Hugging Face forward feeds B x S rows) or None (the forward feeds real tokens only). Counting reads
    the router's own top-k (its output before any replay replaces it). Logits are kept with their graph only
    when `keep_logits`. A checkpointed layer recomputed in the backward runs outside `active()` and is not
    counted twice.
    """

    def __init__(self, model: nn.Module, *, keep_logits: bool, count: bool) -> None:
        self.layers = moe_layers(model)
        self.keep_logits, self.count = keep_logits, count
        num_experts = int(self.layers[0].router.num_experts)
        device = next(iter(self.layers[0].router.parameters())).device
        self.load = torch.zeros(len(self.layers), num_experts, dtype=torch.float64)
        self._device = device
        self._load_dev: torch.Tensor | None = None
        self.logits: list[torch.Tensor] = []
        self.masks: list[torch.Tensor | None] = []
        self._mask: torch.Tensor | None = None
        self._counting = False

    @contextlib.contextmanager
    def active(self, rows: torch.Tensor | None = None, *, count: bool = True) -> Iterator[RouterTap]:
        """Tap the routers for the forwards inside; `rows` as in the class docstring; `count=False`: logits only."""
        self._mask = rows.reshape(-1).bool() if rows is not None else None
        self._counting = self.count and count
        handles = [
            # prepend: before a replay hook replaces the router's own choice.
            layer.router.register_forward_hook(self._hook(i), prepend=True)
            for i, layer in enumerate(self.layers)
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self._mask = None
            self._counting = False

    def _hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            logits, _, ids = output
            mask = self._mask
            if mask is not None:
                assert mask.numel() == logits.shape[0], "the row mask must describe the router's input rows"
                mask = mask.to(logits.device)
            if self.keep_logits:
                self.logits.append(logits)
                self.masks.append(mask)
            if self._counting:
                chosen = ids.reshape(ids.shape[0], -1)
                if mask is not None:
                    chosen = chosen[mask]
                if self._load_dev is None or self._load_dev.device != chosen.device:
                    self._flush()
                    self._load_dev = torch.zeros(self.load.shape, dtype=torch.float32, device=chosen.device)
                self._load_dev[index].index_add_(
                    0, chosen.reshape(-1).long(), torch.ones(chosen.numel(), device=chosen.device)
                )

        return hook

    def _flush(self) -> None:
        if self._load_dev is not None:
            self.load += self._load_dev.double().cpu()
            self._load_dev = None

    def aux_loss(self, top_k: int) -> torch.Tensor:
        """The load-balancing loss of the logits tapped since the last call (then forgets them)."""
        logits, masks = self.logits, self.masks
        self.logits, self.masks = [], []
        return load_balancing_loss(logits, int(self.layers[0].router.num_experts), top_k, masks)

    def pop_load(self) -> torch.Tensor:
        """Assignments counted since the last call, (L, E) float64 on the CPU; resets them."""
        self._flush()
        out, self.load = self.load, torch.zeros_like(self.load)
        return out
