"""A lean forward of Qwen3 and Qwen3-MoE for RL batches: each distinct prompt is computed once.

An RL batch is G prompts sampled n times each, so n rows begin with the same
prompt. The Hugging Face forward runs every row's prompt again, in the
trainer's forward and in the rollout's prefill. `LeanForward` runs each
distinct prompt once and lets the n responses attend to its keys and values;
rows that differ only after the prompt cost only their own tokens. On a
batch like the default run's (32 prompts of 6 tokens, n = 8, responses of 1
to 6 tokens) the trainer's forward and backward compute 827 positions
instead of 3072, and the rollout's prefill 8 times fewer
(`benchmarks/lean_forward.py`).

It computes what the Hugging Face forward computes, on the model's own
modules and parameters (so the optimizer, checkpoints and `save_pretrained`
see no difference), with the same arithmetic per token: the same norms,
projections, rotary embedding and expert implementation are called; only the
attention is laid out differently. Tests hold its logits, gradients, routing
and samples to the Hugging Face forward's within float rounding. Sharing needs
no group ids or order: rows whose prompt tokens (and, when routing is
replayed, the prompt's recorded routing) are equal share one computation.

Only the positions that are used are computed: the prompt, and the response
tokens that predict a later response token (a response's last token predicts
nothing the loss needs). The LM head runs on the R positions that predict
response tokens, in the batch's row order (so a fused head,
`conveyor.models.fused_head`, can stand in for it with the responses as
labels).

The MoE router is the layer's own module (`block.gate`), called as the
Hugging Face block calls it; replaying recorded routing and laying out the
recorded ids go through `conveyor.models.moe_routing` (`MoELayer.replay`,
`stack_routing`), the same code the hooks on the Hugging Face forward use, so
the two forwards cannot drift apart in routing arithmetic.

Supported: `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` with full attention,
no attention dropout, no gradient checkpointing, and MLP blocks that are
either dense or a sparse block `moe_routing` knows (`unsupported_reason` says
why another model is not); everything else uses the Hugging Face forward.
`actor_rollout_ref.model.forward_impl` chooses, and `auto` logs why it falls
back.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from conveyor.models.moe_routing import (
    MoELayer,
    check_routed_experts,
    moe_info,
    moe_layers,
    router_margin,
    stack_routing,
)

__all__ = ["LeanForward", "LeanDecodeState", "unsupported_reason", "resolve_forward_impl"]

logger = logging.getLogger(__name__)

_SUPPORTED = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `LeanForward` cannot run `model`, or None when it can."""
    name = type(model).__name__
    if name not in _SUPPORTED:
        return f"{name} is not one of {list(_SUPPORTED)}"
    config = model.config
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "the model uses sliding-window attention"
    if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or [])):
        return "the model has layers without full attention"
    if getattr(config, "attention_dropout", 0.0):
        return "the model has attention dropout"
    if _checkpointing(model):
        return "gradient checkpointing is on"
    if any(hasattr(m, "lora_A") for m in model.modules()):
        # The lean forward reads the projections' weights directly, which would skip the adapters.
        return "the model has LoRA adapters"
    return _layer_reason(model)


def _layer_reason(model: nn.Module) -> str | None:
    """Why a decoder layer of `model` is outside what `LeanForward` reproduces, or None."""
    try:
        moe_info(model)  # raises when the sparse layers differ in shape
    except ValueError as err:
        return str(err)
    sparse = _sparse_blocks(model)
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
            return f"layer {index}: q_norm and k_norm differ in eps; the lean forward applies them as one norm"
        mlp, entry = layer.mlp, sparse.get(id(layer.mlp))
        if entry is None:
            # A block with a router that moe_routing does not know could not be recorded or replayed alike.
            if hasattr(mlp, "gate") or hasattr(mlp, "experts"):
                return f"layer {index}: {type(mlp).__name__} is not a sparse MoE block moe_routing knows"
        elif entry[1].router is not getattr(mlp, "gate", None) or not hasattr(mlp, "experts"):
            return f"layer {index}: {type(mlp).__name__} is not laid out as a router `gate` and `experts`"
    return None


def _sparse_blocks(model: nn.Module) -> dict[int, tuple[int, MoELayer]]:
    """Each sparse MoE layer of `model` with its index in the (.., L, K) routing, keyed by the id of its block."""
    return {id(layer.block): (i, layer) for i, layer in enumerate(moe_layers(model))}


def _checkpointing(model: nn.Module) -> bool:
    # transformers 5 renamed `is_gradient_checkpointing` (which now warns) to `is_activation_checkpointing`.
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or hasattr(model, name):
            return bool(getattr(model, name))
    return False


def resolve_forward_impl(choice: str, model: nn.Module) -> LeanForward | None:
    """The `LeanForward` that `choice` (auto, lean or hf) asks for on `model`, or None for the Hugging Face forward."""
    if choice == "hf":
        return None
    reason = unsupported_reason(model)
    if reason is None:
        return LeanForward(model)
    if choice == "lean":
        raise ValueError(
            f"actor_rollout_ref.model.forward_impl=lean cannot run this model: {reason}; set it to auto or hf"
        )
    # auto: a silent fallback would hide a slower forward than the user expects.
    logger.info("actor_rollout_ref.model.forward_impl=auto uses the Hugging Face forward: %s", reason)
    return None


def _group_rows(key: Tensor) -> tuple[Tensor, Tensor]:
    """Groups of equal integer rows of `key` (B, W): each row's group id (B,), ids 0..U-1, and a row of each (U,)."""
    # A random linear hash of each row, then a 1-D unique: far cheaper than
    # `torch.unique(dim=0)`, which sorts whole rows. Exactness is checked, and
    # a collision (odds about B^2 / 2^64) falls back to the row sort.
    gen = torch.Generator().manual_seed(0x5EED)
    weights = torch.randint(1, 2**62, (key.shape[1],), generator=gen, dtype=torch.long).to(key.device)
    _, inv = torch.unique((key * weights).sum(-1), return_inverse=True)  # int64 arithmetic wraps around
    rep = _one_row_each(inv)
    if not torch.equal(key[rep][inv], key):
        _, inv = torch.unique(key, dim=0, return_inverse=True)
        rep = _one_row_each(inv)
    return inv, rep


def _one_row_each(inv: Tensor) -> Tensor:
    rep = torch.empty(int(inv.max()) + 1, dtype=torch.long, device=inv.device)
    return rep.scatter_(0, inv, torch.arange(len(inv), device=inv.device))


def _swap_halves(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The Hugging Face RMSNorm of Qwen3: normalised in float32, cast back, then scaled."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of `q` (B, Lq, h, d) over `k`, `v` (B, Lk, kvh, d) under the boolean `mask` (B|1, 1, Lq, Lk)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


@dataclass
class _Prompts:
    """The distinct prompts of a batch: `rep` (U,) a row holding each, `inv` (B,) each row's prompt."""

    rep: Tensor
    inv: Tensor
    ids: Tensor  # (U, P)
    mask: Tensor  # (U, P) bool
    positions: Tensor  # (U, P)
    attn_mask: Tensor  # (U, 1, P, P) bool

    @property
    def count(self) -> int:
        return int(self.rep.shape[0])


@dataclass
class LeanDecodeState:
    """What `LeanForward.decode` carries from step to step: the KV cache and the recorded routing."""

    keys: list[Tensor]  # per layer (A, P + T, kvh, d): the rows still decoding
    values: list[Tensor]
    mask: Tensor  # (A, 1, 1, P + T) bool: the prompt's padding, then ones
    next_positions: Tensor  # (A,)
    rows: Tensor  # (A,): which of the batch's B rows the cache holds
    batch: int  # B
    prompt_len: int
    steps: int = 0
    routing: list[Tensor] = field(default_factory=list)  # (B, S_i, L, K) per forward, when recorded
    record: bool = False
    margins: list[Tensor] = field(default_factory=list)  # (B, S_i, L) float32 per forward, NaN for rows not fed
    record_margins: bool = False

    def keep(self, keep: Tensor) -> None:
        """Drop the cache rows where `keep` (A,) is false."""
        self.keys = [k[keep] for k in self.keys]
        self.values = [v[keep] for v in self.values]
        self.mask, self.next_positions, self.rows = self.mask[keep], self.next_positions[keep], self.rows[keep]


class LeanForward:
    """The forward of a Qwen3 / Qwen3-MoE `model` over its own modules, computing each distinct prompt once."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"LeanForward cannot run this model: {reason}")
        self.model = model
        self.inner = model.model
        config = model.config
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.layers = list(self.inner.layers)
        # The attention module's own head size: released Qwen3 models set head_dim apart from hidden / heads.
        self.head_dim = int(self.layers[0].self_attn.head_dim)
        self.scale = float(self.layers[0].self_attn.scaling)
        self.moe = moe_info(model)
        # Per decoder layer, its sparse MoE layer (with its index in the routing), or None for a dense MLP
        # (Qwen3, or Qwen3-MoE's mlp_only_layers and decoder_sparse_step), which is called as it is.
        sparse = _sparse_blocks(model)
        self._moe = [sparse.get(id(layer.mlp)) for layer in self.layers]

    # ------------------------------------------------------------------ pieces
    def _distinct_prompts(self, prompts: Tensor, prompt_mask: Tensor, routing_key: Tensor | None) -> _Prompts:
        pmask = prompt_mask.bool()
        key = prompts.masked_fill(~pmask, -1)
        if routing_key is not None:
            key = torch.cat([key, routing_key], dim=1)
        inv, rep = _group_rows(key)
        mask = pmask[rep]
        positions = (mask.long().cumsum(-1) - 1).clamp_(min=0)
        length = prompts.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=prompts.device).tril_()
        # A left pad attends only to itself: no row of the mask is empty (an
        # empty row is NaN, which would reach real gradients as NaN * 0), and no
        # real token ever sees a pad.
        eye = torch.eye(length, dtype=torch.bool, device=prompts.device)
        attn_mask = (causal & (mask[:, None, :] | eye))[:, None]
        return _Prompts(rep, inv, prompts[rep], mask, positions, attn_mask)

    def _rotary(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin (N, 1, d) for the flat token positions `positions` (N,); see `_qkv`."""
        cos, sin = self.inner.rotary_emb(x, positions[None])
        half = self.head_dim // 2
        # rotate_half(x) * sin == swap_halves(x) * [-sin_1, sin_2]: one copy of x instead of two.
        signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return cos[0, :, None, :], signed[:, None, :]

    def _qkv(self, layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (N, h, d), keys and values (N, kvh, d) of the flat tokens `x` (N, H)."""
        attn = layer.self_attn
        n, d = x.shape[0], self.head_dim
        h = layer.input_layernorm(x)
        # One projection for q, k and v, and one norm and rotation for q and k
        # together: the same arithmetic as the separate modules, in fewer kernels.
        qkv = F.linear(
            h,
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            None if attn.q_proj.bias is None else torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]),
        ).view(n, -1, d)
        heads = self.num_heads + self.num_kv_heads
        norm_weight = torch.cat(
            [attn.q_norm.weight.expand(self.num_heads, d), attn.k_norm.weight.expand(self.num_kv_heads, d)]
        )
        qk = _rms_norm(qkv[:, :heads], norm_weight, attn.q_norm.variance_epsilon)
        qk = qk * cos + _swap_halves(qk) * sin
        return qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, heads:]

    def _mlp(
        self,
        index: int,
        x: Tensor,
        replay: Tensor | None,
        record: list[Tensor] | None,
        margins: list[Tensor] | None = None,
    ) -> Tensor:
        """The residual stream `x` (N, H) after layer `index`'s MLP block; appends its top-k ids (N, K) to `record`
        and its router margins (N,) to `margins`."""
        layer = self.layers[index]
        h = layer.post_attention_layernorm(x)
        if self._moe[index] is None:
            return x + layer.mlp(h)
        position, moe = self._moe[index]
        # The block's own router and experts, called as the Hugging Face sparse block calls them.
        routing = moe.router(h)
        if replay is not None:
            routing = moe.replay(routing, replay[:, position])
        logits, weights, ids = routing
        if record is not None:
            record.append(ids.detach())
        if margins is not None:
            margins.append(router_margin(logits, ids.shape[-1]))
        return x + moe.block.experts(h, ids, weights)

    # ------------------------------------------------------------------ training forward
    def response_logits(
        self,
        prompts: Tensor,
        prompt_mask: Tensor,
        responses: Tensor,
        response_mask: Tensor,
        *,
        routed_experts: Tensor | None = None,
        record_routing: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Logits (B, R, V) predicting each response token, and with `record_routing` this forward's routing.

        `prompts` (B, P) left-padded, `responses` (B, R) right-padded with `response_mask` through EOS.
        `routed_experts` (B, P+R, L, K) replays recorded routing (-1: the router's own choice). The
        routing returned is (B, P+R, L, K) int16, -1 at pads and at tokens not fed (each response's last).
        """
        batch, plen = prompts.shape
        rlen = responses.shape[1]
        if rlen < 1:
            raise ValueError("LeanForward.response_logits: `responses` has no columns")
        record = record_routing and self.moe is not None
        replay = routed_experts is not None and self.moe is not None
        if replay:
            check_routed_experts(self.model, routed_experts, (batch, plen + rlen))
        routing_key = routed_experts[:, :plen].flatten(1).long() if replay else None
        pr = self._distinct_prompts(prompts, prompt_mask, routing_key)
        n_prompt = pr.count * plen
        fed = rlen - 1  # response tokens that are inputs
        # When every prompt has the same number of rows (a whole GRPO batch), the
        # rows are put in prompt order so that each prompt's rows attend in one
        # block over its keys: U attention problems instead of B, and no per-row
        # copy of the prompt's keys. The outputs are put back in the input order.
        order = None
        if fed and pr.count < batch:
            counts = torch.bincount(pr.inv, minlength=pr.count)
            if bool((counts == counts[0]).all()):
                order = torch.argsort(pr.inv, stable=True)
                prompt_mask, responses, response_mask = prompt_mask[order], responses[order], response_mask[order]
                if replay:
                    routed_experts = routed_experts[order]
                pr.inv = pr.inv[order]
        prompt_len = prompt_mask.long().sum(-1)
        # Response token j is fed when token j+1 exists; the others (a row's last
        # token, the pads) never enter the token stream. Attention needs the
        # padded (B, fed) layout, so it scatters into it and gathers back.
        fed_mask = response_mask[:, 1:].bool()
        fed_idx = fed_mask.reshape(-1).nonzero().squeeze(-1) if fed and not bool(fed_mask.all()) else None

        def unpad(t: Tensor) -> Tensor:  # (B * fed, ...) -> (fed tokens, ...)
            return t if fed_idx is None else t[fed_idx]

        def pad(t: Tensor) -> Tensor:  # (fed tokens, ...) -> (B * fed, ...), zeros elsewhere
            if fed_idx is None:
                return t
            return t.new_zeros((batch * fed, *t.shape[1:])).index_copy(0, fed_idx, t)

        r_ids = unpad(responses[:, :fed].reshape(-1))
        r_pos = unpad((prompt_len[:, None] + torch.arange(fed, device=prompts.device)).reshape(-1))
        ids = torch.cat([pr.ids.reshape(-1), r_ids])
        positions = torch.cat([pr.positions.reshape(-1), r_pos])
        replay_ids = None
        if replay:
            replay_ids = torch.cat(
                [
                    routed_experts[pr.rep, :plen].reshape(n_prompt, *routed_experts.shape[2:]),
                    unpad(routed_experts[:, plen : plen + fed].reshape(batch * fed, *routed_experts.shape[2:])),
                ]
            ).long()
        # The response rows attend to their prompt's real tokens, then causally to their own.
        r_mask = None
        if fed:
            r_mask = self._response_mask(pr, prompt_mask, fed, None if order is None else batch // pr.count)

        x = self.inner.embed_tokens(ids)
        cos, sin = self._rotary(x, positions)
        per_layer: list[Tensor] | None = [] if record else None
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            shape_p = (pr.count, plen, -1, self.head_dim)
            kp, vp = k[:n_prompt].view(shape_p), v[:n_prompt].view(shape_p)
            parts = [_attend(q[:n_prompt].view(shape_p), kp, vp, pr.attn_mask, self.scale).reshape(n_prompt, -1)]
            if fed:
                qr, kr, vr = pad(q[n_prompt:]), pad(k[n_prompt:]), pad(v[n_prompt:])
                if order is not None:
                    shape_g = (pr.count, batch // pr.count * fed, -1, self.head_dim)
                    keys = torch.cat([kp, kr.view(shape_g)], dim=1)
                    values = torch.cat([vp, vr.view(shape_g)], dim=1)
                    out = _attend(qr.view(shape_g), keys, values, r_mask, self.scale)
                else:
                    shape_r = (batch, fed, -1, self.head_dim)
                    keys = torch.cat([kp[pr.inv], kr.view(shape_r)], dim=1)
                    values = torch.cat([vp[pr.inv], vr.view(shape_r)], dim=1)
                    out = _attend(qr.view(shape_r), keys, values, r_mask, self.scale)
                parts.append(unpad(out.reshape(batch * fed, -1)))
            x = x + layer.self_attn.o_proj(torch.cat(parts) if fed else parts[0])
            x = self._mlp(index, x, replay_ids, per_layer)

        last = x[:n_prompt].view(pr.count, plen, -1)[:, -1][pr.inv]  # left padding: the last column is real
        # Positions that predict nothing (after a row's end) get zero hidden states; their logits are unused.
        hidden = torch.cat([last[:, None], pad(x[n_prompt:]).view(batch, fed, x.shape[-1])], dim=1)
        restore = None
        if order is not None:
            restore = torch.empty_like(order)
            restore[order] = torch.arange(batch, device=order.device)
            # Rows back in the input order before the head: a fused head (`conveyor.models.fused_head`) holds labels
            # in that order, and (B, R, H) is cheaper to permute than (B, R, V).
            hidden = hidden[restore]
        logits = self.model.lm_head(self.inner.norm(hidden))

        routing = None
        if per_layer is not None:
            stacked = stack_routing(per_layer)
            top_k = stacked.shape[-1]
            num_layers = stacked.shape[1]
            prompt_part = stacked[:n_prompt].view(pr.count, plen, num_layers, top_k)[pr.inv]
            prompt_part = prompt_part.masked_fill(~prompt_mask.bool()[:, :, None, None], -1)
            resp = torch.full((batch, rlen, num_layers, top_k), -1, dtype=torch.int16, device=prompts.device)
            if fed:
                fed_part = stacked[n_prompt:]
                if fed_idx is not None:
                    fed_part = fed_part.new_full((batch * fed, num_layers, top_k), -1).index_copy_(0, fed_idx, fed_part)
                resp[:, :fed] = fed_part.view(batch, fed, num_layers, top_k)
            routing = torch.cat([prompt_part, resp], dim=1)
        if restore is not None and routing is not None:
            routing = routing[restore]
        return logits, routing

    @staticmethod
    def _response_mask(pr: _Prompts, prompt_mask: Tensor, fed: int, group: int | None) -> Tensor:
        """The boolean attention mask of the fed response tokens over their prompt's keys and their own.

        Per row (`group` None): (B, 1, fed, P + fed). Grouped (`group` rows per prompt, rows in prompt
        order): (U, 1, group * fed, P + group * fed), where each row's tokens see only their own row.
        """
        device = prompt_mask.device
        causal = torch.ones(fed, fed, dtype=torch.bool, device=device).tril_()
        if group is None:
            batch, plen = prompt_mask.shape
            return torch.cat(
                [
                    prompt_mask.bool()[:, None, None, :].expand(batch, 1, fed, plen),
                    causal[None, None].expand(batch, 1, fed, fed),
                ],
                dim=-1,
            )
        count, plen = pr.mask.shape
        width = group * fed
        own = torch.block_diag(*[causal] * group)
        return torch.cat(
            [
                pr.mask[:, None, None, :].expand(count, 1, width, plen),
                own[None, None].expand(count, 1, width, width),
            ],
            dim=-1,
        )

    # ------------------------------------------------------------------ rollout
    @torch.inference_mode()
    def prefill(
        self,
        prompts: Tensor,
        prompt_mask: Tensor,
        max_new_tokens: int,
        *,
        record_routing: bool = False,
        record_margins: bool = False,
    ) -> tuple[Tensor, LeanDecodeState]:
        """Last-position logits (B, V) of the left-padded `prompts` (B, P) and the state `decode` continues from.

        `record_margins` (with `record_routing`): also keep each token's router margins (`router_margin`)."""
        batch, plen = prompts.shape
        pr = self._distinct_prompts(prompts, prompt_mask, None)
        n_prompt = pr.count * plen
        record = record_routing and self.moe is not None
        x = self.inner.embed_tokens(pr.ids.reshape(-1))
        cos, sin = self._rotary(x, pr.positions.reshape(-1))
        total = plen + max_new_tokens
        keys, values = [], []
        per_layer: list[Tensor] | None = [] if record else None
        margins: list[Tensor] | None = [] if record and record_margins else None
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            shape_p = (pr.count, plen, -1, self.head_dim)
            kp, vp = k.view(shape_p), v.view(shape_p)
            x = x + layer.self_attn.o_proj(
                _attend(q.view(shape_p), kp, vp, pr.attn_mask, self.scale).reshape(n_prompt, -1)
            )
            x = self._mlp(index, x, None, per_layer, margins)
            # The cache is (B, T, kvh, d): one row per sample, each a copy of its prompt's keys.
            cache_k = torch.empty((batch, total, self.num_kv_heads, self.head_dim), dtype=k.dtype, device=k.device)
            cache_v = torch.empty_like(cache_k)
            cache_k[:, :plen] = kp[pr.inv]
            cache_v[:, :plen] = vp[pr.inv]
            keys.append(cache_k)
            values.append(cache_v)
        last = x.view(pr.count, plen, -1)[:, -1]
        logits = self.model.lm_head(self.inner.norm(last))[pr.inv]
        mask = torch.ones((batch, 1, 1, total), dtype=torch.bool, device=prompts.device)
        mask[:, 0, 0, :plen] = prompt_mask.bool()
        state = LeanDecodeState(
            keys=keys,
            values=values,
            mask=mask,
            next_positions=prompt_mask.long().sum(-1),
            rows=torch.arange(batch, device=prompts.device),
            batch=batch,
            prompt_len=plen,
            record=record,
            record_margins=margins is not None,
        )
        if per_layer is not None:
            stacked = stack_routing(per_layer)
            state.routing.append(stacked.view(pr.count, plen, *stacked.shape[1:])[pr.inv])
        if margins is not None:
            state.margins.append(torch.stack(margins, dim=1).view(pr.count, plen, -1)[pr.inv])
        return logits, state

    @torch.inference_mode()
    def decode(self, state: LeanDecodeState, tokens: Tensor, finished: Tensor | None = None) -> Tensor:
        """Logits (B, V) after feeding one token per row (`tokens` (B,)); extends `state` in place.

        Rows marked in `finished` (B,) bool are dropped from the cache for good: they are not computed
        again and their logits are zeros (and their routing -1) from then on.
        """
        slot = state.prompt_len + state.steps
        if slot >= state.mask.shape[-1]:
            raise ValueError("LeanForward.decode: the cache is full; prefill with a larger max_new_tokens")
        if finished is not None:
            keep = ~finished[state.rows]
            if not bool(keep.all()):
                state.keep(keep)
        rows = state.rows
        active = len(rows)
        x = self.inner.embed_tokens(tokens[rows])
        cos, sin = self._rotary(x, state.next_positions)
        mask = state.mask[..., : slot + 1]
        per_layer: list[Tensor] | None = [] if state.record else None
        margins: list[Tensor] | None = [] if state.record_margins else None
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            state.keys[index][:, slot] = k
            state.values[index][:, slot] = v
            keys = state.keys[index][:, : slot + 1]
            values = state.values[index][:, : slot + 1]
            out = _attend(q[:, None], keys, values, mask, self.scale)
            x = x + layer.self_attn.o_proj(out.reshape(active, -1))
            x = self._mlp(index, x, None, per_layer, margins)
        state.steps += 1
        state.next_positions = state.next_positions + 1
        logits = self.model.lm_head(self.inner.norm(x))
        if active < state.batch:
            logits = logits.new_zeros((state.batch, logits.shape[-1])).index_copy_(0, rows, logits)
        if per_layer is not None:
            stacked = stack_routing(per_layer)
            if active < state.batch:
                stacked = stacked.new_full((state.batch, *stacked.shape[1:]), -1).index_copy_(0, rows, stacked)
            state.routing.append(stacked[:, None])
        if margins is not None:
            gaps = torch.stack(margins, dim=1)
            if active < state.batch:
                gaps = gaps.new_full((state.batch, gaps.shape[1]), math.nan).index_copy_(0, rows, gaps)
            state.margins.append(gaps[:, None])
        return logits
