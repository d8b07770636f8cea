"""The policy forward's log-probs and entropy: from the model's own logits (the temperature applied per block), or
from the fused LM head (`use_fused_kernels`) with the same numbers and gradients."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from update_batches import forward_worker, ragged_update_fields

import conveyor.workers.ranks.forward as forward_module
from conveyor.algos.logprob import logprobs_and_entropy
from conveyor.protocol import KVBatchMeta
from conveyor.workers.ranks.calls import LogProbCall


@pytest.fixture(scope="module")
def td() -> TensorDict:
    fields = ragged_update_fields(5, 4, 3, 40, torch.Generator().manual_seed(1))
    return TensorDict(fields, batch_size=[5])


@pytest.mark.parametrize("impl", ["hf", "lean", "hf-packed"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("fused", [False, True])
def test_log_probs_equal_the_whole_logits_float32_formula(
    td: TensorDict, impl: str, temperature: float, fused: bool
) -> None:
    """Against what the forward computed before: the whole logits upcast, divided by T, then log-softmaxed."""
    forward = forward_worker(impl.removesuffix("-packed"), packed=impl.endswith("-packed"), fused=fused).forward
    with torch.no_grad():
        lp, ent, _ = forward.log_probs(td, temperature, True)
        logits, _ = forward.response_logits(td, None, False)
        want_lp, want_ent = logprobs_and_entropy(logits.float() / temperature, td["responses"], True)
    # A packed forward computes the response tokens only (0 after a row's last one); the others are masked anyway.
    mask = td["response_mask"]
    torch.testing.assert_close(lp * mask, want_lp * mask, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent * mask, want_ent * mask, atol=1e-6, rtol=0)


@pytest.mark.parametrize("packed", [False, True])
def test_no_copy_of_the_logits_is_made(td: TensorDict, monkeypatch: pytest.MonkeyPatch, packed: bool) -> None:
    """Unfused, the logits reach logprobs_and_entropy as the model returned them (a view, no upcast or division);
    packed, they are the (1, N, V) logits of the response tokens only."""
    forward = forward_worker("hf", packed=packed, fused=False).forward
    assert forward.packed is packed
    seen = {}
    # The padded path's logits come from response_logits, the packed path's from the forward itself.
    name = "_hf_forward" if packed else "response_logits"
    real = getattr(forward, name)

    def recording_logits(*args, **kwargs):
        out = real(*args, **kwargs)
        seen["model"] = out[0]
        return out

    def recording(logits, labels, with_entropy, **kwargs):
        seen["given"], seen["temperature"] = logits, kwargs.get("temperature")
        return logprobs_and_entropy(logits, labels, with_entropy, **kwargs)

    monkeypatch.setattr(forward, name, recording_logits)
    monkeypatch.setattr(forward_module, "logprobs_and_entropy", recording)
    with torch.no_grad():
        forward.log_probs(td, 0.5, True)
    assert seen["given"] is seen["model"] and seen["temperature"] == 0.5
    if packed:  # responses here have no tool tokens: the span is the mask
        assert seen["model"].shape[:2] == (1, int(td["response_mask"].bool().sum()))


@pytest.mark.parametrize("impl", ["hf", "lean", "hf-packed"])
def test_fused_head_gives_the_logits_path_log_probs_entropy_and_gradients(td: TensorDict, impl: str) -> None:
    """The old-log-prob forward (no grad) and the update's forward (with grad) of the fused head against the logits
    path, on the same weights: outputs at 1e-6, every parameter's gradient at 1e-6 (+1e-5 relative)."""
    kind, packed = impl.removesuffix("-packed"), impl.endswith("-packed")
    fused, plain = forward_worker(kind, packed, fused=True).forward, forward_worker(kind, packed, fused=False).forward
    assert fused.fused and not plain.fused and fused.uses_lean() == (kind == "lean")
    mask = td["response_mask"]
    with torch.no_grad():
        got = fused.log_probs(td, 0.7, True)
        want = plain.log_probs(td, 0.7, True)
    for g, w in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(g * mask, w * mask, atol=1e-6, rtol=1e-6)
    grads = []
    for forward in (fused, plain):
        forward.model.zero_grad(set_to_none=True)
        lp, ent, _ = forward.log_probs(td, 0.7, True, train=True)
        ((lp * td["advantages"] + 0.01 * ent) * mask).sum().backward()
        grads.append({n: p.grad for n, p in forward.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "lm_head.weight" in grads[1]
    for name, want_grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], want_grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("impl", ["hf", "lean", "hf-packed"])
def test_fused_head_writes_the_logits_path_sum_pi_squared(
    td: TensorDict, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old-log-prob forward asked for Σπ² (the optimal token baselines' input): with the fused head on it writes
    the same sum_pi_squared, old_log_probs and entropy as the logits path at 1e-6, and never computes the logits'
    log-softmax or Σπ² (the fused head's forward never holds them)."""
    kind, packed = impl.removesuffix("-packed"), impl.endswith("-packed")
    names = ["old_log_probs", "entropy", "sum_pi_squared"]
    call = LogProbCall(temperature=0.7, calculate_entropy=True, calculate_sum_pi_squared=True).to_extra_info()
    keys = [f"s{i}" for i in range(td.batch_size[0])]
    fields = {k: td[k] for k in ("prompts", "prompt_mask", "responses", "response_mask")}
    written = {}
    for fused in (False, True):
        worker = forward_worker(kind, packed, fused=fused)
        assert worker.forward.fused is fused
        if fused:
            for name in ("logprobs_and_entropy", "sum_pi_squared_from_logits"):
                monkeypatch.setattr(forward_module, name, _refused(name))
        worker.data_plane.kv_batch_put(keys, "p", fields)
        out = worker.compute_log_prob(KVBatchMeta(keys, "p").with_extra_info(**call))
        assert set(names) <= set(out.fields)
        written[fused] = worker.data_plane.kv_batch_get(keys, "p", names)
    mask = td["response_mask"].bool()
    assert bool((written[False]["sum_pi_squared"][mask] > 0).all())
    for name in names:
        got, want = written[True][name], written[False][name]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")


def _refused(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the fused forward called {name} on logits")

    return refuse
