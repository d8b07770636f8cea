"""Ulysses sequence parallelism: one packed micro-batch split by tokens over the ranks of a group.

DeepSpeed-Ulysses (verl's `ulysses_sequence_parallel_size`): the `sp` ranks of a group (the inner dimension of
the role's `("dp", "sp")` mesh, `conveyor.workers.training.mesh`) work on the same rows. Each packed micro-batch
(`conveyor.models.packing.PackedRows`) is padded to a multiple of `sp` tokens and cut into `sp` consecutive
slices; every rank runs the model on its slice only, so each layer's activations, and the LM head's, are 1/sp
of the micro-batch's. Token ids, positions and labels are taken from the whole packed row before the cut, so
rotary positions and the sequences' boundaries stay those of the whole row. Attention is the one place a token
needs the others: around it an all-to-all swaps the token split for a head split (each rank then attends over
the whole row with `heads / sp` of the heads, within the row's sequences) and a second one swaps back. The
per-token results (log-prob, entropy, Σπ², value, recorded routing) are gathered over the group, so the loss
code sees whole rows, exactly as without SP.

How the data reaches a group: the worker group hands every rank its own share of the keys, as always; the
ranks of an SP group exchange their handles (`SequenceParallel.group_meta`, a few strings), each reads the
group's samples from the data plane, and each writes back only its own share. Every metric is counted once:
the ranks other than the group's first drop their `@sum`/`@count` entries (`count_once`), which the reduction
skips.

The gradient: every rank of a group computes the same loss from the same gathered rows, so the gradient a rank
receives for its own tokens' outputs is already the whole gradient of them; the gather's backward keeps that
part (summing the group's copies, as `all_gather`'s backward does, would count it `sp` times). Each rank's
parameter gradient is then its tokens' share, and FSDP2's (or DDP's) average over every rank with the usual
world-size loss scale gives the one-rank gradient (the equality tests check it to 1e-5).

What it deliberately does not do: choose micro-batches, compute losses, or split anything but packed rows
(padded forwards and the lean forward are refused with SP on, by the workers' checks).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import Tensor, nn

from conveyor.models.packing import SEQUENCE_EXCHANGE, PackedRows
from conveyor.protocol import KVBatchMeta
from conveyor.workers.training.batching import TokenBudget

__all__ = [
    "SequenceParallel",
    "SequenceShard",
    "HeadExchange",
    "check_sequence_parallel",
    "gather_tokens",
    "count_once",
    "group_share",
    "group_budget",
]


def check_sequence_parallel(model: nn.Module, size: int, key: str, *, packed: bool) -> None:
    """Refuse a model or setting `size`-way SP cannot run: heads that do not divide, or padded forwards."""
    if size == 1:
        return
    if not packed:
        raise ValueError(
            f"{key}={size} splits packed rows: set actor_rollout_ref.model.use_remove_padding=true (or null, "
            f"on a model that packs) or {key}=1"
        )
    config = getattr(model, "config", None)
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads is None:
            raise ValueError(f"{key}={size}: the model's config has no {name}; set {key}=1")
        if heads % size:
            raise ValueError(
                f"{key}={size} must divide the model's {name}={heads} (attention runs on heads / {key} heads "
                f"per rank); set {key} to a divisor of {heads}"
            )


class _Gather(torch.autograd.Function):
    """Concatenate the group's equal-sized slices along dim 0; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any, size: int, rank: int) -> Tensor:
        ctx.rank, ctx.n = rank, local.shape[0]
        parts = [torch.empty_like(local) for _ in range(size)]
        tdist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        # Every rank computes the same loss from the gathered whole, so this slice's gradient is complete here.
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None


def gather_tokens(local: Tensor, group: Any, size: int, rank: int) -> Tensor:
    """(n, ...) slices of the group's ranks -> (size * n, ...), in rank order; differentiable (see `_Gather`)."""
    if local.requires_grad:
        return _Gather.apply(local, group, size, rank)
    # gloo gathers no integer narrower than 32 bits (routing ids are int16).
    wide = local.to(torch.int32) if local.dtype in (torch.int8, torch.int16, torch.uint8, torch.bool) else local
    parts = [torch.empty_like(wide) for _ in range(size)]
    tdist.all_gather(parts, wide.contiguous(), group=group)
    return torch.cat(parts, 0).to(local.dtype)


def _all_to_all(x: Tensor, group: Any) -> Tensor:
    """Chunk i of dim 0 goes to rank i; chunk i of the result came from rank i (autograd-aware)."""
    from torch.distributed.nn.functional import all_to_all_single

    x = x.contiguous()
    with warnings.catch_warnings():
        # torch 2.13 points to `_functional_collectives`, a private module whose autograd variant differs between
        # the releases a GPU machine may have; this one has the same autograd on gloo and nccl in all of them.
        warnings.simplefilter("ignore", FutureWarning)
        return all_to_all_single(torch.empty_like(x), x, group=group)


@dataclass(frozen=True)
class HeadExchange:
    """The two all-to-alls around attention: this rank's tokens, all heads <-> every token, this rank's heads."""

    group: Any
    size: int

    def to_heads(self, x: Tensor) -> Tensor:
        """(1, H, t, D) of this rank's t tokens -> (1, H / sp, sp * t, D): the whole row, this rank's heads."""
        heads, t, d = x.shape[1:]
        sent = x[0].reshape(self.size, heads // self.size, t, d)
        got = _all_to_all(sent, self.group)  # got[i]: rank i's tokens of this rank's heads
        return got.permute(1, 0, 2, 3).reshape(heads // self.size, self.size * t, d)[None]

    def to_tokens(self, out: Tensor) -> Tensor:
        """(1, T, H / sp, D) attention output -> (1, T / sp, H, D): this rank's tokens, every head."""
        total, heads, d = out.shape[1:]
        sent = out[0].reshape(self.size, total // self.size, heads, d)
        got = _all_to_all(sent, self.group)  # got[j]: this rank's tokens of rank j's heads
        return got.permute(1, 0, 2, 3).reshape(total // self.size, self.size * heads, d)[None]


@dataclass
class SequenceShard:
    """This rank's slice [lo, hi) of one packed row padded to `total` tokens, and its predicting positions.

    `keep` (n,): the slice's positions (local) whose outputs predict response tokens; `mine` (N,) bool: which of
    the row's N predicting positions (`PackedRows.predict` order) those are.
    """

    packed: PackedRows
    sp: SequenceParallel
    total: int
    lo: int
    hi: int
    keep: Tensor
    mine: Tensor

    def local(self, x: Tensor) -> Tensor:
        """(1, T, ...) packed values -> (1, hi - lo, ...) of this rank's slice.

        The padding repeats the row's last token (its id, position and routing): valid values for every input,
        in a sequence of its own whose outputs nothing reads.
        """
        pad = self.total - x.shape[1]
        if pad:
            x = torch.cat([x, x[:, -1:].expand(1, pad, *x.shape[2:])], dim=1)
        return x[:, self.lo : self.hi]

    def model_kwargs(self, input_ids: Tensor, position_ids: Tensor) -> dict:
        """The keywords of this rank's forward: its slice of the packed ids and positions, the whole row's bounds.

        The padding forms one more sequence of its own (its tokens attend only among themselves); the bounds
        carry the head exchange, which the packed attention runs around itself.
        """
        cu = self.packed.cu_seq_lens
        if self.total > int(cu[-1]):
            cu = torch.cat([cu, cu.new_tensor([self.total])])
        else:
            cu = cu.clone()  # a tensor of its own: the exchange must not stick to the unsplit row's bounds
        setattr(cu, SEQUENCE_EXCHANGE, HeadExchange(self.sp.group, self.sp.size))
        longest = max(self.packed.max_len, self.total - int(self.packed.cu_seq_lens[-1]))
        return {
            "input_ids": self.local(self.packed.pack(input_ids)),
            "position_ids": self.local(self.packed.pack(position_ids)),
            "attention_mask": None,
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": longest,
            "max_length_k": longest,
        }

    def gather_predicted(self, local: Tensor) -> Tensor:
        """(n, C) outputs at this rank's predicting positions -> (N, C) of the whole row, `predict` order."""
        buf = local.new_zeros(self.hi - self.lo, *local.shape[1:])
        buf = buf.index_put((self.keep,), local)
        whole = gather_tokens(buf, self.sp.group, self.sp.size, self.sp.rank)
        return whole[self.packed.predict]

    def gather_row(self, local: Tensor) -> Tensor:
        """(1, hi - lo, ...) per-token values of this rank's slice -> (1, T, ...) of the unpadded packed row."""
        whole = gather_tokens(local[0], self.sp.group, self.sp.size, self.sp.rank)
        return whole[: int(self.packed.cu_seq_lens[-1])][None]


@dataclass
class SequenceParallel:
    """The sequence-parallel group of one rank: its process group, size and this rank's place in it."""

    group: Any
    size: int
    rank: int

    @classmethod
    def of(cls, strategy: Any) -> SequenceParallel | None:
        """The SP group of a role's strategy, or None without sequence parallelism (size 1)."""
        size = getattr(strategy, "sequence_parallel_size", 1)
        if size == 1:
            return None
        group = strategy.meshes.dim_group("sp")
        return cls(group, size, tdist.get_rank(group))

    def shard(self, packed: PackedRows) -> SequenceShard:
        """This rank's slice of `packed`'s row, padded to a multiple of the group's size."""
        tokens = int(packed.cu_seq_lens[-1])
        total = -(-tokens // self.size) * self.size
        per = total // self.size
        lo, hi = self.rank * per, (self.rank + 1) * per
        mine = (packed.predict >= lo) & (packed.predict < hi)
        return SequenceShard(packed, self, total, lo, hi, packed.predict[mine] - lo, mine)

    def group_meta(self, meta: KVBatchMeta) -> tuple[KVBatchMeta, slice]:
        """The handle of the whole group's samples (every rank's share, in rank order), and where this rank's lie."""
        shares: list[Any] = [None] * self.size
        tdist.all_gather_object(shares, (meta.partition_id, list(meta.keys), list(meta.tags)), group=self.group)
        if any(p != meta.partition_id for p, _, _ in shares):
            raise ValueError("the ranks of a sequence-parallel group were handed different partitions")
        start = sum(len(k) for _, k, _ in shares[: self.rank])
        keys = [k for _, ks, _ in shares for k in ks]
        tags = [t for _, _, ts in shares for t in ts]
        whole = KVBatchMeta(keys, meta.partition_id, list(meta.fields), tags, dict(meta.extra_info))
        return whole, slice(start, start + len(meta.keys))


def group_share(sp: SequenceParallel | None, meta: KVBatchMeta) -> tuple[KVBatchMeta, slice]:
    """The handle a rank reads (its SP group's samples) and where its own share lies in it; `meta`, all without SP."""
    if sp is None:
        return meta, slice(None)
    return sp.group_meta(meta)


def group_budget(budget: TokenBudget | None, sp: SequenceParallel | None) -> TokenBudget | None:
    """A per-GPU token budget as the group's micro-batch budget: `sp` times it, each rank holding its share (verl's
    `ppo_max_token_len_per_gpu * ulysses_sequence_parallel_size`)."""
    if budget is None or sp is None:
        return budget
    return TokenBudget(budget.max_tokens * sp.size, budget.key)


def count_once(metrics: dict[str, float], sp: SequenceParallel | None) -> dict[str, float]:
    """`metrics` of a rank that computed its SP group's rows: summed entries only on the group's first rank."""
    if sp is None or sp.rank == 0:
        return metrics
    return {k: v for k, v in metrics.items() if not (k.endswith("@sum") or k.endswith("@count"))}
