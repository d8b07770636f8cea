"""The rollout's sampling mask replayed on every forward path (padded, lean, packed, fused) of the actor's forward."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from update_batches import forward_worker, ragged_update_fields

from conveyor.algos.logprob import logprobs_and_entropy
from conveyor.algos.sampling_mask import Truncation
from conveyor.config import load_config
from conveyor.workers.ranks.forward import replayed_truncation

TRUNC = Truncation(top_k=7, top_p=0.8, min_p=0.02)


@pytest.mark.parametrize("impl", ["hf", "lean", "hf-packed"])
@pytest.mark.parametrize("fused", [False, True])
def test_every_path_replays_the_mask(impl: str, fused: bool) -> None:
    td = TensorDict(ragged_update_fields(5, 4, 3, 40, torch.Generator().manual_seed(1)), batch_size=[5])
    forward = forward_worker(impl.removesuffix("-packed"), packed=impl.endswith("-packed"), fused=fused).forward
    assert forward.fused is fused
    mask = td["response_mask"]
    with torch.no_grad():
        logits, _ = forward.response_logits(td, None, False)
        want_lp, want_ent = logprobs_and_entropy(logits.float() / 0.7, td["responses"], True, truncation=TRUNC)
        full_lp, _ = logprobs_and_entropy(logits.float() / 0.7, td["responses"], False)
        lp, ent, _ = forward.log_probs(td, 0.7, True, truncation=TRUNC)
        stats = forward.no_grad_token_stats(td, 2, 0.7, with_entropy=True, with_sum_pi_squared=True, truncation=TRUNC)
    torch.testing.assert_close(lp * mask, want_lp * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent * mask, want_ent * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.log_probs, want_lp * mask, atol=1e-5, rtol=0)
    # The mask did something: the replayed log-probs are above the full softmax's wherever a token was dropped.
    assert bool(((lp - full_lp) * mask > 1e-3).any())
    # The update's forward (with gradients) replays it too, and its gradient is finite.
    forward.model.train()
    lp_train, _, _ = forward.log_probs(td, 0.7, False, train=True, truncation=TRUNC)
    torch.testing.assert_close(lp_train * mask, want_lp * mask, atol=1e-5, rtol=0)
    (lp_train * mask).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in forward.model.parameters() if p.grad is not None)


def test_the_worker_replays_what_the_rollout_samples_with() -> None:
    def of(*overrides: str) -> Truncation | None:
        return replayed_truncation(load_config(None, list(overrides)).actor_rollout_ref.rollout)

    assert of() is None  # the default run: the full softmax, bit for bit
    assert of("actor_rollout_ref.rollout.top_p=0.8") == Truncation(0, 0.8, 0.0)
    assert of("actor_rollout_ref.rollout.top_k=5", "actor_rollout_ref.rollout.min_p=0.1") == Truncation(5, 1.0, 0.1)
    assert of("actor_rollout_ref.rollout.top_p=0.8", "actor_rollout_ref.rollout.sampling_mask.replay=false") is None
    assert of("actor_rollout_ref.rollout.top_p=0.8", "actor_rollout_ref.rollout.do_sample=false") is None
