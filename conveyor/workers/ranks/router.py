"""The actor's MoE router controls during an update: the load-balancing loss and loss-free balancing.

`RouterControls` is built by the actor from its `actor_rollout_ref.actor.router` section. With
`bias_update_rate > 0` it installs the selection bias on the routers at once (before an engine is built over
the same modules, so the rollout chooses with it too). During each real micro-batch of an update `tap`
collects the routers' logits and their own choices (`conveyor.models.router_control.RouterTap`);
`aux_loss` turns the logits into the micro-batch's share of the load-balancing loss; after the optimizer
step `update_bias` sums the counted load over every rank of the role (so each rank, under expert
parallelism too, moves its biases by the global load and they stay equal) and moves the biases by the
section's rule (`bias_update`, `bias_dead_band`).

What it deliberately does not do: freeze the routers (the actor does, before the optimizer is built), or
decide which engines may serve a biased router (the run plan does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from conveyor.models.router_control import RouterTap, install_selection_bias, update_selection_bias

__all__ = ["RouterControls"]


class RouterControls:
    """The load-balancing loss and the loss-free balancing bias of one actor rank's routers (`router` section);
    built only when one of them is on."""

    def __init__(self, model: nn.Module, router: Any) -> None:
        self.model = model
        self.aux_coef = float(router.aux_loss_coef)
        self.rate = float(router.bias_update_rate)
        self.rule, self.dead_band = str(router.bias_update), float(router.bias_dead_band)
        self.aux_on, self.bias_on = self.aux_coef > 0, self.rate > 0
        if self.bias_on:
            install_selection_bias(model)
        self._tap = RouterTap(model, keep_logits=self.aux_on, count=self.bias_on)
        self.top_k = int(self._tap.layers[0].router.top_k)

    @contextlib.contextmanager
    def tap(self, rows: torch.Tensor | None, real: bool) -> Iterator[None]:
        """Tap the routers in the forward inside (a pass that only pairs up with other ranks' counts nothing)."""
        if not (real or self.aux_on):
            yield
            return
        # A repeated pass's logits still make its (zero-weighted) loss; its choices are not this step's load.
        with self._tap.active(rows, count=real):
            yield

    def aux_loss(self, tokens: float, total_tokens: float, sums: dict[str, float] | None) -> torch.Tensor:
        """This micro-batch's weighted load-balancing loss (coefficient x loss x its share of the tokens).

        `sums` (a real pass's): gets the loss as a token-weighted `moe/aux_loss` metric.
        """
        aux = self._tap.aux_loss(self.top_k)
        if sums is not None:
            value = float(aux.detach())
            sums["moe/aux_loss@sum"] = sums.get("moe/aux_loss@sum", 0.0) + value * tokens
            sums["moe/aux_loss@count"] = sums.get("moe/aux_loss@count", 0.0) + tokens
        return self.aux_coef * aux * (tokens / max(total_tokens, 1.0))

    def update_bias(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """Move the biases by the load this update counted, summed over the role's ranks; metrics."""
        load = all_reduce_sum(self._tap.pop_load())
        return update_selection_bias(self.model, load, self.rate, self.rule, self.dead_band)
