"""conveyor's algorithms against verl 0.9.1's core_algos on the same random inputs, to 1e-5.

Covers the advantage estimators, policy losses, aggregation modes and KL kinds
users ask for by verl's names: ragged right-padded masks with a single-token
row, groups of 2-8 (plus a lone sample where verl defines one), finite garbage
under the mask, importance weights, and data-parallel normalisers larger than
the batch's own counts. Where conveyor deliberately differs, the test says so:

- flat groups (all scores equal, e.g. eight rewards of 0.3) get advantages of
  exactly 0 here, while verl's float32 group mean is a rounding step off;
- ``rloo`` gives a lone sample 0, as verl's ``rloo_vectorized`` does (verl's
  loop ``rloo`` gives it its raw score), so it is compared with the former;
- ``geo_mean`` averages over ``num_seqs`` (verl over the micro-batch's rows),
  so it is compared with ``num_seqs`` equal to the batch.

verl runs in a subprocess (verl_reference.py): importing it here would change
this process's root logger and environment for the tests that follow.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor.algos.advantages import compute_advantage
from conveyor.algos.correction import (
    compute_is_metrics,
    compute_mismatch_metrics,
    compute_rejection_mask,
    compute_rollout_is_weights,
    parse_is_threshold,
    parse_rejection,
)
from conveyor.algos.kl import KL_KINDS, kl_penalty
from conveyor.algos.losses import LOSS_AGG_MODES, agg_loss, get_policy_loss
from conveyor.workers.ranks.reward import overlong_penalty

SCRIPT = Path(__file__).with_name("verl_reference.py")
TOL = {"atol": 1e-5, "rtol": 1e-5}
WIDTH = 9

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("verl") is None, reason="verl is not installed (make install-dev adds it)"
)


# --------------------------------------------------------------------------- random inputs


def _mask(gen: torch.Generator, batch: int) -> torch.Tensor:
    """Right-padded bool mask (batch, WIDTH) of random lengths 1..WIDTH; row 0 has a single token."""
    lengths = torch.randint(1, WIDTH + 1, (batch,), generator=gen)
    lengths[0] = 1
    return torch.arange(WIDTH) < lengths[:, None]


def _garbage(gen: torch.Generator, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` on the mask, finite noise off it (which must change nothing)."""
    # Modest: verl exponentiates some log-ratios unclamped, and inf * 0 would be NaN there.
    return torch.where(mask, values, 3.0 * torch.randn(values.shape, generator=gen))


def _advantage_case(name: str, seed: int, sizes: list[int], rewards: str, **extra: Any) -> dict[str, Any]:
    """Groups of ``sizes`` in shuffled order; ``rewards``: normal/binary outcome on the last token, or dense."""
    gen = torch.Generator().manual_seed(seed)
    batch = sum(sizes)
    mask = _mask(gen, batch)
    index = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    index = index[torch.randperm(batch, generator=gen)]
    if rewards == "dense":
        token_rewards = torch.randn(batch, WIDTH, generator=gen) * mask
    else:
        scores = torch.randn(batch, generator=gen)
        if rewards == "binary":
            scores = (scores > 0).float()
        last = mask.sum(-1) - 1
        token_rewards = torch.zeros(batch, WIDTH)
        token_rewards[torch.arange(batch), last] = scores
    case = {
        "kind": "advantage",
        "name": name,
        "conveyor_name": name,
        "rewards": token_rewards,
        "mask": mask,
        "index": index.tolist(),
        "norm_adv_by_std": True,
    }
    case.update(extra)
    return case


WITH_LONE = [1, 2, 3, 5, 8, 4, 7, 6]
NO_LONE = [2, 3, 5, 8, 4, 7, 6, 2]


def _advantage_cases() -> dict[str, dict[str, Any]]:
    """Every group-based estimator on normal, binary (flat groups of 0s and 1s) and dense rewards."""
    cases = {}
    for seed, rewards in enumerate(("normal", "binary", "dense")):
        for name in ("grpo", "reinforce_plus_plus_baseline", "opo", "gpg"):
            cases[f"{name}-{rewards}"] = _advantage_case(name, seed, WITH_LONE, rewards)
        cases[f"rloo-{rewards}"] = _advantage_case("rloo_vectorized", seed, WITH_LONE, rewards, conveyor_name="rloo")
        cases[f"grpo-{rewards}-no-std"] = _advantage_case("grpo", seed, WITH_LONE, rewards, norm_adv_by_std=False)
        for norm in (True, False):
            cases[f"grpo_passk-{rewards}-std{norm}"] = _advantage_case(
                "grpo_passk", seed, NO_LONE, rewards, norm_adv_by_std=norm
            )
        gen = torch.Generator().manual_seed(100 + seed)
        cases[f"remax-{rewards}"] = _advantage_case(
            "remax", seed, WITH_LONE, rewards, reward_baselines=torch.randn(sum(WITH_LONE), generator=gen)
        )
    cases.update(_newer_advantage_cases())
    # Deliberate differences, checked in their own tests below.
    cases["rloo-loop-lone"] = _advantage_case("rloo", 7, WITH_LONE, "normal")
    flat = _advantage_case("grpo", 8, [8, 7, 6, 3], "normal")
    for group, value in enumerate((0.3, 0.1, 0.7)):
        rows = torch.tensor(flat["index"]) == group
        flat["rewards"][rows] = 0.0
        flat["rewards"][rows, 0] = value  # every row has its first token
    cases["grpo-flat-fractional"] = flat
    return cases


def _token_baseline_inputs(gen: torch.Generator, mask: torch.Tensor, with_is: bool) -> dict[str, torch.Tensor]:
    """What the optimal token baselines read: old log-probs, Σπ² in (π², 1], IS weights; noise off the mask."""
    old = -2.0 * torch.rand(mask.shape, generator=gen)
    pi = torch.exp(old)
    # Σπ² is at least π² of the sampled token and at most 1.
    spp = pi**2 + (1 - pi**2) * torch.rand(mask.shape, generator=gen)
    out = {"old_log_probs": _garbage(gen, old, mask), "sum_pi_squared": _garbage(gen, spp, mask)}
    if with_is:
        out["rollout_is_weights"] = torch.clamp(0.5 + torch.rand(mask.shape, generator=gen), max=1.3)
    return out


def _newer_advantage_cases() -> dict[str, dict[str, Any]]:
    """gdpo (with and without reward components), optimal_token_baseline and its multi-turn form.

    Masks: ragged right padding (with a single-token row), holes inside responses (tool output), and an
    empty response; groups with a unique longest member and with tied longest members.
    """
    cases = {}
    for seed, rewards in enumerate(("normal", "binary", "dense")):
        for norm in (True, False):
            cases[f"gdpo-{rewards}-std{norm}"] = _advantage_case(
                "gdpo", 40 + seed, WITH_LONE, rewards, norm_adv_by_std=norm
            )
        gen = torch.Generator().manual_seed(50 + seed)
        comps = torch.randn(sum(WITH_LONE), 3, generator=gen)
        comps[:, 1] = (comps[:, 1] > 0).float()  # a 0/1 component: flat groups in it
        cases[f"gdpo-components-{rewards}"] = _advantage_case(
            "gdpo", 40 + seed, WITH_LONE, rewards, reward_components=comps, reward_weights=[1.0, 0.5, 2.0]
        )
        for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
            for with_is in (False, True):
                case = _advantage_case(name, 60 + seed, WITH_LONE, rewards)
                gen = torch.Generator().manual_seed(70 + seed)
                case.update(_token_baseline_inputs(gen, case["mask"], with_is))
                cases[f"{name}-{rewards}-is{with_is}"] = case
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline", "gdpo"):
        # Multi-turn: holes inside the responses (tool output), and one empty response.
        case = _advantage_case(name, 80, WITH_LONE, "dense")
        gen = torch.Generator().manual_seed(81)
        holes = torch.rand(case["mask"].shape, generator=gen) < 0.3
        holes[:, 0] = False
        mask = case["mask"] & ~holes
        mask[3] = False
        case["mask"] = mask
        case["rewards"] = case["rewards"] * mask
        case.update(_token_baseline_inputs(gen, mask, False))
        cases[f"{name}-holes-empty"] = case
    return cases


LOSS_NAMES = ("vanilla", "gspo", "sapo", "cispo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl", "dro")
# Hyperparameter settings beyond verl's defaults, per loss.
LOSS_PARAMS: dict[str, list[dict[str, float]]] = {
    "sapo": [{"tau_pos": 0.8, "tau_neg": 1.3}],
    "clip_cov": [{"clip_cov_ratio": 0.05, "clip_cov_lb": 0.2, "clip_cov_ub": 4.0}],
    "kl_cov": [{"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5}],
    # dro has no default beta (verl's is null and refused): every case sets one.
    "dro": [{"dro_beta": 0.05}, {"dro_beta": 2.0}],
    # DPPO's clip ranges are divergence thresholds; tight ones drop many tokens, a small c truncates ratios.
    "dppo_tv": [{"clip_ratio_low": 0.02, "clip_ratio_high": 0.03, "clip_ratio_c": 1.2}],
    "dppo_kl": [{"clip_ratio_low": 0.002, "clip_ratio_high": 0.004, "clip_ratio_c": 1.2}],
}
# The losses with no defaults of their own: their cases run with LOSS_PARAMS only.
NO_DEFAULT_CASE = ("dro",)


# Log-ratios beyond the +-20 that vanilla, sapo, cispo, dppo_tv and dppo_kl clamp them to (in verl and here), on
# column 0 (every row has it) of the first rows; their ppo_kl is then the clamped value's mean.
EXTREME_LOG_RATIOS = (25.0, -30.0, 21.5, -60.0, 45.0)
CLAMPED_LOSSES = ("vanilla", "sapo", "cispo", "dppo_tv", "dppo_kl")


def _policy_case(name: str, seed: int, mode: str, params: dict[str, float], extreme: bool = False) -> dict[str, Any]:
    """Ratios around 1 (some clipped), token-level advantages, global normalisers above the local counts.

    With ``extreme``, a few tokens get log-ratios of 20 and more in size (EXTREME_LOG_RATIOS).
    """
    clip = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    clip.update({k: params[k] for k in clip if k in params})  # a case may set the common keywords too
    params = {k: v for k, v in params.items() if k not in clip}
    gen = torch.Generator().manual_seed(seed)
    batch = 13
    mask = _mask(gen, batch)
    old = -3.0 * torch.rand(batch, WIDTH, generator=gen)
    new = old + 0.4 * torch.randn(batch, WIDTH, generator=gen)
    if extreme:
        rows = len(EXTREME_LOG_RATIOS)
        new[:rows, 0] = old[:rows, 0] + torch.tensor(EXTREME_LOG_RATIOS)
    with_weights = seed % 2 == 0
    return {
        "kind": "policy_loss",
        "name": name,
        "seed": seed,
        "params": params,
        "mask": mask,
        "old_log_prob": _garbage(gen, old, mask),
        "log_prob": _garbage(gen, new, mask),
        "advantages": _garbage(gen, torch.randn(batch, WIDTH, generator=gen), mask),
        "is_weights": 0.5 + torch.rand(batch, WIDTH, generator=gen) if with_weights else None,
        **clip,
        "loss_agg_mode": mode,
        "num_tokens": int(mask.sum()) + 7,
        # verl's geo_mean averages over the rows it is given (see the module docstring).
        "num_seqs": batch if name == "geo_mean" else batch + 3,
        "loss_scale_factor": 40 if seed % 3 == 0 else None,
    }


def _policy_cases() -> dict[str, dict[str, Any]]:
    """Every loss under every aggregation mode, plus its own non-default hyperparameters."""
    cases = {}
    seed = 0
    for name in LOSS_NAMES:
        for params in ([] if name in NO_DEFAULT_CASE else [{}]) + LOSS_PARAMS.get(name, []):
            for mode in LOSS_AGG_MODES:
                seed += 1
                suffix = "-".join(f"{k}{v}" for k, v in params.items())
                cases[f"{name}-{mode}-{suffix or 'default'}"] = _policy_case(name, seed, mode, params)
    for name in CLAMPED_LOSSES:
        for mode in ("token-mean", "seq-mean-token-sum"):
            seed += 1
            cases[f"{name}-{mode}-extreme-log-ratio"] = _policy_case(name, seed, mode, {}, extreme=True)
    return cases


def _agg_cases() -> dict[str, dict[str, Any]]:
    """Each mode with global normalisers, with and without an explicit loss_scale_factor."""
    cases = {}
    for seed, mode in enumerate(LOSS_AGG_MODES):
        for factor in (None, 40):
            gen = torch.Generator().manual_seed(200 + seed)
            mask = _mask(gen, 11)
            cases[f"{mode}-lsf{factor}"] = {
                "kind": "agg",
                "loss_agg_mode": mode,
                "mask": mask,
                "loss_mat": _garbage(gen, torch.randn(11, WIDTH, generator=gen), mask),
                "num_tokens": int(mask.sum()) + 5,
                "num_seqs": 15,
                "loss_scale_factor": factor,
            }
    return cases


def _kl_cases() -> dict[str, dict[str, Any]]:
    """Every KL kind on log-ratios that include a few far enough out to hit k3's clamps."""
    gen = torch.Generator().manual_seed(300)
    log_prob = -3.0 * torch.rand(6, WIDTH, generator=gen)
    ref = log_prob + 2.0 * torch.randn(6, WIDTH, generator=gen)
    ref[0, :3] = torch.tensor([25.0, -25.0, 12.0])
    weights = torch.randn(6, WIDTH, generator=gen)
    return {
        kind: {"kind": "kl", "name": kind, "log_prob": log_prob, "ref_log_prob": ref, "weights": weights}
        for kind in KL_KINDS
    }


def _overlong_cases() -> dict[str, dict[str, Any]]:
    """DAPO's overlong shaping: random lengths across the buffer, fractional scores, several buffers and factors."""
    cases = {}
    for seed, (width, buffer, factor) in enumerate([(16, 4, 1.0), (16, 16, 0.5), (9, 1, 2.0), (30, 7, 0.3)]):
        gen = torch.Generator().manual_seed(400 + seed)
        cases[f"max{width}-len{buffer}-f{factor}"] = {
            "kind": "overlong",
            "max_resp_len": width,
            "len": buffer,
            "penalty_factor": factor,
            "lengths": torch.randint(1, width + 1, (12,), generator=gen),
            "scores": torch.rand(12, generator=gen),
        }
    return cases


def _offpolicy_cases() -> dict[str, dict[str, Any]]:
    """Trainer vs sampler log-probs: near (a bf16-like gap), far (stale weights), ragged rows of 1 token and more."""
    cases = {}
    for seed, scale in enumerate((0.01, 0.3, 1.5)):
        gen = torch.Generator().manual_seed(500 + seed)
        mask = _mask(gen, 9)  # every row has a token: verl counts an empty row as perplexity 1, conveyor skips it
        rollout = -3.0 * torch.rand(9, WIDTH, generator=gen)
        old = rollout + scale * torch.randn(9, WIDTH, generator=gen)
        cases[f"scale{scale}"] = {
            "kind": "offpolicy",
            "mask": mask,
            "old_log_prob": _garbage(gen, old, mask),
            "rollout_log_prob": _garbage(gen, rollout, mask),
        }
    return cases


def _rollout_is_cases() -> dict[str, dict[str, Any]]:
    """Token and sequence importance weights, truncated (TIS) and two-sided (IcePop), near and far policies."""
    cases = {}
    for seed, (level, threshold, scale) in enumerate(
        [
            ("token", 2.0, 0.5),
            ("token", "0.5_5.0", 0.8),
            ("sequence", 2.0, 0.05),
            ("sequence", "0.5_5.0", 0.1),
            ("token", 1.2, 0.01),
        ]
    ):
        gen = torch.Generator().manual_seed(600 + seed)
        mask = _mask(gen, 10)
        rollout = -3.0 * torch.rand(10, WIDTH, generator=gen)
        old = rollout + scale * torch.randn(10, WIDTH, generator=gen)
        cases[f"{level}-{threshold}-scale{scale}"] = {
            "kind": "rollout_is",
            "level": level,
            "threshold": threshold,
            "mask": mask,
            "old_log_prob": _garbage(gen, old, mask),
            "rollout_log_prob": _garbage(gen, rollout, mask),
        }
    return cases


def _rejection_cases() -> dict[str, dict[str, Any]]:
    """Every rejection option alone and chained, with thresholds that keep some and reject some."""
    specs = [
        ("token_k1", "0.6_1.5"),
        ("token_k1", "2.0"),
        ("token_k2", "0.05"),
        ("token_k3", "0.04"),
        ("seq_sum_k1", "0.3_3.0"),
        ("seq_sum_k2", "0.4"),
        ("seq_sum_k3", "0.3"),
        ("seq_mean_k1", "0.8_1.25"),
        ("seq_mean_k2", "0.03"),
        ("seq_mean_k3", "0.03"),
        ("seq_max_k2", "0.2"),
        ("seq_max_k3", "0.15"),
        ("token_k1,seq_mean_k3", "0.5_2.0,0.05"),
        ("token_k2,seq_max_k3,seq_sum_k1", "0.1,0.15,0.5_2.0"),
    ]
    cases = {}
    for seed, (options, threshold) in enumerate(specs):
        gen = torch.Generator().manual_seed(700 + seed)
        mask = _mask(gen, 12)
        rollout = -3.0 * torch.rand(12, WIDTH, generator=gen)
        old = rollout + 0.4 * torch.randn(12, WIDTH, generator=gen)
        cases[f"{options}-{threshold}"] = {
            "kind": "rejection",
            "options": options,
            "threshold": threshold,
            "mask": mask,
            "old_log_prob": _garbage(gen, old, mask),
            "rollout_log_prob": _garbage(gen, rollout, mask),
        }
    return cases


CASES: dict[str, dict[str, Any]] = {
    **{f"adv/{k}": v for k, v in _advantage_cases().items()},
    **{f"loss/{k}": v for k, v in _policy_cases().items()},
    **{f"agg/{k}": v for k, v in _agg_cases().items()},
    **{f"kl/{k}": v for k, v in _kl_cases().items()},
    **{f"overlong/{k}": v for k, v in _overlong_cases().items()},
    **{f"offpolicy/{k}": v for k, v in _offpolicy_cases().items()},
    **{f"rollout_is/{k}": v for k, v in _rollout_is_cases().items()},
    **{f"rejection/{k}": v for k, v in _rejection_cases().items()},
}


@pytest.fixture(scope="module")
def verl_out(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """verl's outputs for every case, computed once in a subprocess."""
    tmp = tmp_path_factory.mktemp("verl")
    torch.save(CASES, tmp / "cases.pt")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp / "cases.pt"), str(tmp / "out.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return torch.load(tmp / "out.pt", weights_only=True)


def _ids(prefix: str, exclude: tuple[str, ...] = ()) -> list[str]:
    """Case ids of one kind, without the deliberate-difference cases."""
    return [k for k in CASES if k.startswith(prefix) and k not in exclude]


# --------------------------------------------------------------------------- conveyor side


def _our_advantage(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """conveyor's estimator on a case."""
    return compute_advantage(
        case["conveyor_name"],
        case["rewards"],
        case["mask"],
        group_index=torch.tensor(case["index"]),
        norm_adv_by_std=case["norm_adv_by_std"],
        reward_baselines=case.get("reward_baselines"),
        old_log_probs=case.get("old_log_probs"),
        sum_pi_squared=case.get("sum_pi_squared"),
        rollout_is_weights=case.get("rollout_is_weights"),
        reward_components=case.get("reward_components"),
        reward_weights=case.get("reward_weights"),
    )


def _our_policy_loss(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """conveyor's loss on a case: (loss, d loss / d log_prob, metrics)."""
    log_prob = case["log_prob"].clone().requires_grad_(True)
    params = dict(case["params"])
    if case["name"] == "clip_cov":
        # A fresh generator seeded like verl's global one draws the same permutation.
        params["generator"] = torch.Generator().manual_seed(case["seed"])
    loss, metrics = get_policy_loss(case["name"])(
        case["old_log_prob"],
        log_prob,
        case["advantages"],
        case["mask"],
        clip_ratio_low=case["clip_ratio_low"],
        clip_ratio_high=case["clip_ratio_high"],
        clip_ratio_c=case["clip_ratio_c"],
        loss_agg_mode=case["loss_agg_mode"],
        num_tokens=case["num_tokens"],
        num_seqs=case["num_seqs"],
        loss_scale_factor=case["loss_scale_factor"],
        is_weights=case["is_weights"],
        **params,
    )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


# --------------------------------------------------------------------------- the comparisons

DIFFERENT = ("adv/rloo-loop-lone", "adv/grpo-flat-fractional")


@pytest.mark.parametrize("case_id", _ids("adv/", exclude=DIFFERENT))
def test_advantages_match_verl(case_id: str, verl_out: dict) -> None:
    case = CASES[case_id]
    adv, ret = _our_advantage(case)
    theirs = verl_out[case_id]["returns"].float()
    if case_id.endswith("-holes-empty"):
        # verl's reward-to-go runs on through a hole in the mask; here masked positions are skipped (0).
        theirs = theirs * case["mask"]
    torch.testing.assert_close(adv, verl_out[case_id]["advantages"].float(), **TOL)
    torch.testing.assert_close(ret, theirs, **TOL)


@pytest.mark.parametrize("case_id", _ids("loss/"))
def test_policy_losses_match_verl(case_id: str, verl_out: dict) -> None:
    loss, grad, metrics = _our_policy_loss(CASES[case_id])
    theirs = verl_out[case_id]
    torch.testing.assert_close(loss, theirs["loss"], **TOL)
    torch.testing.assert_close(grad, theirs["grad"], **TOL)
    verl_metrics = {k.removeprefix("metric/"): v for k, v in theirs.items() if k.startswith("metric/")}
    assert set(verl_metrics) <= set(metrics)
    for name, value in verl_metrics.items():
        torch.testing.assert_close(metrics[name].float().cpu(), value, **TOL, msg=name)


@pytest.mark.parametrize("case_id", [k for k in CASES if k.endswith("-extreme-log-ratio")])
def test_ppo_kl_at_extreme_log_ratios_is_verls_clamped_one(case_id: str, verl_out: dict) -> None:
    case = CASES[case_id]
    _, _, metrics = _our_policy_loss(case)
    mask = case["mask"]
    log_ratio = (case["log_prob"] - case["old_log_prob"])[mask]
    assert log_ratio.abs().max() > 20  # the case does reach the clamp
    torch.testing.assert_close(metrics["ppo_kl"], (-log_ratio.clamp(-20, 20)).mean(), **TOL)
    torch.testing.assert_close(metrics["ppo_kl"], verl_out[case_id]["metric/ppo_kl"], **TOL)
    assert not torch.isclose(metrics["ppo_kl"], (-log_ratio).mean(), atol=1e-3)


@pytest.mark.parametrize("case_id", _ids("agg/"))
def test_aggregation_matches_verl(case_id: str, verl_out: dict) -> None:
    case = CASES[case_id]
    ours = agg_loss(
        case["loss_mat"],
        case["mask"],
        case["loss_agg_mode"],
        num_tokens=case["num_tokens"],
        num_seqs=case["num_seqs"],
        loss_scale_factor=case["loss_scale_factor"],
    )
    torch.testing.assert_close(ours, verl_out[case_id]["loss"], **TOL)


@pytest.mark.parametrize("case_id", _ids("kl/"))
def test_kl_kinds_match_verl(case_id: str, verl_out: dict) -> None:
    case = CASES[case_id]
    log_prob = case["log_prob"].clone().requires_grad_(True)
    kl = kl_penalty(log_prob, case["ref_log_prob"], case["name"])
    (kl * case["weights"]).sum().backward()
    torch.testing.assert_close(kl.detach(), verl_out[case_id]["value"], **TOL)
    torch.testing.assert_close(log_prob.grad, verl_out[case_id]["grad"], **TOL)


@pytest.mark.parametrize("case_id", _ids("overlong/"))
def test_overlong_shaping_matches_verl_dapo_reward_manager(case_id: str, verl_out: dict) -> None:
    case = CASES[case_id]
    penalty = overlong_penalty(case["lengths"], case["max_resp_len"], case["len"], case["penalty_factor"])
    torch.testing.assert_close(case["scores"] + penalty, verl_out[case_id]["reward"], **TOL)


@pytest.mark.parametrize("case_id", _ids("offpolicy/"))
def test_mismatch_metrics_match_verl(case_id: str, verl_out: dict) -> None:
    case = CASES[case_id]
    ours = compute_mismatch_metrics(case["old_log_prob"], case["rollout_log_prob"], case["mask"])
    theirs = verl_out[case_id]
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    for name, value in theirs.items():
        assert ours[name] == pytest.approx(float(value), rel=1e-5, abs=1e-5), name


@pytest.mark.parametrize("case_id", _ids("rollout_is/"))
def test_importance_weights_and_their_metrics_match_verl(case_id: str, verl_out: dict) -> None:
    case = CASES[case_id]
    upper, lower = parse_is_threshold(case["threshold"])
    args = (case["old_log_prob"], case["rollout_log_prob"], case["mask"])
    weights, _ = compute_rollout_is_weights(*args, level=case["level"], threshold=upper, lower=lower)
    theirs = verl_out[case_id]
    torch.testing.assert_close(weights, theirs["weights"].float(), **TOL)
    ours = compute_is_metrics(*args, level=case["level"], threshold=upper, lower=lower)
    verl_metrics = {k.removeprefix("metric/"): float(v) for k, v in theirs.items() if k.startswith("metric/")}
    assert set(verl_metrics) == set(ours), set(verl_metrics) ^ set(ours)
    for name, value in verl_metrics.items():
        assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name


@pytest.mark.parametrize("case_id", _ids("rejection/"))
def test_rejection_sampling_and_its_metrics_match_verl(case_id: str, verl_out: dict) -> None:
    case = CASES[case_id]
    keep, ours = compute_rejection_mask(
        case["old_log_prob"],
        case["rollout_log_prob"],
        case["mask"],
        parse_rejection(case["options"], case["threshold"]),
    )
    theirs = verl_out[case_id]
    assert torch.equal(keep, theirs["mask"].bool() & case["mask"])
    assert 0 < int(keep.sum()) < int(case["mask"].sum()) or "," in case["options"]  # the bounds bite
    verl_metrics = {k.removeprefix("metric/"): float(v) for k, v in theirs.items() if k.startswith("metric/")}
    assert set(verl_metrics) == set(ours), set(verl_metrics) ^ set(ours)
    for name, value in verl_metrics.items():
        assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name


def test_rloo_lone_sample_gets_zero_where_verl_loop_rloo_gives_its_score(verl_out: dict) -> None:
    # Deliberate: a lone sample has no others to form a leave-one-out baseline, so
    # it carries no signal; verl's vectorised rloo agrees, its loop rloo does not.
    case = CASES["adv/rloo-loop-lone"]
    ours, _ = _our_advantage({**case, "conveyor_name": "rloo"})
    theirs = verl_out["adv/rloo-loop-lone"]["advantages"]
    index = torch.tensor(case["index"])
    lone = index == 0  # WITH_LONE's first group has one sample
    assert (ours[lone] == 0).all()
    score = case["rewards"][lone].sum(-1, keepdim=True)
    torch.testing.assert_close(theirs[lone], score * case["mask"][lone])
    torch.testing.assert_close(ours[~lone], theirs[~lone], **TOL)


def test_flat_fractional_groups_get_exact_zeros_where_verl_does_not(verl_out: dict) -> None:
    # Deliberate: verl's float32 group mean of 0.3 (x8), 0.1 (x7), 0.7 (x6) is a
    # rounding step off and its (score - mean) / (std + 1e-6) comes out ~0.01-0.06.
    case = CASES["adv/grpo-flat-fractional"]
    ours, _ = _our_advantage(case)
    theirs = verl_out["adv/grpo-flat-fractional"]["advantages"]
    flat = torch.tensor(case["index"]) < 3
    assert (ours[flat] == 0).all()
    assert theirs[flat].abs().max() > 1e-3
    torch.testing.assert_close(ours[~flat], theirs[~flat], **TOL)
