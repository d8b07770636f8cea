"""A Ray request that this machine cannot meet is refused before Ray starts, naming the key to change."""

from __future__ import annotations

import os

import pytest

from conveyor.cli import main
from conveyor.config import ConfigError, load_config
from conveyor.trainer import run
from conveyor.trainer.plan import build_run_plan
from conveyor.trainer.setup import check_local_resources

CORES = os.cpu_count() or 1


def check(overrides: list[str], device: str = "cpu") -> None:
    """The resource check of a run with these overrides, placed by its run plan."""
    cfg = load_config(None, overrides)
    check_local_resources(cfg, build_run_plan(cfg, device))


def test_more_cpu_ranks_than_the_local_ray_has_are_refused_naming_the_keys() -> None:
    with pytest.raises(ConfigError) as err:
        check([f"trainer.num_cpu_workers={CORES + 2}", "ray.worker_cpus=1"])
    msg = str(err.value)
    assert msg.startswith("trainer.num_cpu_workers:") and "ray.worker_cpus" in msg and "ray.num_cpus" in msg
    assert f"need {CORES + 3} CPUs" in msg  # the ranks and the reward worker
    # ray.num_cpus sizes the local Ray: enough of them, and the same ranks fit.
    check([f"trainer.num_cpu_workers={CORES + 2}", f"ray.num_cpus={CORES + 3}"])


def test_what_fits_and_what_is_not_started_here_are_let_through() -> None:
    check([])  # one process, no Ray
    check(["trainer.num_cpu_workers=2", "ray.num_cpus=2", "ray.worker_cpus=0.5"])
    # A cluster of its own is checked once connected: this machine's cores say nothing about it.
    check(["trainer.num_cpu_workers=64", "ray.address=auto"])


def test_gpu_ranks_beyond_the_visible_gpus_are_refused(monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"^trainer.n_gpus_per_node: 2 GPU rank\(s\).* would see 1"):
        check(["trainer.n_gpus_per_node=2", "ray.num_cpus=64"], "cuda")
    check(["trainer.n_gpus_per_node=1", "trainer.num_cpu_workers=1"], "cuda")


def test_train_exits_2_before_ray_starts(tmp_path, monkeypatch, capsys) -> None:
    def no_ray(*_args, **_kwargs):
        raise AssertionError("Ray was started for a request this machine cannot meet")

    monkeypatch.setattr(run, "ensure_ray", no_ray)
    monkeypatch.setattr(run, "prepare_default_model", no_ray)  # nor is the model built first
    argv = ["train", f"trainer.num_cpu_workers={CORES * 4}", f"trainer.default_local_dir={tmp_path}"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("error: trainer.num_cpu_workers:")
    # `conveyor config` checks a config for any machine: it does not look at this one's cores.
    assert main(["config", argv[1]]) == 0
