"""Blockwise log-probs and entropy: values and gradients against log_softmax, and memory."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.algos.logprob import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain full-vocabulary log_softmax gather and entropy, in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    label_logp = torch.gather(logp, -1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return label_logp, entropy


def test_by_hand() -> None:
    # logits (0, ln 3) -> softmax (1/4, 3/4); entropy = -(1/4 ln 1/4 + 3/4 ln 3/4).
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    labels = torch.tensor([[1, 0]])
    expected = torch.tensor([[math.log(0.75), math.log(0.25)]])
    torch.testing.assert_close(logprobs_from_logits(logits, labels), expected)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[h, h]]))


# Block sizes that exercise both ways of cutting the work: several whole
# sequences per block (large), and pieces of one sequence (small).
@pytest.mark.parametrize("chunk_elements", [None, 2 * 5 * 11, 3 * 11, 1])
def test_values_and_gradients_match_log_softmax(chunk_elements: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, length, vocab = 3, 5, 11
    base = torch.randn(batch, length, vocab, generator=gen) * 3
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    grad_lp = torch.randn(batch, length, generator=gen)
    grad_ent = torch.randn(batch, length, generator=gen)

    ref_in = base.clone().requires_grad_(True)
    ref_lp, ref_ent = _reference(ref_in, labels)
    (ref_lp * grad_lp + ref_ent * grad_ent).sum().backward()

    ours_in = base.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(ours_in, labels, True, chunk_elements=chunk_elements)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    (lp * grad_lp + ent * grad_ent).sum().backward()
    torch.testing.assert_close(ours_in.grad, ref_in.grad)

    # Log-probs alone (the actor loss path).
    ref_in.grad = None
    ref_lp, _ = _reference(ref_in, labels)
    (ref_lp * grad_lp).sum().backward()
    only_in = base.clone().requires_grad_(True)
    lp_only = logprobs_from_logits(only_in, labels, chunk_elements=chunk_elements)
    (lp_only * grad_lp).sum().backward()
    torch.testing.assert_close(only_in.grad, ref_in.grad)


def test_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda x: logprobs_and_entropy(x, labels, True, chunk_elements=7), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, chunk_elements=5), (logits,))


def test_bf16_logits_give_float32_results_and_bf16_grads() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 4, 16, generator=gen) * 2).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 16, (2, 4), generator=gen)
    lp, ent = logprobs_and_entropy(logits, labels, True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_lp, ref_ent = _reference(logits.detach(), labels)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_non_contiguous_and_2d_inputs() -> None:
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(2, 6, 7, generator=gen)
    labels = torch.randint(0, 7, (2, 5), generator=gen)
    sliced = full[:, :-1]  # the usual "drop the last position" view: not contiguous
    assert not sliced.is_contiguous()
    ref_lp, _ = _reference(sliced, labels)
    torch.testing.assert_close(logprobs_from_logits(sliced, labels, chunk_elements=7 * 2), ref_lp)
    flat_lp = logprobs_from_logits(sliced.reshape(10, 7), labels.reshape(10))
    torch.testing.assert_close(flat_lp, ref_lp.reshape(10))


def test_no_graph_without_grad_and_shape_errors() -> None:
    logits = torch.randn(1, 2, 3)
    labels = torch.zeros(1, 2, dtype=torch.long)
    lp, ent = logprobs_and_entropy(logits, labels, False)
    assert ent is None and lp.grad_fn is None
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(logits, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        logprobs_from_logits(torch.randn(3), torch.zeros((), dtype=torch.long))


def test_backward_keeps_no_full_vocabulary_float32_copy() -> None:
    # What autograd holds for the backward pass: the reference keeps a float32
    # (B, T, V) log_softmax of bf16 logits; ours keeps only the logits themselves
    # plus per-token vectors.
    batch, length, vocab = 2, 8, 4096
    logits = torch.randn(batch, length, vocab).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, vocab, (batch, length))

    def saved_bytes(fn) -> int:
        total = 0
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        out.sum().backward()
        return total

    logits_bytes = logits.numel() * logits.element_size()
    ours = saved_bytes(lambda: logprobs_from_logits(logits, labels, chunk_elements=vocab * 4))
    reference = saved_bytes(lambda: _reference(logits, labels)[0])
    assert ours <= logits_bytes + 64 * batch * length
    assert reference >= logits.numel() * 4


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_temperature_inside_blocks_equals_dividing_the_whole_logits(temperature):
    """The in-block temperature gives the numbers (and gradients) of `logits.float() / T` at 1e-6, in float32."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5))
    ref_in = logits.detach().clone().requires_grad_(True)
    ref_lp, ref_ent = logprobs_and_entropy(ref_in / temperature, labels, True, chunk_elements=22)
    lp, ent = logprobs_and_entropy(logits, labels, True, chunk_elements=22, temperature=temperature)
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=0)
    w1, w2 = torch.randn(3, 5), torch.randn(3, 5)
    ((ref_lp * w1).sum() + (ref_ent * w2).sum()).backward()
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    torch.testing.assert_close(logits.grad, ref_in.grad, atol=1e-6, rtol=0)


def test_temperature_gradcheck_float64():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(
        lambda x: logprobs_and_entropy(x, labels, True, chunk_elements=4, temperature=0.6), (logits,)
    )


def test_bf16_logits_match_float32_within_bf16_rounding():
    """bf16 logits (what a bf16 model returns) against the same logits kept in float32.

    Rounding to bf16 moves each logit by at most 2^-9 of its magnitude, so a
    log-prob (label logit minus log-sum-exp) moves by at most 2 x 2^-9 x max|z / T|,
    and the entropy by no more: that is the tolerance (about 0.07 for logits of
    magnitude 15 at T = 0.8; measured 0.063 over 64 x 64 x 1000 such logits).
    """
    torch.manual_seed(2)
    logits32 = torch.randn(16, 16, 1000) * 3
    labels = torch.randint(0, 1000, (16, 16))
    bound = 2 * 2**-9 * float(logits32.abs().max()) / 0.8
    lp32, ent32 = logprobs_and_entropy(logits32, labels, True, temperature=0.8)
    lp16, ent16 = logprobs_and_entropy(logits32.bfloat16(), labels, True, temperature=0.8)
    assert lp16.dtype == torch.float32
    assert float((lp16 - lp32).abs().max()) <= bound
    assert float((ent16 - ent32).abs().max()) <= bound


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
