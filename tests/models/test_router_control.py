"""Router controls on tiny real MoE models: the load-balancing loss against transformers', the selection bias."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from conveyor.models.moe_routing import RoutingRecorder, moe_layers, replay_routing
from conveyor.models.router_control import (
    BIAS_NAME,
    RouterTap,
    freeze_routers,
    has_selection_bias,
    install_selection_bias,
    load_balancing_loss,
    router_parameter_names,
    selection_bias_step,
    selection_biases,
    update_selection_bias,
)

COMMON = dict(
    vocab_size=40,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.2,
    tie_word_embeddings=False,
    pad_token_id=0,
)


def _model(arch: str = "qwen3_moe", norm: bool = True) -> torch.nn.Module:
    if arch == "mixtral":
        config = MixtralConfig(
            **COMMON, num_hidden_layers=2, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2
        )
    else:
        config = Qwen3MoeConfig(
            **COMMON,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=norm,
            output_router_logits=False,
        )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (3, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


def test_load_balancing_loss_is_transformers_on_random_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(3 * 7, 8, generator=gen) * 2 for _ in range(3))
    mask = (torch.rand(3, 7, generator=gen) > 0.3).long()
    want = load_balancing_loss_func(logits, 8, 2, mask)
    got = load_balancing_loss(list(logits), 8, 2, [mask.reshape(-1)] * 3)
    assert abs(float(got) - float(want)) < 1e-6
    assert abs(float(load_balancing_loss(list(logits), 8, 2)) - float(load_balancing_loss_func(logits, 8, 2))) < 1e-6
    # Perfect balance and one-expert collapse bound it: top_k and top_k * num_experts.
    assert float(got) > 2.0


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_tap_over_a_forward_gives_the_models_own_aux_loss(arch: str) -> None:
    model = _model(arch)
    ids, mask = _inputs()
    tap = RouterTap(model, keep_logits=True, count=True)
    with tap.active(mask.reshape(-1).bool()):
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    got = tap.aux_loss(top_k=2)
    assert abs(float(got.detach()) - float(out.aux_loss.detach())) < 1e-6
    # The gradient reaches the routers.
    got.backward()
    assert all(layer.router.weight.grad is not None for layer in moe_layers(model))
    # Counts: every real token, each layer, top-2 slots, of the router's own choice.
    load = tap.pop_load()
    assert load.shape == (2, 8) and torch.all(load.sum(dim=1) == 2 * int(mask.sum()))
    with RoutingRecorder(model) as rec:
        model(input_ids=ids, attention_mask=mask)
    own = rec.pop()[mask.bool()]  # (tokens, L, K)
    for layer in range(2):
        assert torch.equal(load[layer], torch.bincount(own[:, layer].reshape(-1).long(), minlength=8).double())


def test_the_tap_counts_the_routers_own_choice_under_replay() -> None:
    model = _model()
    ids, mask = _inputs()
    forced = torch.zeros(3, 7, 2, 2, dtype=torch.long)
    forced[..., 1] = 1  # every token through experts 0 and 1
    tap = RouterTap(model, keep_logits=False, count=True)
    with replay_routing(model, forced), tap.active(mask.reshape(-1).bool()):
        model(input_ids=ids, attention_mask=mask)
    load = tap.pop_load()
    assert float(load[:, 2:].sum()) > 0, "the tap must see the router's choice, not the replayed experts"


def test_freeze_routers_stops_router_gradients_only() -> None:
    model = _model()
    names = router_parameter_names(model)
    assert names == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert freeze_routers(model) == 2
    params = dict(model.named_parameters())
    assert not any(params[n].requires_grad for n in names)
    assert sum(p.requires_grad for p in params.values()) == len(params) - 2


@pytest.mark.parametrize("norm", [True, False])
def test_selection_bias_chooses_experts_and_leaves_the_gating_weights_alone(norm: bool) -> None:
    model = _model(norm=norm)
    ids, mask = _inputs()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
    assert install_selection_bias(model) == 2 and has_selection_bias(model)
    assert install_selection_bias(model) == 2  # idempotent
    with torch.no_grad():
        zero = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(zero, plain), "a zero bias changes nothing"

    router = moe_layers(model)[0].router
    getattr(router, BIAS_NAME)[5] = 100.0  # expert 5 wins every token's selection
    hidden = torch.randn(11, 32)
    logits, weights, chosen = router(hidden)
    assert bool((chosen == 5).any(dim=-1).all())
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)  # the unbiased probabilities
    if norm:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights.float(), probs)
    # A recorder records the biased choice; the state dict carries the bias.
    with RoutingRecorder(model) as rec:
        model(input_ids=ids, attention_mask=mask)
    assert bool((rec.pop()[:, :, 0] == 5).any(dim=-1).all())
    assert "model.layers.0.mlp.gate.e_score_correction_bias" in model.state_dict()


def test_update_moves_each_bias_against_its_excess_load() -> None:
    model = _model()
    install_selection_bias(model)
    load = torch.tensor([[10.0, 2, 2, 2, 2, 2, 2, 2], [0.0] * 8])  # layer 1 saw no token
    metrics = update_selection_bias(model, load, 0.01)
    bias = selection_biases(model)
    assert bias[0, 0] == pytest.approx(-0.01) and torch.allclose(bias[0, 1:], torch.full((7,), 0.01))
    assert torch.equal(bias[1], torch.zeros(8))
    assert metrics["actor/moe/selection_bias/abs_max"] == pytest.approx(0.01)
    assert metrics["actor/moe/update_max_vio/max"] == pytest.approx(10 / 3 - 1)
    with pytest.raises(ValueError, match="load has shape"):
        update_selection_bias(model, torch.zeros(3, 8), 0.01)


# Layer 0: mean 4, so d = (mean - load) / mean = [-1.5, 0.5, 0.75, 0.25, 0, -0.05, 0.05, 0];
# layer 1 saw no token.
LOAD = torch.tensor([[10.0, 2, 1, 3, 4, 4.2, 3.8, 4], [0.0] * 8])


def test_sign_step_is_the_full_rate_against_any_deviation() -> None:
    step = selection_bias_step(LOAD, 0.1, "sign")
    want = torch.tensor([-0.1, 0.1, 0.1, 0.1, 0.0, -0.1, 0.1, 0.0])
    torch.testing.assert_close(step[0], want)
    assert torch.equal(step[1], torch.zeros(8))


def test_proportional_step_follows_the_relative_deviation_clipped_to_the_rate() -> None:
    step = selection_bias_step(LOAD, 0.1, "proportional")
    # -1.5 is clipped to -1: never a larger step than the sign rule's.
    want = torch.tensor([-0.1, 0.05, 0.075, 0.025, 0.0, -0.005, 0.005, 0.0])
    torch.testing.assert_close(step[0], want)
    assert torch.equal(step[1], torch.zeros(8))


@pytest.mark.parametrize("rule", ["sign", "proportional"])
def test_an_expert_inside_the_dead_band_keeps_its_bias(rule: str) -> None:
    step = selection_bias_step(LOAD, 0.1, rule, dead_band=0.3)
    inside = torch.tensor([False, False, False, True, True, True, True, True])  # |d| <= 0.3
    assert torch.equal(step[0][inside], torch.zeros(int(inside.sum())))
    torch.testing.assert_close(step[0][~inside], selection_bias_step(LOAD, 0.1, rule)[0][~inside])
    # A band wider than every deviation stops the update altogether: a balanced enough layer stays still.
    assert torch.equal(selection_bias_step(LOAD, 0.1, rule, dead_band=1.5), torch.zeros(2, 8))


def test_a_balanced_load_moves_no_bias_and_an_unknown_rule_is_refused() -> None:
    even = torch.full((2, 8), 5.0)
    for rule in ("sign", "proportional"):
        assert torch.equal(selection_bias_step(even, 0.1, rule), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="rule must be one of"):
        selection_bias_step(even, 0.1, "signum")


def test_update_applies_the_chosen_rule_and_reports_its_step() -> None:
    model = _model()
    install_selection_bias(model)
    metrics = update_selection_bias(model, LOAD, 0.1, "proportional", dead_band=0.3)
    want = selection_bias_step(LOAD, 0.1, "proportional", 0.3)
    torch.testing.assert_close(selection_biases(model), want)
    assert metrics["actor/moe/selection_bias/step_max"] == pytest.approx(0.1)
    assert metrics["actor/moe/update_max_vio/max"] == pytest.approx(1.5)


@pytest.mark.parametrize("rule", ["sign", "proportional"])
def test_balancing_bias_evens_out_a_skewed_selection(rule: str) -> None:
    """Updated from each batch's load, a bias that starts far off (expert 3 in every top-k) comes back to balance."""
    model = _model()
    install_selection_bias(model)
    for layer in moe_layers(model):
        getattr(layer.router, BIAS_NAME)[3] = 6.0
    gen = torch.Generator().manual_seed(2)
    tap = RouterTap(model, keep_logits=False, count=True)

    def max_vio(load: torch.Tensor) -> float:
        mean = load.mean(dim=1)
        return float(((load.max(dim=1).values - mean) / mean).max())

    vios = []
    for _ in range(80):
        ids = torch.randint(3, 40, (8, 7), generator=gen)
        with torch.no_grad(), tap.active():
            model(input_ids=ids)
        load = tap.pop_load()
        vios.append(max_vio(load))
        update_selection_bias(model, load, 0.1, rule)
    assert vios[0] == pytest.approx(3.0), vios
    assert max(vios[-10:]) < 1.5, vios
