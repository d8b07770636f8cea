"""A setting reaches workers in this process and workers on Ray alike: one construction path for both.

The run below uses three things that live in the user's files (a reward
function, an advantage estimator and a policy loss from a plugin) and checks
that each took effect, with local workers and with two Ray ranks. The Ray
case is also the suite's run of two CPU ranks on this machine started by
`run_training` itself (a Ray run costs ~30 s here, nearly all of it starting
processes): it checks what that run logs and that it leaves nothing running.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conveyor.config import load_config
from conveyor.trainer.run import run_training

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Every sample scores 0.75, whatever it says: recognisable in reward/mean."""
    return 0.75
'''

PLUGIN = '''
import torch

from conveyor.algos.advantages import compute_grpo_advantage, register_adv_estimator
from conveyor.algos.losses import compute_policy_loss, register_policy_loss


@register_adv_estimator("construction_test_estimator_{where}")
def estimator(token_level_rewards, response_mask, **kwargs):
    """GRPO, under a name only this plugin registers."""
    return compute_grpo_advantage(token_level_rewards, response_mask, **kwargs)


@register_policy_loss("construction_test_loss_{where}")
def loss(*args, **kwargs):
    """PPO's clipped loss plus a marker metric, so the run shows which loss the workers used."""
    value, metrics = compute_policy_loss(*args, **kwargs)
    metrics["construction_test_marker"] = torch.tensor(1.0)
    return value, metrics
'''


def _steps(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(r["step"]): r for r in rows}


def _ray_processes() -> list:
    """Ray worker processes (titled `ray::...`) below this test process."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.cmdline() and p.cmdline()[0].startswith("ray::"):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("where", ["local", "ray"])
def test_user_reward_estimator_and_loss_reach_every_worker(
    where: str, tiny_run, wait_until, tmp_path: Path, caplog
) -> None:
    if where == "ray":
        ray = pytest.importorskip("ray")
        pytest.importorskip("psutil")
        assert not ray.is_initialized()
        caplog.set_level(logging.INFO, logger="conveyor")
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(REWARD)
    plugin_file = tmp_path / "my_algos.py"
    # Names per case: one test process registers both cases' plugins.
    plugin_file.write_text(PLUGIN.replace("{where}", where))
    overrides = tiny_run + [
        f"reward.custom_reward_function.path={reward_file}",
        f"trainer.plugins=[{plugin_file}]",
        f"algorithm.adv_estimator=construction_test_estimator_{where}",
        f"actor_rollout_ref.actor.policy_loss.loss_mode=construction_test_loss_{where}",
    ]
    if where == "ray":
        overrides += ["trainer.num_cpu_workers=2", "ray.num_cpus=4"]
    run_training(load_config(None, overrides))
    steps = _steps(tmp_path)
    for step in (1, 2):
        row = steps[step]
        assert row["reward/mean"] == 0.75, f"{where}: the custom reward function was not used"
        assert row["actor/construction_test_marker"] == 1.0, f"{where}: the plugin's policy loss was not used"
        # Constant rewards: every group's advantage is exactly zero under the plugin's GRPO.
        assert row["advantages/max"] == 0.0 and row["advantages/min"] == 0.0
    if where == "ray":
        # Two CPU ranks on this machine (formerly test_ray_training's test_two_cpu_ranks_on_this_machine).
        for step in (1, 2):
            row = steps[step]
            # Each rank reports its own peak; the trainer logs the max over ranks under the role.
            assert row["actor/perf/max_memory_allocated_gb"] > 0
            assert row["actor/perf/cpu_memory_used_gb"] > 0
            assert "actor/pg_loss" in row and "actor/grad_norm" in row
        messages = [r.getMessage() for r in caplog.records]
        assert any("the trainer's process serves them the memory data plane" in m for m in messages)
        assert any(m.startswith("actor: 2 rank(s)") for m in messages)
        # run_training started Ray, so it stopped it: nothing is left running.
        assert not ray.is_initialized()
        assert wait_until(lambda: not _ray_processes()), [p.cmdline() for p in _ray_processes()]
