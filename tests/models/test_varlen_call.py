"""The packed forward's CUDA call to torch's `varlen_attn`, tested on the CPU: its arguments and what they compute.

The call runs only on CUDA in half precision, and the GPU check machine's torch (2.11) is older than this
machine's: a keyword that its `varlen_attn` lacks, or key boundaries the flash kernel refuses, stop the first
packed forward there. Here the exact call `VarlenCall` builds goes through torch's own `varlen_attn`, its
custom op, autograd and backward op on the CPU, down to the two flash-attention kernels, which are CUDA-only;
a CPU stand-in for them (registered for the test's duration) checks the kernels' argument contract and computes
causal attention per sequence from the arguments it is given, so the test also shows that what the call asks
for (boundaries, causality, scale, grouped heads) is what the model needs. The call is also bound against the
signatures of the releases the GPU machines run.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor
from torch.nn.attention.varlen import varlen_attn

from conveyor.models.packing import _PLAN_ATTR, PackedRows, VarlenCall, varlen_call

# The varlen_attn signatures of the releases the call must work with, as their sources spell them (return
# annotations left out). torch 2.11 is on the GPU check machine.
SIGNATURES = {
    "2.11": "(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, "
    "window_size=(-1, -1))",
    "2.10": "(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, is_causal=False)",
}
HALF = (torch.float16, torch.bfloat16)


def _signature(text: str) -> inspect.Signature:
    """An `inspect.Signature` from a `(...)` parameter list with literal defaults."""
    namespace: dict = {}
    exec(f"def f{text}: pass", namespace)  # noqa: S102 - test-local literal text
    return inspect.signature(namespace["f"])


def _causal_attention(q: Tensor, k: Tensor, v: Tensor, cu: list[int], scale: float) -> tuple[Tensor, Tensor]:
    """Per-sequence causal attention in float32: out (T, H, D) and log-sum-exp (H, T); k/v may have fewer heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1)
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_zeros(q.shape[1], q.shape[0], dtype=torch.float32)
    for start, stop in zip(cu[:-1], cu[1:]):
        s = torch.einsum("qhd,khd->hqk", q[start:stop].float(), k[start:stop]) * scale
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
        lse[:, start:stop] = s.logsumexp(-1)
        out[start:stop] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[start:stop])
    return out, lse


def _check_boundaries(
    query: Tensor, cum_seq_q: Tensor | None, cum_seq_k: Tensor | None, max_q: int, max_k: int
) -> list[int]:
    """The flash kernels' contract on varlen boundaries; the boundaries as a list."""
    # The CUDA flash forward takes both boundaries or neither; its backward takes both (a Tensor in its schema).
    if cum_seq_q is None or cum_seq_k is None:
        raise RuntimeError("flash varlen attention needs both cum_seq_q and cum_seq_k")
    for name, cu in (("cum_seq_q", cum_seq_q), ("cum_seq_k", cum_seq_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != query.device:
            raise RuntimeError(f"{name} must be a 1-D int32 tensor on the query's device")
    bounds = cum_seq_q.tolist()
    if cum_seq_k.tolist() != bounds or bounds[0] != 0 or bounds[-1] != query.shape[0]:
        raise RuntimeError("self-attention boundaries must agree and cover the packed tokens")
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if max_q < longest or max_k < longest:
        raise RuntimeError(f"max_q/max_k ({max_q}, {max_k}) below the longest sequence ({longest})")
    return bounds


def _check_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout_p: float,
    is_causal: bool,
    window_left: int | None,
    window_right: int | None,
) -> None:
    """The flash kernels' contract on q/k/v and the mask, as far as this packing uses them."""
    if query.dtype not in HALF or key.dtype != query.dtype or value.dtype != query.dtype:
        raise RuntimeError("flash attention takes float16 or bfloat16 query, key and value of one dtype")
    if query.dim() != 3 or key.shape != value.shape or query.shape[1] % key.shape[1]:
        raise RuntimeError("varlen q (T, H, D) and k/v (T, Hkv, D) with H a multiple of Hkv")
    if any(x.stride(-1) != 1 for x in (query, key, value)) or query.shape[-1] > 256:
        raise RuntimeError("head dim must be contiguous and at most 256")
    if dropout_p:
        raise RuntimeError("the stand-in has no dropout")
    # Causal is is_causal, or a window reaching all the way back and not forward (what window_size=(-1, 0) is).
    if not (is_causal or (window_left in (None, -1) and window_right == 0)):
        raise RuntimeError("the packed forward must be causal")


def _flash_forward(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
):
    """A CPU stand-in for aten::_flash_attention_forward's varlen path (its schema, its checks, its outputs)."""
    bounds = _check_boundaries(query, cum_seq_q, cum_seq_k, max_q, max_k)
    _check_inputs(query, key, value, dropout_p, is_causal, window_size_left, window_size_right)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    out, lse = _causal_attention(query, key, value, bounds, scale)
    seed = torch.zeros(2, dtype=torch.uint64)
    return out.to(query.dtype), lse, seed, torch.zeros((), dtype=torch.uint64), query.new_empty(0)


def _flash_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    rng_state,
    unused,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
):
    """A CPU stand-in for aten::_flash_attention_backward: the attention gradients from the saved out and lse."""
    bounds = _check_boundaries(query, cum_seq_q, cum_seq_k, max_q, max_k)
    _check_inputs(query, key, value, dropout_p, is_causal, window_size_left, window_size_right)
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    groups = query.shape[1] // key.shape[1]
    q, do, o = query.float(), grad_out.float(), out.float()
    k, v = key.float().repeat_interleave(groups, 1), value.float().repeat_interleave(groups, 1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        seq = slice(start, stop)
        s = torch.einsum("qhd,khd->hqk", q[seq], k[seq]) * scale
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
        p = (s - logsumexp[:, seq, None]).exp()  # the probabilities, from the forward's own log-sum-exp
        dv[seq] = torch.einsum("hqk,qhd->khd", p, do[seq])
        dp = torch.einsum("qhd,khd->hqk", do[seq], v[seq])
        ds = p * (dp - (do[seq] * o[seq]).sum(-1).transpose(0, 1)[:, :, None]) * scale
        dq[seq] = torch.einsum("hqk,khd->qhd", ds, k[seq])
        dk[seq] = torch.einsum("hqk,qhd->khd", ds, q[seq])

    def fold(x: Tensor) -> Tensor:  # query-head gradients summed onto their shared key/value head
        return x.reshape(x.shape[0], key.shape[1], groups, x.shape[-1]).sum(2)

    return dq.to(query.dtype), fold(dk).to(key.dtype), fold(dv).to(value.dtype)


@pytest.fixture
def flash_on_cpu() -> Iterator[None]:
    """The stand-in flash kernels registered for the CPU while a test runs."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", _flash_forward, "CPU")
    lib.impl("_flash_attention_backward", _flash_backward, "CPU")
    try:
        yield
    finally:
        lib._destroy()


def _packed_qkv(
    heads: int, kv_heads: int, lengths: list[int], dtype: torch.dtype, device: str = "cpu", head_dim: int = 16
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(1, H, T, D) query and (1, Hkv, T, D) key/value, as transformers hands them, and the sequences' `cu` (N+1,)."""
    total = sum(lengths)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(1, h, total, head_dim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    cu = PackedRows.from_masks(mask.long(), mask).cu_seq_lens.to(device)
    return q, k, v, cu


def _varlen_attn_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """A stand-in with torch 2.11's `varlen_attn` signature (no `enable_gqa`) over the installed custom op."""
    is_causal = window_size == (-1, 0)
    out, lse, _ = torch.ops.torch_attn._varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, list(window_size)
    )
    return (out, lse) if return_aux is not None and return_aux.lse else out


def _check_against_sdpa(call: VarlenCall, heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    """`call` over packed sequences equals per-sequence causal attention in float32, and so do its gradients."""
    lengths, scale = [5, 1, 9, 3], 0.3
    q, k, v, cu = _packed_qkv(heads, kv_heads, lengths, dtype)
    out = call(q, k, v, cu, scale)  # (1, T, H, D)
    assert out.shape == (1, sum(lengths), heads, 16) and out.dtype == dtype
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * weights).sum().backward()

    ref_q, ref_k, ref_v = (x.detach().float().requires_grad_() for x in (q, k, v))
    bounds = cu.tolist()
    # Autograd of float32 SDPA per sequence: independent of the stand-in's hand-written formulas.
    ref_out = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                ref_q[:, :, a:b],
                ref_k[:, :, a:b],
                ref_v[:, :, a:b],
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )[0].transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
    )  # (T, H, D)
    (ref_out * weights[0]).sum().backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out[0].float(), ref_out.detach(), atol=tol, rtol=tol)
    for got, want in ((q, ref_q), (k, ref_k), (v, ref_v)):
        assert got.grad is not None and got.grad.dtype == dtype
        torch.testing.assert_close(got.grad.float(), want.grad, atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
@pytest.mark.parametrize("dtype", HALF)
def test_the_installed_call_runs_forward_and_backward_through_torchs_op(flash_on_cpu, heads, kv_heads, dtype):
    """The installed torch's call, through its `varlen_attn`, custom op, autograd and backward op."""
    call = varlen_call()
    assert call is not None and call.fn is varlen_attn
    _check_against_sdpa(call, heads, kv_heads, dtype)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_the_torch_2_11_call_runs_forward_and_backward_through_torchs_op(flash_on_cpu, heads, kv_heads):
    """The GPU check machine's call: built from 2.11's signature, grouped heads passed as they are, still right."""
    call = VarlenCall.of(_varlen_attn_2_11)
    assert call is not None and not call.takes_gqa
    _check_against_sdpa(call, heads, kv_heads, torch.bfloat16)


def test_the_stand_in_refuses_the_call_without_key_boundaries(flash_on_cpu):
    """What stopped the first GPU run: `cu_seq_k=None` is refused here as the CUDA flash kernel refuses it."""
    q, k, v, cu = _packed_qkv(4, 4, [3, 5], torch.bfloat16)
    q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))
    with pytest.raises(RuntimeError, match="both cum_seq_q and cum_seq_k"):
        varlen_attn(q, k, v, cu, None, 5, 5, scale=None, window_size=(-1, 0))
    out = varlen_attn(q, k, v, cu, cu, 5, 5, window_size=(-1, 0))  # the same call with both boundaries runs
    assert out.shape == q.shape


def test_the_installed_call_runs_on_the_meta_device():
    """torch's fake kernels take the call too (what a compiled or traced forward goes through), forward and backward."""
    q, k, v, cu = _packed_qkv(4, 2, [5, 1, 9], torch.bfloat16, device="meta")
    # A meta tensor has no values to read the lengths from: hand the plan over as a packed forward caches it.
    setattr(cu, _PLAN_ATTR, [(1, [5]), (5, [0]), (9, [6])])
    out = varlen_call()(q, k, v, cu, None)
    assert out.shape == (1, 15, 4, 16) and out.device.type == "meta"
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("release", sorted(SIGNATURES))
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_the_call_binds_to_the_signatures_of_older_torch(release, kv_heads):
    """Against torch 2.11's and 2.10's `varlen_attn`: only keywords they have, both boundaries, causal."""
    signature = _signature(SIGNATURES[release])
    call = VarlenCall.of(varlen_attn, signature)
    assert call is not None and not call.takes_gqa
    q, k, v = torch.zeros(12, 4, 8), torch.zeros(12, kv_heads, 8), torch.zeros(12, kv_heads, 8)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    args, kwargs = call.arguments(q, k, v, cu, 7, 0.25)
    bound = signature.bind(*args, **kwargs).arguments  # a TypeError for a keyword that release lacks
    assert bound["cu_seq_q"] is cu and bound["cu_seq_k"] is cu
    assert (bound["max_q"], bound["max_k"], bound["scale"]) == (7, 7, 0.25)
    assert bound.get("window_size", (-1, 0)) == (-1, 0) and bound.get("is_causal", True) is True
    assert "enable_gqa" not in bound  # grouped heads go to the kernel as they are (2.11's FA2 takes them)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_the_call_binds_to_the_installed_signature(kv_heads):
    """Against the installed `varlen_attn`: grouped heads are declared where the signature has `enable_gqa`."""
    signature = inspect.signature(varlen_attn)
    call = varlen_call()
    q, k, v = torch.zeros(12, 4, 8), torch.zeros(12, kv_heads, 8), torch.zeros(12, kv_heads, 8)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    args, kwargs = call.arguments(q, k, v, cu, 7, None)
    bound = signature.bind(*args, **kwargs)
    assert bound.arguments["cu_seq_k"] is cu
    if "enable_gqa" in signature.parameters:
        assert bound.arguments["enable_gqa"] is (kv_heads != 4)


def test_a_signature_without_scale_or_causality_is_not_used():
    """torch 2.9's `varlen_attn` (no scale) or one with no causal keyword: the packed forward runs SDPA instead."""
    older = _signature("(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)")
    assert VarlenCall.of(varlen_attn, older) is None
    assert (
        VarlenCall.of(varlen_attn, _signature("(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None)"))
        is None
    )
