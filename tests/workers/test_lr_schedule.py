"""The workers' lr schedule: torch's LambdaLR following the documented formula, saved and restored exactly."""

from __future__ import annotations

import io
import math

import pytest
import torch

from conveyor.config import load_config
from conveyor.data_plane import make_data_plane
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.setup import prepare_default_model
from conveyor.workers.ranks.actor import PolicyWorker
from conveyor.workers.ranks.calls import LogProbCall, UpdateCall
from conveyor.workers.ranks.critic import CriticWorker
from conveyor.workers.ranks.reference import ReferenceWorker
from conveyor.workers.ranks.settings import actor_settings, critic_settings, reference_settings
from conveyor.workers.training.optim import build_optimizer, total_optim_steps

LR = 0.5


def _optim_cfg(*overrides: str):
    return load_config(None, [f"actor_rollout_ref.actor.optim.lr={LR}", *overrides]).actor_rollout_ref.actor.optim


def _documented(step: int, warmup: int, total: int, scheduler: str, floor: float) -> float:
    """The schedule as docs/configuration.md states it: linear warm-up, then constant or cosine to the floor."""
    if step < warmup:
        return LR * (step + 1) / warmup
    if scheduler == "constant":
        return LR
    progress = min(1.0, (step - warmup) / (total - warmup))
    return LR * (floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)


def _lrs(optimizer: torch.optim.Optimizer, scheduler, n: int, param: torch.Tensor) -> list[float]:
    """The lr each of ``n`` optimizer steps uses, stepping as a worker does (optimizer, then scheduler)."""
    out = []
    for _ in range(n):
        out.append(optimizer.param_groups[0]["lr"])
        param.grad = torch.ones_like(param)
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize(
    "scheduler,warmup,floor",
    [("cosine", 3, 0.2), ("cosine", 0, 0.0), ("constant", 4, 0.2), ("constant", 0, 0.5)],
)
def test_lr_sequence_is_the_documented_formula(scheduler: str, warmup: int, floor: float) -> None:
    total = 10
    cfg = _optim_cfg(
        f"actor_rollout_ref.actor.optim.lr_scheduler={scheduler}",
        f"actor_rollout_ref.actor.optim.lr_warmup_steps={warmup}",
        f"actor_rollout_ref.actor.optim.min_lr_ratio={floor}",
    )
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer, sched = build_optimizer([param], cfg, total)
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    # Past the planned total (a run extended on resume) the cosine stays at its floor.
    got = _lrs(optimizer, sched, total + 3, param)
    want = [_documented(s, warmup, total, scheduler, floor) for s in range(total + 3)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    if scheduler == "cosine":
        assert got[warmup] == LR and got[total - 1] > LR * floor and got[total:] == [LR * floor] * 3


def test_state_saved_mid_schedule_continues_identically() -> None:
    cfg = _optim_cfg(
        "actor_rollout_ref.actor.optim.lr_warmup_steps=2", "actor_rollout_ref.actor.optim.min_lr_ratio=0.1"
    )
    total = 8

    def fresh():
        param = torch.nn.Parameter(torch.arange(3.0))
        return (param, *build_optimizer([param], cfg, total))

    param, optimizer, sched = fresh()
    uninterrupted = _lrs(optimizer, sched, total, param)
    final = param.detach().clone()

    param, optimizer, sched = fresh()
    first = _lrs(optimizer, sched, 5, param)
    buf = io.BytesIO()  # through torch.save, as a checkpoint goes
    torch.save({"param": param.detach(), "optimizer": optimizer.state_dict(), "lr_scheduler": sched.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    param, optimizer, sched = fresh()
    with torch.no_grad():
        param.copy_(state["param"])
    optimizer.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["lr_scheduler"])
    rest = _lrs(optimizer, sched, total - 5, param)
    assert first + rest == uninterrupted
    assert torch.equal(param.detach(), final)


def test_total_optim_steps_formula() -> None:
    assert total_optim_steps(total_training_steps=10, train_batch_size=8, ppo_mini_batch_size=2, ppo_epochs=3) == 120


# --------------------------------------------------------------------------- the workers

OVERRIDES = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "critic.ppo_mini_batch_size=1",
    "critic.ppo_epochs=3",
    "trainer.total_training_steps=5",
    "actor_rollout_ref.model.tiny.warmstart_steps=0",
    "actor_rollout_ref.actor.optim.lr_scheduler=cosine",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
    "critic.optim.lr_warmup_steps=2",
]
B, P, R = 4, 5, 4


@pytest.fixture(scope="module")
def env():
    cfg = load_config(None, OVERRIDES)
    return cfg, prepare_default_model(cfg)


def _floor_reached_at(scheduler) -> int:
    """The first step at which the cosine multiplier sits at its floor (the schedule's planned end)."""
    lam = scheduler.lr_lambdas[0]
    return next(s for s in range(1000) if lam(s) == lam(10**6))


def test_each_worker_counts_its_own_optimizer_steps(env) -> None:
    cfg, path = env
    dp = make_data_plane("memory")
    plan = build_run_plan(cfg, "cpu")
    actor = PolicyWorker(actor_settings(cfg, plan), model_path=path, data_plane=dp)
    critic = CriticWorker(critic_settings(cfg, plan), model_path=path, data_plane=dp)
    # 5 steps x epochs x (4 prompts // mini-batch prompts): the critic's differ from the actor's.
    assert _floor_reached_at(actor.trained.scheduler) == 5 * 2 * 2
    assert _floor_reached_at(critic.trained.scheduler) == 5 * 3 * 4
    ref = ReferenceWorker(reference_settings(cfg, plan), model_path=path, data_plane=dp)
    assert ref.trained.scheduler is None and ref.optim_steps == 0


def _put_batch(dp, vocab: int):
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab, (B, P), generator=gen)
    responses = torch.randint(4, vocab, (B, R), generator=gen)
    response_mask = torch.ones(B, R, dtype=torch.bool)
    response_mask[1, 2:] = False
    responses[~response_mask] = 0
    fields = {
        "prompts": prompts,
        "prompt_mask": torch.ones(B, P, dtype=torch.bool),
        "responses": responses,
        "response_mask": response_mask,
        "advantages": torch.randn(B, R, generator=gen) * response_mask,
        "returns": torch.randn(B, R, generator=gen) * response_mask,
    }
    return dp.kv_batch_put([f"s{i}" for i in range(B)], "lr", fields)


def _update(worker, meta, n: int) -> list[dict]:
    if isinstance(worker, PolicyWorker):
        # The total is not a call parameter: a caller cannot pass one, the worker's own count drives the schedule.
        with pytest.raises(ValueError, match="total_optim_steps"):
            worker.update_actor(
                meta.with_extra_info(temperature=1.0, calculate_entropy=False, compute_loss=True, total_optim_steps=1)
            )
        call = meta.with_extra_info(**UpdateCall(temperature=1.0, calculate_entropy=False).to_extra_info())
        return [dict(worker.update_actor(call).extra_info) for _ in range(n)]
    return [dict(worker.update_critic(meta).extra_info) for _ in range(n)]


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_worker_resumed_mid_schedule_continues_like_the_uninterrupted_one(env, role: str, tmp_path) -> None:
    cfg, path = env
    dp = make_data_plane("memory")

    def make():
        plan = build_run_plan(cfg, "cpu")
        if role == "actor":
            return PolicyWorker(actor_settings(cfg, plan), model_path=path, data_plane=dp)
        return CriticWorker(critic_settings(cfg, plan), model_path=path, data_plane=dp)

    first = make()
    meta = _put_batch(dp, first.model.config.vocab_size)
    if role == "actor":
        first.compute_log_prob(
            meta.with_extra_info(**LogProbCall(temperature=1.0, calculate_entropy=False).to_extra_info())
        )
    else:
        first.compute_values(meta)
    head = _update(first, meta, 3)
    state = first.save_checkpoint(str(tmp_path / "shards"))
    assert state["optim_steps"] == 3 and state["lr_scheduler"]["last_epoch"] == 3
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    tail_ref = _update(first, meta, 2)

    resumed = make()
    resumed.load_checkpoint(str(tmp_path / "shards"), torch.load(buf, weights_only=True))
    assert resumed.optim_steps == 3
    tail = _update(resumed, meta, 2)
    lr_key = f"{role}/lr"
    lrs = [m[lr_key] for m in head + tail]
    assert lrs[0] < lrs[1] == lrs[2], "warm-up to the full lr"
    assert lrs[2] > lrs[3] > lrs[4], "cosine decay, resumed half-way through"
    for got, want in zip(tail, tail_ref):
        assert {k: v for k, v in got.items() if "memory" not in k} == {
            k: v for k, v in want.items() if "memory" not in k
        }
