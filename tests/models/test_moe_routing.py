"""Tests for MoE routing capture and replay on tiny Qwen3-MoE, Mixtral, OLMoE and Qwen2-MoE models."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from conveyor.models.moe_routing import (
    MoEInfo,
    RoutingRecorder,
    compute_routing_agreement,
    moe_info,
    moe_layers,
    replay_routing,
    routed_experts_dtype,
)

VOCAB = 50
B, S = 2, 6

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    # Large init so that swapping experts moves the logits well above float noise.
    initializer_range=0.2,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (config factory, renormalises top-k weights)
ARCHS = {
    "qwen3_moe": (
        lambda: Qwen3MoeConfig(
            **_COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
        False,
    ),
    "qwen3_moe_norm": (
        lambda: Qwen3MoeConfig(
            **_COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        True,
    ),
    "mixtral": (
        lambda: MixtralConfig(
            **_COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        True,
    ),
    "olmoe": (
        lambda: OlmoeConfig(
            **_COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
        False,
    ),
    "olmoe_norm": (
        lambda: OlmoeConfig(
            **_COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        True,
    ),
    "qwen2_moe": (
        lambda: Qwen2MoeConfig(
            **_COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        True,
    ),
}


def build(config) -> nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    # A spread-out router makes top-k decisive: no near-ties to flip under float noise.
    for block, _ in blocks_and_experts(model):
        nn.init.normal_(block.gate.weight, std=1.0)
    return model.eval()


def blocks_and_experts(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    return [(m, m.experts) for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]


def input_ids(batch: int = B, seq: int = S, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=gen)


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


class ExpertInputs:
    """Captures the (top_k_index, top_k_weights) each experts module actually receives, in call order."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handles = [experts.register_forward_pre_hook(self._hook) for _, experts in blocks_and_experts(model)]

    def _hook(self, module: nn.Module, args: tuple) -> None:
        self.calls.append((args[1].clone(), args[2].detach().clone()))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@pytest.fixture(params=list(ARCHS))
def arch(request) -> str:
    return request.param


@pytest.fixture
def model(arch: str) -> nn.Module:
    return build(ARCHS[arch][0]())


def own_routing(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        model(ids)
    return recorder.pop()


def rotated(routing: torch.Tensor, num_experts: int) -> torch.Tensor:
    return ((routing.long() + 1) % num_experts).to(routing.dtype)


# --- moe_info and dtype --------------------------------------------------------------------------


def test_moe_info(model: nn.Module) -> None:
    config = model.config
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    assert moe_info(model) == MoEInfo(num_layers=2, num_experts=experts, top_k=2)


def test_dense_model_is_not_moe() -> None:
    dense = build(Qwen3Config(**_COMMON, num_hidden_layers=2, intermediate_size=64))
    assert moe_info(dense) is None
    with pytest.raises(ValueError, match="no sparse MoE layer"):
        RoutingRecorder(dense)
    with pytest.raises(ValueError, match="no sparse MoE layer"):
        with replay_routing(dense, torch.zeros(1, 2, 2, 2, dtype=torch.int16)):
            pass


def test_moe_info_counts_only_sparse_layers() -> None:
    config = ARCHS["qwen3_moe"][0]()
    config.num_hidden_layers = 3
    config.mlp_only_layers = [1]
    model = build(config)
    assert moe_info(model) == MoEInfo(num_layers=2, num_experts=8, top_k=2)
    ids = input_ids()
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        out = model(ids, output_router_logits=True)
    routing = recorder.pop()
    assert routing.shape == (B, S, 2, 2)
    # Recorded layer 1 is decoder layer 2, the second router to run.
    for layer, logits in enumerate(out.router_logits):
        assert torch.equal(routing[:, :, layer].long(), logits.topk(2, dim=-1).indices.reshape(B, S, 2))


def test_routed_experts_dtype() -> None:
    assert routed_experts_dtype(4) == torch.int8
    assert routed_experts_dtype(127) == torch.int8
    assert routed_experts_dtype(128) == torch.int8  # ids 0..127
    assert torch.tensor([-1, 127], dtype=routed_experts_dtype(128)).tolist() == [-1, 127]
    assert routed_experts_dtype(129) == torch.int16
    assert routed_experts_dtype(32768) == torch.int16
    assert torch.tensor([-1, 126], dtype=routed_experts_dtype(127)).tolist() == [-1, 126]
    with pytest.raises(ValueError, match="num_experts"):
        routed_experts_dtype(0)
    with pytest.raises(ValueError, match="num_experts"):
        routed_experts_dtype(40000)


# --- recording ------------------------------------------------------------------------------------


def test_recorder_matches_router_top_k(model: nn.Module) -> None:
    info = moe_info(model)
    ids = input_ids()
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        out = model(ids, output_router_logits=True)
    routing = recorder.pop()
    assert routing.shape == (B, S, info.num_layers, info.top_k)
    assert routing.dtype == torch.int16
    assert len(out.router_logits) == info.num_layers
    for layer, logits in enumerate(out.router_logits):
        probs = torch.softmax(logits.float(), dim=-1)
        expected = probs.topk(info.top_k, dim=-1).indices.reshape(B, S, info.top_k)
        # Same ids in the router's ranked order, not just the same set.
        assert torch.equal(routing[:, :, layer].long(), expected)


def test_recorder_removes_hooks_and_leaves_forward_unchanged(model: nn.Module) -> None:
    ids = input_ids()
    with torch.no_grad():
        before = model(ids).logits
        baseline_hooks = hook_count(model)
        with RoutingRecorder(model) as recorder:
            assert hook_count(model) > baseline_hooks
            during = model(ids).logits
        assert hook_count(model) == baseline_hooks
        after = model(ids).logits
    assert torch.equal(before, during)
    assert torch.equal(before, after)
    assert recorder.pop().shape[:2] == (B, S)  # readable after exit


def test_recorder_removes_hooks_on_error(model: nn.Module) -> None:
    baseline_hooks = hook_count(model)
    with pytest.raises(KeyError):
        with RoutingRecorder(model):
            raise KeyError("boom")
    assert hook_count(model) == baseline_hooks


def test_recorder_pop_keeps_most_recent_and_pop_all_keeps_order(model: nn.Module) -> None:
    info = moe_info(model)
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        model(input_ids(seq=4))
        model(input_ids(batch=1, seq=3))
        assert recorder.pop().shape == (1, 3, info.num_layers, info.top_k)
        with pytest.raises(RuntimeError, match="no complete forward"):
            recorder.pop()
        model(input_ids(seq=4))
        model(input_ids(batch=1, seq=3))
        shapes = [r.shape[:2] for r in recorder.pop_all()]
    assert shapes == [(B, 4), (1, 3)]


def test_recorder_decode_step_matches_full_forward(model: nn.Module) -> None:
    ids = input_ids(seq=S + 1)
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        prefill = model(ids[:, :S], use_cache=True)
        model(ids[:, S:], cache=prefill.cache, use_cache=True)
        prefill_routing, decode_routing = recorder.pop_all()
        model(ids)
        full = recorder.pop()
    assert decode_routing.shape[:2] == (B, 1)
    assert torch.equal(torch.cat([prefill_routing, decode_routing], dim=1), full)


# --- replay -----------------------------------------------------------------------------------


def test_replay_own_routing_reproduces_logits(model: nn.Module) -> None:
    ids = input_ids()
    routing = own_routing(model, ids)
    baseline_hooks = hook_count(model)
    with torch.no_grad():
        expected = model(ids).logits
        with replay_routing(model, routing.to(routed_experts_dtype(moe_info(model).num_experts))):
            replayed = model(ids).logits
    torch.testing.assert_close(replayed, expected, atol=1e-5, rtol=0)
    assert hook_count(model) == baseline_hooks


def test_replay_routes_through_given_experts(arch: str, model: nn.Module) -> None:
    renormalizes = ARCHS[arch][1]
    info = moe_info(model)
    ids = input_ids()
    forced = rotated(own_routing(model, ids), info.num_experts)
    with torch.no_grad():
        expected_unforced = model(ids).logits
        seen = ExpertInputs(model)
        try:
            with replay_routing(model, forced), RoutingRecorder(model) as recorder:
                out = model(ids, output_router_logits=True)
        finally:
            seen.close()
    assert len(seen.calls) == info.num_layers
    for layer, (top_k_index, top_k_weights) in enumerate(seen.calls):
        assert torch.equal(top_k_index, forced[:, :, layer].reshape(B * S, -1).long())
        # Weights: the router's own softmax at the forced ids, renormalised as the model would.
        probs = torch.softmax(out.router_logits[layer].float(), dim=-1)
        weights = probs.gather(-1, top_k_index)
        if renormalizes:
            weights = weights / weights.sum(-1, keepdim=True)
        torch.testing.assert_close(top_k_weights.float(), weights, atol=1e-6, rtol=1e-6)
    assert torch.equal(recorder.pop(), forced.to(torch.int16))
    assert (out.logits - expected_unforced).abs().max() > 1e-3


def test_replay_gradient_reaches_router(model: nn.Module) -> None:
    ids = input_ids()
    routing = own_routing(model, ids)
    gates = [block.gate.weight for block, _ in blocks_and_experts(model)]
    model.train()

    def router_grads(replay: torch.Tensor | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with replay_routing(model, replay) if replay is not None else torch.enable_grad():
            model(ids, labels=ids).loss.backward()
        return [g.grad.clone() for g in gates]

    plain = router_grads(None)
    own = router_grads(routing)
    forced = router_grads(rotated(routing, moe_info(model).num_experts))
    for p, o, f in zip(plain, own, forced):
        assert f.abs().sum() > 0 and torch.isfinite(f).all()
        torch.testing.assert_close(o, p, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(f, p, atol=1e-6)


def test_replay_unknown_slots_fall_back_to_own_routing(model: nn.Module) -> None:
    info = moe_info(model)
    ids = input_ids()
    own = own_routing(model, ids)
    forced = rotated(own, info.num_experts)
    forced[0, 1, 0, 1] = -1  # one unknown slot: the whole token falls back at that layer
    forced[1, 3, 1, :] = -1
    forced[:, S - 1, :, :] = -1  # like the never-fed last sampled token
    with torch.no_grad(), RoutingRecorder(model) as recorder, replay_routing(model, forced):
        out = model(ids, output_router_logits=True)
    replayed = recorder.pop()
    # The router's own choice in this forward: past layer 0 the hidden states already differ
    # from the unforced forward, so "own routing" must come from these router logits.
    own_here = torch.stack(
        [logits.topk(info.top_k, dim=-1).indices.reshape(B, S, -1) for logits in out.router_logits], dim=2
    ).to(torch.int16)
    assert torch.equal(own_here[:, :, 0], own[:, :, 0])
    unknown = (forced < 0).any(dim=-1, keepdim=True)
    assert torch.equal(replayed, torch.where(unknown, own_here, forced))

    with torch.no_grad():
        expected = model(ids).logits
        with replay_routing(model, torch.full_like(own, -1)):
            all_unknown = model(ids).logits
    torch.testing.assert_close(all_unknown, expected, atol=1e-5, rtol=0)


def _hold_router_weights_apart(model: nn.Module) -> list:
    """Each router's weight held on the meta device between forwards and on the CPU during its own forward.

    What FSDP2's CPU offload does on a GPU (parameters on the host between forwards, gathered onto the GPU
    for the forward), with meta standing in for the host and the CPU for the GPU.
    """
    handles = []
    for block, _ in blocks_and_experts(model):
        router = block.gate
        computed = router.weight
        held = nn.Parameter(torch.empty_like(computed, device="meta"))
        router._parameters["weight"] = held
        handles.append(
            router.register_forward_pre_hook(lambda m, args, w=computed: m._parameters.__setitem__("weight", w))
        )
        handles.append(
            router.register_forward_hook(lambda m, args, out, w=held: m._parameters.__setitem__("weight", w))
        )
    return handles


def test_replay_follows_the_routers_compute_device_not_its_parameters(model: nn.Module) -> None:
    """R3 with the actor's param_offload: routing replays where the router computes, whatever holds its weights."""
    info = moe_info(model)
    ids = input_ids()
    forced = rotated(own_routing(model, ids), info.num_experts)
    with torch.no_grad(), replay_routing(model, forced):
        expected = model(ids).logits
    _hold_router_weights_apart(model)
    assert all(block.gate.weight.device.type == "meta" for block, _ in blocks_and_experts(model))
    with torch.no_grad(), RoutingRecorder(model) as recorder, replay_routing(model, forced):
        replayed = model(ids).logits
    torch.testing.assert_close(replayed, expected, atol=1e-6, rtol=0)
    assert torch.equal(recorder.pop(), forced.to(torch.int16))


def test_replay_moves_recorded_ids_to_the_router_outputs_device(model: nn.Module) -> None:
    """`MoELayer.replay` of a router output on one device and recorded ids on another: the output's device wins."""
    layer = moe_layers(model)[0]
    n, experts, top_k = 6, layer.router.num_experts, layer.router.top_k
    output = (
        torch.randn(n, experts, device="meta"),
        torch.empty(n, top_k, device="meta"),
        torch.empty(n, top_k, dtype=torch.long, device="meta"),
    )
    recorded = torch.arange(n * top_k).reshape(n, top_k) % experts  # on the CPU
    logits, weights, chosen = layer.replay(output, recorded)
    assert {t.device.type for t in (logits, weights, chosen)} == {"meta"}
    assert chosen.shape == (n, top_k) and chosen.dtype == torch.long and weights.shape == (n, top_k)


def test_replay_rejects_bad_routing(model: nn.Module) -> None:
    info = moe_info(model)
    ids = input_ids()
    routing = own_routing(model, ids)
    baseline_hooks = hook_count(model)
    with pytest.raises(ValueError, match=r"\(2, 6, 1, 2\)"):
        with replay_routing(model, routing[:, :, :1]):
            pass
    with pytest.raises(ValueError, match="integer"):
        with replay_routing(model, routing.float()):
            pass
    too_big = routing.clone()
    too_big[0, 0, 0, 0] = info.num_experts
    with pytest.raises(ValueError, match="ids must lie"):
        with replay_routing(model, too_big):
            pass
    # (B, S) is checked against the forward itself, naming both shapes; hooks go away on the error.
    with pytest.raises(ValueError, match=r"\(2, 6, 2, 2\).*\(2, 5\)"):
        with torch.no_grad(), replay_routing(model, routing):
            model(ids[:, :5])
    assert hook_count(model) == baseline_hooks


# --- agreement ----------------------------------------------------------------------------------


def test_routing_agreement_hand_made() -> None:
    # B=1, S=3, L=2, K=2: six (token, layer) pairs.
    train = torch.tensor([[[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[3, 0], [1, 2]]]], dtype=torch.int16)
    rollout = torch.tensor([[[[1, 0], [2, 3]], [[1, 3], [-1, 3]], [[3, 0], [2, 1]]]], dtype=torch.int8)
    # Pairs: (t0,l0) same set in other order -> agree; (t0,l1) agree; (t1,l0) differ;
    # (t1,l1) unknown -> excluded; (t2,l0) agree; (t2,l1) agree in other order.
    all_valid = torch.ones(1, 3, dtype=torch.bool)
    assert compute_routing_agreement(train, rollout, all_valid) == pytest.approx(4 / 5)
    # Masking out token 2 leaves (t0,l0), (t0,l1), (t1,l0): 2 of 3.
    assert compute_routing_agreement(train, rollout, torch.tensor([[True, True, False]])) == pytest.approx(2 / 3)
    assert compute_routing_agreement(train, rollout, torch.tensor([[False, True, False]])) == 0.0
    assert math.isnan(compute_routing_agreement(train, rollout, torch.zeros(1, 3, dtype=torch.bool)))


def test_routing_agreement_rejects_shapes() -> None:
    train = torch.zeros(1, 3, 2, 2, dtype=torch.int16)
    with pytest.raises(ValueError, match="rollout_experts"):
        compute_routing_agreement(train, torch.zeros(1, 3, 1, 2, dtype=torch.int16), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="valid_mask"):
        compute_routing_agreement(train, train, torch.ones(1, 4, dtype=torch.bool))
