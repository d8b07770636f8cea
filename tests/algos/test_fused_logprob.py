"""The fused LM head + log-prob/entropy against the unfused path: logits from F.linear, then logprobs_and_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conveyor.algos.fused_logprob import fused_chunk_shape, fused_linear_logprobs
from conveyor.algos.logprob import logprobs_and_entropy, sum_pi_squared_from_logits

N, H, V = 37, 16, 211


def _inputs(dtype: torch.dtype, bias: bool = True, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, b, labels


def _unfused(hidden, weight, bias, labels, with_entropy, temperature):
    lp, ent = logprobs_and_entropy(
        F.linear(hidden, weight, bias)[None], labels[None], with_entropy, temperature=temperature
    )
    return lp[0], (ent[0] if ent is not None else None)


def _grads(outputs, inputs, seed: int = 1):
    """Gradients of a random weighting of the outputs (as a loss weights log-probs and entropy)."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum() for o in outputs)
    return torch.autograd.grad(loss, [x for x in inputs if x is not None], retain_graph=True)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_block_equals_the_unfused_path_in_float32(with_entropy: bool, temperature: float) -> None:
    """One block of all tokens: the same matmul and reductions, so the same numbers and gradients at 1e-6."""
    hidden, weight, bias, labels = _inputs(torch.float32)
    want = [o for o in _unfused(hidden, weight, bias, labels, with_entropy, temperature) if o is not None]
    got = [
        o
        for o in fused_linear_logprobs(
            hidden, weight, labels, bias=bias, with_entropy=with_entropy, temperature=temperature, chunk_elements=N * V
        )
        if o is not None
    ]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    for g, w in zip(_grads(got, (hidden, weight, bias)), _grads(want, (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("vocab_chunk", [None, 64, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_and_vocab_blocks_equal_the_unfused_path(vocab_chunk, temperature: float) -> None:
    """Blocks of 5 tokens (and of the vocabulary): in float64 the same to 1e-10, gradients included; in float32 the
    only difference left is the matmul's rounding for another row count (the unfused path moves as much when its
    micro-batch changes). Single-column blocks (211 online merges) are checked in float64 only: float32 rounding
    adds up over that many merges, where a real vocabulary split has a few dozen."""
    chunk = 5 * (V if vocab_chunk is None else vocab_chunk)
    cases = ((torch.float64, 1e-10), (torch.float32, 2e-5)) if vocab_chunk != 1 else ((torch.float64, 1e-10),)
    for dtype, tol in cases:
        hidden, weight, bias, labels = _inputs(dtype)
        want = _unfused(hidden, weight, bias, labels, True, temperature)
        got = fused_linear_logprobs(
            hidden,
            weight,
            labels,
            bias=bias,
            with_entropy=True,
            temperature=temperature,
            chunk_elements=chunk,
            vocab_chunk=vocab_chunk,
        )
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=tol, rtol=tol)
        for g, w in zip(_grads(got, (hidden, weight, bias)), _grads(want, (hidden, weight, bias)), strict=True):
            torch.testing.assert_close(g, w, atol=tol, rtol=tol)


@pytest.mark.parametrize("vocab_chunk", [None, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sum_pi_squared_equals_the_logits_path_and_changes_nothing_else(vocab_chunk, temperature: float) -> None:
    """Σπ² from the fused head (whole-vocabulary and split blocks, merged online) equals `sum_pi_squared_from_logits`
    on the same logits at 1e-6 in float32; the log-probs, entropy and their gradients are those of a forward that
    did not ask for it, bit for bit, and Σπ² itself carries no gradient."""
    hidden, weight, bias, labels = _inputs(torch.float32)
    kwargs = dict(bias=bias, with_entropy=True, temperature=temperature, vocab_chunk=vocab_chunk)
    kwargs["chunk_elements"] = 5 * (V if vocab_chunk is None else vocab_chunk)
    want = sum_pi_squared_from_logits(F.linear(hidden, weight, bias)[None].detach(), temperature=temperature)[0]
    lp, ent, spp = fused_linear_logprobs(hidden, weight, labels, with_sum_pi_squared=True, **kwargs)
    assert spp.dtype == torch.float32 and spp.shape == (N,) and not spp.requires_grad
    torch.testing.assert_close(spp, want, atol=1e-6, rtol=1e-6)
    plain = fused_linear_logprobs(hidden, weight, labels, **kwargs)
    for g, w in zip((lp, ent), plain, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    for g, w in zip(_grads([lp, ent], (hidden, weight, bias)), _grads(plain, (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    alone = fused_linear_logprobs(
        hidden[None], weight, labels[None], with_sum_pi_squared=True, **kwargs | {"with_entropy": False}
    )
    assert alone[1] is None
    torch.testing.assert_close(alone[2], want[None], atol=1e-6, rtol=1e-6)


def test_sum_pi_squared_of_split_blocks_in_float64() -> None:
    """Many online merges (7-column blocks, 31 of them) in float64: the logits path's Σπ² to 1e-12."""
    hidden, weight, bias, labels = _inputs(torch.float64)
    want = sum_pi_squared_from_logits(F.linear(hidden, weight, bias)[None].detach(), temperature=1.3)[0]
    *_, spp = fused_linear_logprobs(
        hidden, weight, labels, bias=bias, with_sum_pi_squared=True, temperature=1.3, chunk_elements=35, vocab_chunk=7
    )
    torch.testing.assert_close(spp, want, atol=1e-12, rtol=1e-12)


def test_one_output_alone_and_no_bias() -> None:
    """Only the log-probs, or only the entropy, carry a gradient; a head without a bias."""
    hidden, weight, _, labels = _inputs(torch.float64, bias=False)
    want_lp, want_ent = _unfused(hidden, weight, None, labels, True, 1.3)
    lp, ent = fused_linear_logprobs(hidden, weight, labels, with_entropy=True, temperature=1.3, chunk_elements=4 * V)
    for got, want in ((lp, want_lp), (ent, want_ent)):
        for g, w in zip(_grads([got], (hidden, weight)), _grads([want], (hidden, weight)), strict=True):
            torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)


def test_masked_vocabulary_entries_give_no_nan() -> None:
    """A -inf bias (a banned token) has probability 0: entropy and gradients stay finite, as in the unfused path."""
    hidden, weight, bias, labels = _inputs(torch.float64)
    banned = bias.detach().clone()
    banned[::7] = float("-inf")
    labels = torch.where(labels % 7 == 0, labels + 1, labels)
    want = _unfused(hidden, weight, banned, labels, True, 1.0)
    got = fused_linear_logprobs(
        hidden, weight, labels, bias=banned, with_entropy=True, chunk_elements=3 * 50, vocab_chunk=50
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)
    grads = _grads(got, (hidden, weight))
    assert all(bool(torch.isfinite(g).all()) for g in grads)


def test_a_masked_first_vocabulary_block_gives_no_nan() -> None:
    """Logits that are all -inf in the first vocabulary blocks (both running normalisers -inf) merge to what the
    logits path gives: the entropy and Σπ² stay finite."""
    hidden, weight, bias, labels = _inputs(torch.float64)
    banned = bias.detach().clone()
    banned[:70] = float("-inf")
    labels = labels.clamp(min=70)
    want_lp, want_ent = _unfused(hidden, weight, banned, labels, True, 1.0)
    want_spp = sum_pi_squared_from_logits(F.linear(hidden, weight, banned)[None].detach())[0]
    got = fused_linear_logprobs(
        hidden,
        weight,
        labels,
        bias=banned,
        with_entropy=True,
        with_sum_pi_squared=True,
        chunk_elements=96,
        vocab_chunk=32,
    )
    for g, w in zip(got, (want_lp, want_ent, want_spp), strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)


def test_bfloat16_weights_match_the_unfused_path() -> None:
    """A bf16 head: logits computed in bf16 and upcast per block, the gradient handed back in bf16."""
    hidden, weight, _, labels = _inputs(torch.bfloat16, bias=False)
    want = _unfused(hidden, weight, None, labels, True, 1.0)
    got = fused_linear_logprobs(hidden, weight, labels, with_entropy=True, chunk_elements=N * V)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    for g, w in zip(_grads(got, (hidden, weight)), _grads(want, (hidden, weight)), strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2)


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("vocab_chunk", [None, 32])
def test_no_tensor_of_tokens_by_vocabulary_is_ever_made(vocab_chunk) -> None:
    """Forward and backward (and a forward asked for Σπ²) never hold more than one block of logits (the weight and
    its gradient aside)."""
    n, vocab = 200, 1500
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, 8, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    chunk = 16 * vocab if vocab_chunk is None else 16 * vocab_chunk
    with _Largest() as seen:
        lp, ent = fused_linear_logprobs(
            hidden, weight, labels, with_entropy=True, chunk_elements=chunk, vocab_chunk=vocab_chunk
        )
        (lp.sum() + ent.sum()).backward()
    assert seen.largest <= max(chunk, weight.numel()) < n * vocab
    with _Largest() as seen, torch.no_grad():  # the old-log-prob forward that also writes Σπ²
        fused_linear_logprobs(
            hidden,
            weight,
            labels,
            with_entropy=True,
            with_sum_pi_squared=True,
            chunk_elements=chunk,
            vocab_chunk=vocab_chunk,
        )
    assert seen.largest <= max(chunk, weight.numel()) < n * vocab
    with _Largest() as unfused:
        lp, ent = _unfused(hidden, weight, None, labels, True, 1.0)
    assert unfused.largest >= n * vocab  # the check sees the logits when they are made


def test_chunk_shape_and_refusals() -> None:
    """Rows fill the budget (at least one); bad shapes and settings are refused with what is wrong."""
    assert fused_chunk_shape(1000, 100, 2500, None) == (25, 100)
    assert fused_chunk_shape(1000, 100, 10, None) == (1, 100)
    assert fused_chunk_shape(10, 100, 10**9, 30) == (10, 30)
    hidden, weight, _, labels = _inputs(torch.float32, bias=False)
    with pytest.raises(ValueError, match="labels"):
        fused_linear_logprobs(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="agree in H"):
        fused_linear_logprobs(hidden[:, :-1], weight, labels)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprobs(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_chunk"):
        fused_linear_logprobs(hidden, weight, labels, vocab_chunk=0)
    lp, ent = fused_linear_logprobs(hidden[None], weight, labels[None])
    assert lp.shape == (1, N) and ent is None
