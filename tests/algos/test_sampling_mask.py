"""The sampling mask (top-k, top-p, min-p) against vLLM's own sampler functions, and replayed in every log-prob path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.algos.fused_logprob import fused_linear_logprobs
from conveyor.algos.logprob import logprobs_and_entropy, sum_pi_squared_from_logits
from conveyor.algos.sampling_mask import Truncation, truncate, truncated_log_softmax

SETTINGS = [(0, 0.8, 0.0), (5, 1.0, 0.0), (0, 1.0, 0.1), (5, 0.8, 0.0), (7, 0.5, 0.05), (0, 0.3, 0.0), (3, 0.95, 0.2)]


def _logits(rows: int, vocab: int, seed: int, ties: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen) * 2
    # Rounded to a coarse grid, many logits tie, at the k-th place and at the top-p boundary too.
    return (z * 2).round() / 2 if ties else z


def _vllm_mask(z: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """What vLLM's CPU sampler keeps of tempered logits z (rows, V), by its own functions, in its order."""
    builtin = pytest.importorskip("vllm.v1.sample.logits_processor.builtin")
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    x = z.clone()
    rows = x.shape[0]
    if min_p > 0:
        proc = builtin.MinPLogitsProcessor.__new__(builtin.MinPLogitsProcessor)
        proc.min_p_count, proc.min_p = rows, torch.full((rows, 1), min_p)
        x = proc.apply(x)
    k = torch.full((rows,), top_k, dtype=torch.int32) if top_k else None
    p = torch.full((rows,), top_p) if top_p < 1 else None
    x = ops.apply_top_k_top_p_pytorch(x, k, p, allow_cpu_sync=True)
    return torch.isfinite(x)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(("top_k", "top_p", "min_p"), SETTINGS)
def test_the_mask_is_vllms(top_k, top_p, min_p, ties) -> None:
    z = _logits(64, 50, seed=top_k + int(100 * top_p), ties=ties) / 0.7
    ours = torch.isfinite(truncate(z, Truncation(top_k, top_p, min_p)))
    assert torch.equal(ours, _vllm_mask(z, top_k, top_p, min_p))
    assert bool(ours.any(-1).all())  # never an empty row


def test_by_hand_and_off() -> None:
    z = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()

    def kept(top_k, top_p, min_p=0.0):
        return torch.isfinite(truncate(z, Truncation(top_k, top_p, min_p)))[0].tolist()

    assert kept(0, 0.6) == [True, True, False, False]  # 0.5 < 0.6: the token crossing the boundary stays
    assert kept(0, 0.1) == [True, False, False, False]
    assert kept(2, 1.0) == [True, True, False, False]
    assert kept(0, 1.0, 0.35) == [True, True, False, False]  # 0.15 < 0.35 x 0.5
    # A token outside the mask that the caller names (a sampled label) is kept.
    assert torch.isfinite(truncate(z, Truncation(1, 1.0), torch.tensor([3])))[0].tolist() == [True, False, False, True]
    # Nothing set: no truncation object, and the logits come back as they are.
    assert Truncation.of(0, 1.0, 0.0) is None and Truncation.of(-1, 1.0) is None
    assert truncate(z, None) is z and truncate(z, Truncation(50, 1.0)) is z
    with pytest.raises(ValueError, match="top_p"):
        Truncation(0, 0.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("top_k", "top_p", "min_p"), SETTINGS[:4])
def test_blockwise_log_probs_entropy_and_gradients_replay_the_mask(top_k, top_p, min_p, temperature) -> None:
    trunc = Truncation(top_k, top_p, min_p)
    logits = _logits(2 * 9, 40, seed=3, ties=False).double().view(2, 9, 40).requires_grad_()
    labels = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    # The reference: the whole-vocabulary truncated log-softmax, labels kept like the blockwise path keeps them.
    z = truncate(logits / temperature, trunc, labels)
    ref_logp = torch.log_softmax(z, -1)
    ref_lp = ref_logp.gather(-1, labels[..., None])[..., 0]
    p = ref_logp.exp()
    ref_ent = -(p * torch.where(p > 0, ref_logp, torch.zeros_like(p))).sum(-1)  # 0 x -inf would be NaN
    # Tiny blocks: rows of one sequence at a time, the backward recomputing each block's mask.
    lp, ent = logprobs_and_entropy(
        logits, labels, True, chunk_elements=40 * 4, temperature=temperature, truncation=trunc
    )
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    w = torch.randn(2, 2, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    g = torch.autograd.grad((lp * w[0] + ent * w[1]).sum(), logits)[0]
    g_ref = torch.autograd.grad((ref_lp * w[0] + ref_ent * w[1]).sum(), logits)[0]
    torch.testing.assert_close(g, g_ref)
    # The sampled labels are in the mask: the same as the plain truncated log-softmax.
    sampled = torch.distributions.Categorical(
        logits=truncated_log_softmax(logits.detach(), trunc, temperature)
    ).sample()
    lp_s = logprobs_and_entropy(logits.detach(), sampled, False, temperature=temperature, truncation=trunc)[0]
    full = truncated_log_softmax(logits.detach(), trunc, temperature).gather(-1, sampled[..., None])[..., 0]
    torch.testing.assert_close(lp_s, full.float() if lp_s.dtype == torch.float32 else full)
    spp = sum_pi_squared_from_logits(logits.detach(), temperature=temperature, truncation=trunc)
    torch.testing.assert_close(spp, truncated_log_softmax(logits.detach(), trunc, temperature).exp().pow(2).sum(-1))


@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_fused_head_replays_the_mask_block_by_block(with_entropy) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 8, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(31, 8, generator=gen, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, 31, (23,), generator=gen)
    trunc = Truncation(5, 0.8, 0.05)
    # Blocks of 2 rows, the whole vocabulary each (a vocabulary chunk is ignored under a mask).
    fused = fused_linear_logprobs(
        hidden,
        weight,
        labels,
        with_entropy=with_entropy,
        temperature=0.7,
        truncation=trunc,
        chunk_elements=31 * 2,
        vocab_chunk=8,
    )
    ref = logprobs_and_entropy(
        F.linear(hidden, weight)[None], labels[None], with_entropy, temperature=0.7, truncation=trunc
    )
    outs = [o for o in fused if o is not None]
    refs = [r[0] for r in ref if r is not None]
    for a, b in zip(outs, refs):
        torch.testing.assert_close(a, b)
    loss, loss_ref = (
        sum(o.sum() * (i + 1) for i, o in enumerate(outs)),
        sum(r.sum() * (i + 1) for i, r in enumerate(refs)),
    )
    for a, b in zip(torch.autograd.grad(loss, [hidden, weight]), torch.autograd.grad(loss_ref, [hidden, weight])):
        torch.testing.assert_close(a, b)
