"""The distillation losses against verl 0.9.1's definitions, the exact reverse KL, and their gradients.

The reference numbers below were computed once by verl 0.9.1's own functions
(`verl.trainer.ppo.core_algos.kl_penalty`, `agg_loss`, the `vanilla` policy
loss, and `verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk`, the
loss verl's `distillation_loss` aggregates) on the inputs `_inputs` makes, and
written down here, so the test needs no verl. verl's top-k loss runs in
float32, hence a tolerance of 1e-6 relative and absolute.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.algos.distill import (
    DISTILL_LOSSES,
    distill_token_losses,
    distillation_term,
    forward_kl_topk,
    full_log_probs,
    full_reverse_kl,
    get_distill_loss,
    teacher_topk,
)

B, T, V, K = 3, 5, 11, 4
TOL = {"rtol": 1e-6, "atol": 1e-6}

VERL_0_9_1 = {
    "k1": [-4.699432426642, 5.481021319394, 0.265873076712, 6.841648148615, -4.655016176503, 1.26211299635,
           3.361979925992, 3.122840731683, 1.658738596094, -3.123484202709, -7.050366466233, 0.954404695998,
           0.108038631758, -0.582577087955, 2.860789078859],
    "k3": [10.0, 4.485186393049, 0.032409489361, 5.842716489778, 10.0, 0.545168295704, 2.396646479732,
           2.166872639436, 0.84911756958, 10.0, 10.0, 0.339445988961, 0.005631551926, 0.208070056902,
           1.918012667381],
    "abs": [4.699432426642, 5.481021319394, 0.265873076712, 6.841648148615, 4.655016176503, 1.26211299635,
            3.361979925992, 3.122840731683, 1.658738596094, 3.123484202709, 7.050366466233, 0.954404695998,
            0.108038631758, 0.582577087955, 2.860789078859],
    "mse": [11.042332566287, 15.020797351827, 0.03534424646, 23.404074694723, 10.834587801751, 0.796464607777,
            5.651454511385, 4.87606711773, 1.375706865087, 4.878076782287, 24.853833654088, 0.455444161872,
            0.005836172976, 0.169698031705, 4.092057076861],
    "forward_kl_topk": [4.005685806274, 3.15280008316, 2.529469251633, 3.819249629974, 3.054809093475,
                        2.881183862686, 1.921642422676, 2.468573093414, 0.68346965313, 2.399979352951,
                        3.306639432907, 3.301305055618, 1.356759905815, 1.650319933891, 4.021767139435],
    "student_mass": [0.540878008393, 0.231377383416, 0.39779445463, 0.740400876455, 0.06225557172, 0.18451549473,
                     0.278306824374, 0.247579657208, 0.816629115223, 0.590589431051, 0.080937949221,
                     0.036941201913, 0.279836596897, 0.696984965959, 0.069455954646],
    "teacher_mass": [0.918492302504, 0.981917991288, 0.972081311122, 0.978914950239, 0.904760243762,
                     0.939965076391, 0.939738029262, 0.96759995778, 0.885441604266, 0.873644071668,
                     0.899979439685, 0.920760201062, 0.941484649342, 0.951653881774, 0.982661485039],
    # distillation_loss with use_policy_gradient=false: agg_loss of the per-token losses.
    "agg_k3": 5.052111087451,
    "agg_seq_k3": 5.924986093132,
    "agg_forward_kl_topk": 3.015561342239,
    "agg_seq_forward_kl_topk": 3.014280557632,
    # use_policy_gradient=true: the vanilla policy loss with advantages = -losses.
    "pg_k1": 0.45387959234,
    "pg_forward_kl_topk": 2.9948095796,
}  # fmt: skip


def _inputs() -> dict[str, torch.Tensor]:
    """The random inputs the reference numbers were computed on (float64)."""
    g = torch.Generator().manual_seed(50)
    s_logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    t_logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    tokens = torch.randint(0, V, (B, T), generator=g)
    noise = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    # Guards the generator: the reference numbers hold for exactly these inputs.
    assert float(s_logits.sum()) == pytest.approx(-14.774056472092818, abs=1e-9)
    assert float(t_logits.sum()) == pytest.approx(27.45036776973942, abs=1e-9)
    assert int(tokens.sum()) == 87
    s_lp = torch.log_softmax(s_logits, -1).gather(-1, tokens[..., None])[..., 0]
    t_all = torch.log_softmax(t_logits, -1)
    top = torch.topk(t_all, K, -1)
    return {
        "s_logits": s_logits,
        "t_logits": t_logits,
        "t_all": t_all,
        "s_lp": s_lp,
        "t_lp": t_all.gather(-1, tokens[..., None])[..., 0],
        "old_lp": s_lp + noise,
        "top_lp": top.values,
        "top_ids": top.indices,
        "mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool),
    }


def _ref(name: str) -> torch.Tensor:
    return torch.tensor(VERL_0_9_1[name], dtype=torch.float64).reshape(B, T)


@pytest.mark.parametrize("mode", ["k1", "kl", "k3", "low_var_kl", "abs", "mse", "k2"])
def test_estimators_match_verl(mode):
    x = _inputs()
    losses, _ = distill_token_losses(mode, student_log_prob=x["s_lp"], teacher_log_prob=x["t_lp"])
    ref = {"kl": "k1", "low_var_kl": "k3", "k2": "mse"}.get(mode, mode)
    torch.testing.assert_close(losses, _ref(ref), **TOL)


def test_forward_kl_topk_matches_verl():
    x = _inputs()
    losses, diag = distill_token_losses(
        "forward_kl_topk",
        student_logits=x["s_logits"],
        teacher_topk_log_probs=x["top_lp"],
        teacher_topk_ids=x["top_ids"],
    )
    torch.testing.assert_close(losses, _ref("forward_kl_topk"), **TOL)
    torch.testing.assert_close(diag["student_mass"], _ref("student_mass"), **TOL)
    torch.testing.assert_close(diag["teacher_mass"], _ref("teacher_mass"), **TOL)


@pytest.mark.parametrize("mode", ["k3", "forward_kl_topk"])
def test_supervised_term_matches_verl(mode):
    x = _inputs()
    losses, _ = distill_token_losses(
        mode,
        student_log_prob=x["s_lp"],
        teacher_log_prob=x["t_lp"],
        student_logits=x["s_logits"],
        teacher_topk_log_probs=x["top_lp"],
        teacher_topk_ids=x["top_ids"],
    )
    for agg, name in (("token-mean", f"agg_{mode}"), ("seq-mean-token-mean", f"agg_seq_{mode}")):
        term = distillation_term(losses, x["mask"], use_policy_gradient=False, loss_agg_mode=agg)
        assert float(term) == pytest.approx(VERL_0_9_1[name], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("mode", ["k1", "forward_kl_topk"])
def test_policy_gradient_term_matches_verl(mode):
    x = _inputs()
    losses, _ = distill_token_losses(
        mode,
        student_log_prob=x["s_lp"],
        teacher_log_prob=x["t_lp"],
        student_logits=x["s_logits"],
        teacher_topk_log_probs=x["top_lp"],
        teacher_topk_ids=x["top_ids"],
    )
    term = distillation_term(losses, x["mask"], use_policy_gradient=True, log_prob=x["s_lp"], old_log_prob=x["old_lp"])
    assert float(term) == pytest.approx(VERL_0_9_1[f"pg_{mode}"], rel=1e-6, abs=1e-6)


def _direct_reverse_kl(s_logits: torch.Tensor, t_lp: torch.Tensor, temperature: float) -> torch.Tensor:
    q = torch.log_softmax(s_logits / temperature, -1)
    return (q.exp() * (q - t_lp)).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_full_reverse_kl_value_and_gradient_blockwise(temperature):
    x = _inputs()
    t_lp = full_log_probs(x["t_logits"], temperature=temperature)
    torch.testing.assert_close(t_lp, torch.log_softmax(x["t_logits"] / temperature, -1).float())
    t_lp = torch.log_softmax(x["t_logits"] / temperature, -1)
    logits = x["s_logits"].clone().requires_grad_(True)
    # Blocks of 2 rows: 8 blocks, the last one short.
    got = full_reverse_kl(logits, t_lp, temperature=temperature, chunk_elements=2 * V)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (got * weights).sum().backward()
    ref_logits = x["s_logits"].clone().requires_grad_(True)
    want = _direct_reverse_kl(ref_logits, t_lp, temperature)
    (want * weights).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-10, atol=1e-12)
    assert bool((got >= -1e-12).all())


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_forward_kl_topk_gradient_blockwise(temperature):
    x = _inputs()
    lp, ids = teacher_topk(x["t_logits"], K, temperature=temperature)
    want_top = torch.topk(torch.log_softmax(x["t_logits"] / temperature, -1), K, -1)
    torch.testing.assert_close(lp, want_top.values.float())
    assert torch.equal(ids, want_top.indices)
    lp = lp.double()
    logits = x["s_logits"].clone().requires_grad_(True)
    got, _ = forward_kl_topk(logits, lp, ids, temperature=temperature, chunk_elements=3 * V)
    got.sum().backward()
    ref_logits = x["s_logits"].clone().requires_grad_(True)
    s = torch.log_softmax(ref_logits / temperature, -1).gather(-1, ids)
    want = (lp.exp() * (lp - s)).sum(-1)
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-10, atol=1e-12)


def test_forward_kl_topk_with_all_tokens_is_the_forward_kl():
    x = _inputs()
    lp, ids = teacher_topk(x["t_logits"], V)
    got, mass = forward_kl_topk(x["s_logits"], lp.double(), ids)
    p = x["t_all"]
    want = (p.exp() * (p - torch.log_softmax(x["s_logits"], -1))).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mass, torch.ones_like(mass), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["k1", "k3"])
def test_sampled_estimators_average_to_the_exact_reverse_kl(mode):
    """On tokens sampled from the student, k1's and k3's mean is the exact reverse KL within 3 standard errors."""
    g = torch.Generator().manual_seed(7)
    n_pos, n_samples = 4, 40_000
    s_logits = torch.randn(1, n_pos, V, generator=g, dtype=torch.float64)
    t_logits = torch.randn(1, n_pos, V, generator=g, dtype=torch.float64)
    exact = full_reverse_kl(s_logits, torch.log_softmax(t_logits, -1))[0]
    s_all, t_all = torch.log_softmax(s_logits[0], -1), torch.log_softmax(t_logits[0], -1)
    for i in range(n_pos):
        y = torch.multinomial(s_all[i].exp(), n_samples, replacement=True, generator=g)
        est, _ = distill_token_losses(mode, student_log_prob=s_all[i, y], teacher_log_prob=t_all[i, y])
        mean, se = float(est.mean()), float(est.std() / n_samples**0.5)
        assert abs(mean - float(exact[i])) < 3 * se, (i, mean, float(exact[i]), se)


def test_registry_names_and_unknown_mode():
    assert {"k1", "k3", "low_var_kl", "forward_kl_topk", "full_reverse_kl"} <= set(DISTILL_LOSSES)
    assert get_distill_loss("k3").needs == "log_prob"
    assert get_distill_loss("forward_kl_topk").needs == "topk"
    assert get_distill_loss("full_reverse_kl").needs == "full"
    with pytest.raises(ValueError, match="distillation.distillation_loss.loss_mode.*'k3'"):
        get_distill_loss("k33")


def test_mismatched_vocabularies_are_refused():
    with pytest.raises(ValueError, match="vocabulary"):
        full_reverse_kl(torch.zeros(1, 2, 5), torch.zeros(1, 2, 6))
