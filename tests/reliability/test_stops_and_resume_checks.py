"""SIGTERM stops like Ctrl-C; resume checks what it loads; one run per run directory; a full or unusable disk.

Every case runs `conveyor train` as a user (or a scheduler) would and checks
the exit status, the one-line error and what is left on disk. The refusals,
which stop before anything is built, run through the command's entry point one
after another in one child process (the `refusals` fixture), so that the
stack is imported once for all of them.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from conveyor.config import load_config
from conveyor.trainer.checkpoint import load_checkpoint
from conveyor.trainer.run import run_training


def _sigterm_after_step(rel, processes, run_dir: Path, *extra: str) -> tuple[int, str]:
    proc = rel.TrainProcess(run_dir, "trainer.total_training_steps=100000", *extra)
    processes.append(proc)
    rel.wait_until(lambda: 1 in rel.logged_steps(run_dir), proc, timeout=240)
    proc.proc.send_signal(signal.SIGTERM)
    return proc.wait(), proc.stderr


def test_sigterm_saves_the_running_step_exits_143_and_resume_continues(
    rel, base_model, tmp_path: Path, processes
) -> None:
    run_dir = tmp_path / "run"
    status, err = _sigterm_after_step(rel, processes, run_dir)
    assert status == 143, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "stopped by SIGTERM"
    assert "SIGTERM: finishing step" in err
    (k,) = rel.checkpoint_steps(run_dir)
    assert k == max(rel.logged_steps(run_dir))
    resumed = rel.run_cli(*rel.train_args(run_dir, f"trainer.total_training_steps={k + 1}"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {k})" in resumed.stderr and rel.logged_steps(run_dir) == list(range(1, k + 2))


def test_sigterm_under_ray_workers_saves_and_exits_143(rel, two_rank_runs: dict) -> None:
    # The SIGTERM reaches the resumed run of the two-rank fixture (near the end of this file) after its step 4.
    run_dir, status, err = two_rank_runs["run_dir"], two_rank_runs["sigterm_status"], two_rank_runs["sigterm_stderr"]
    assert status == 143, err[-3000:]
    assert "Traceback" not in err and "Stack trace" not in err and "*** SIG" not in err
    assert err.strip().splitlines()[-1] == "stopped by SIGTERM"
    assert "SIGTERM: finishing step" in err
    k = max(rel.checkpoint_steps(run_dir))
    assert k >= 4 and k == max(rel.logged_steps(run_dir))  # the running step was finished and saved
    # Two ranks wrote their shards of the same checkpoint.
    assert sorted(p.name for p in (run_dir / "checkpoints" / f"global_step_{k}" / "actor").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]


def test_default_save_freq_bounds_what_a_crash_loses() -> None:
    assert load_config(None, []).trainer.save_freq == 100


# --------------------------------------------------------------------------- resume checks
@pytest.fixture(scope="module")
def finished_two_step_run(rel, base_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run with checkpoints at steps 1 and 2 (made once; tests change copies of it)."""
    run_dir = tmp_path_factory.mktemp("two-step") / "run"
    done = rel.run_cli(
        *rel.train_args(
            run_dir, "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=null"
        )
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_a_changed_setting_is_refused_naming_the_keys_and_can_be_accepted(rel, refusals: dict) -> None:
    refused, run_dir, needles = refusals["changed_setting"]
    rel.assert_usage_error(refused["status"], refused["stderr"], needles)
    before = refusals["config_before_the_change"]
    assert (run_dir / "config.yaml").read_text() == before  # never overwritten by a config that does not match
    assert rel.logged_steps(run_dir) == [1, 2]

    accepted = rel.run_cli(
        *rel.train_args(
            run_dir,
            "trainer.total_training_steps=3",
            "actor_rollout_ref.actor.optim.lr=0.001",
            "trainer.resume_accept_config_changes=true",
        )
    )
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert "resuming" in accepted.stderr and "actor_rollout_ref.actor.optim.lr: 0.0006 -> 0.001" in accepted.stderr
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["actor_rollout_ref"]["actor"]["optim"]["lr"] == 0.001
    kept = list(run_dir.glob("config.*.yaml"))
    assert len(kept) == 1 and kept[0].read_text() == before
    assert rel.logged_steps(run_dir) == [1, 2, 3]


DAMAGES = ["step_mismatch", "truncated_state", "truncated_shard", "missing_shards"]


def _damage(step2: Path, damage: str) -> tuple[str, ...]:
    """Damage checkpoint `step2` as `damage` says; what the refusal must name."""
    if damage == "step_mismatch":
        step2.rename(step2.with_name("global_step_5"))
        return ("global_step_5", "inconsistent", "step 5", "step 2")
    if damage == "truncated_state":
        state = step2 / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[:100])
        return ("trainer_state.pt", "truncated or unreadable")
    if damage == "truncated_shard":
        (shard,) = (step2 / "actor").glob("*.distcp")
        shard.write_bytes(shard.read_bytes()[:1000])
        return ("global_step_2", "actor")
    for f in (step2 / "actor").iterdir():
        f.unlink()
    (step2 / "actor").rmdir()
    return ("global_step_2", "no actor shards")


def _read_only_filesystem_here() -> bool:
    return not (os.access("/sys", os.W_OK) and not os.path.ismount("/sys"))


@pytest.fixture(scope="module")
def refusals(rel, finished_two_step_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The refused runs of the tests in this file, each resume on its own copy of the two-step run, run one after
    another through the command's entry point in one child process (a `conveyor train` process spends ~6 s
    importing its stack; a refusal takes well under one). Case -> (result, run directory, what the refusal must
    name); also the config.yaml of the changed-setting case before its refusal."""
    tmp = tmp_path_factory.mktemp("refusals")
    cases, dirs, needles = {}, {}, {}

    def copy(case: str) -> Path:
        dirs[case] = tmp / case / "run"
        shutil.copytree(finished_two_step_run, dirs[case])
        return dirs[case]

    for damage in DAMAGES:
        needles[damage] = _damage(copy(damage) / "checkpoints" / "global_step_2", damage)
        cases[damage] = rel.train_args(dirs[damage], "trainer.total_training_steps=6")
    cases["another_model"] = rel.train_args(
        copy("another_model"),
        "trainer.total_training_steps=3",
        "actor_rollout_ref.model.tiny.hidden_size=32",
        "trainer.resume_accept_config_changes=true",
    )
    needles["another_model"] = ("global_step_2", "cannot load into this model")
    run_dir = copy("changed_setting")
    before = (run_dir / "config.yaml").read_text()
    cases["changed_setting"] = rel.train_args(
        run_dir,
        "trainer.total_training_steps=3",
        "actor_rollout_ref.actor.optim.lr=0.001",
        "actor_rollout_ref.rollout.n=2",
    )
    needles["changed_setting"] = (
        str(run_dir / "checkpoints" / "global_step_2"),
        "actor_rollout_ref.actor.optim.lr: 0.0006 -> 0.001",
        "actor_rollout_ref.rollout.n: 4 -> 2",
        "trainer.resume_accept_config_changes=true",
    )
    older = copy("resume_older") / "checkpoints" / "global_step_1"
    cases["resume_older"] = rel.train_args(
        dirs["resume_older"],
        "trainer.total_training_steps=3",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={older}",
    )
    needles["resume_older"] = (
        str(older),
        "is step 1",
        "newer checkpoints (global_step_2)",
        "trainer.default_local_dir",
        "trainer.resume_mode=auto",
    )
    cases["fresh_over_checkpoints"] = rel.train_args(
        copy("fresh_over_checkpoints"), "trainer.total_training_steps=3", "trainer.resume_mode=disable"
    )
    needles["fresh_over_checkpoints"] = (
        "trainer.resume_mode=disable",
        "global_step_1, global_step_2",
        "trainer.default_local_dir",
    )
    (tmp / "a_file").write_text("")
    unusable = {"under_a_file": tmp / "a_file" / "run"}
    if _read_only_filesystem_here():
        unusable["read_only_filesystem"] = Path("/sys/conveyor-run")
    for where, path in unusable.items():
        dirs[where] = path
        cases[where] = ["train", f"trainer.default_local_dir={path}", "trainer.total_training_steps=1"]
        needles[where] = (str(path), "trainer.default_local_dir")
    results = rel.run_cases_in_one_process(cases, tmp)
    out = {case: (results[case], dirs[case], needles[case]) for case in cases}
    out["config_before_the_change"] = before
    return out


def test_a_checkpoint_of_another_model_is_refused(rel, refusals: dict) -> None:
    result, _, needles = refusals["another_model"]
    rel.assert_usage_error(result["status"], result["stderr"], needles)


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_refused_naming_it(rel, refusals: dict, damage: str) -> None:
    result, _, needles = refusals[damage]
    rel.assert_usage_error(result["status"], result["stderr"], needles)


@pytest.mark.parametrize("case", ["resume_older", "fresh_over_checkpoints"])
def test_a_run_that_would_start_behind_newer_checkpoints_is_refused_and_deletes_nothing(
    rel, refusals: dict, case: str
) -> None:
    result, run_dir, needles = refusals[case]
    rel.assert_usage_error(result["status"], result["stderr"], needles)
    assert rel.checkpoint_steps(run_dir) == [1, 2] and rel.logged_steps(run_dir) == [1, 2]


def test_pruning_keeps_the_checkpoint_a_run_was_resumed_from(rel, finished_two_step_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_two_step_run, run_dir)
    step2 = run_dir / "checkpoints" / "global_step_2"
    done = rel.run_cli(
        *rel.train_args(
            run_dir,
            "trainer.total_training_steps=3",
            "trainer.max_ckpt_to_keep=1",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={step2}",
        )
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Step 1 is rotated out; step 2, only read, stays; step 3 is the newest, so a plain re-run continues it.
    assert rel.checkpoint_steps(run_dir) == [2, 3] and rel.logged_steps(run_dir) == [1, 2, 3]


# --------------------------------------------------------------------------- one run per directory
def test_a_second_run_on_the_same_directory_is_refused_and_a_crash_leaves_no_stale_lock(
    rel, base_model, tmp_path: Path, processes
) -> None:
    run_dir = tmp_path / "run"
    first = rel.TrainProcess(run_dir, "trainer.total_training_steps=100000")  # still running when checked
    processes.append(first)
    rel.wait_until(lambda: 1 in rel.logged_steps(run_dir), first, timeout=240)
    second = rel.run_cli(*rel.train_args(run_dir, "trainer.total_training_steps=40"))
    rel.assert_usage_error(
        second.returncode, second.stderr, (str(run_dir), "in use by another run", f"pid {first.proc.pid}")
    )
    first.proc.send_signal(signal.SIGKILL)
    first.wait()
    third = rel.run_cli(*rel.train_args(run_dir, "trainer.total_training_steps=1", "trainer.resume_mode=disable"))
    assert third.returncode == 0, third.stderr[-3000:]


# --------------------------------------------------------------------------- the disk
def test_disk_full_while_saving_is_one_error_and_leaves_no_half_checkpoint(
    rel, base_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import conveyor.workers.training.shards as shards

    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        rel.BASE_RUN
        + [f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=2", "trainer.save_freq=1"],
    )
    real_save = shards.dcp.save
    calls = {"n": 0}

    def save_until_full(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the disk fills up during the second checkpoint
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(*args, **kwargs)

    monkeypatch.setattr(shards.dcp, "save", save_until_full)
    with pytest.raises(ValueError) as info:
        run_training(cfg)
    msg = str(info.value)
    assert "No space left on device" in msg and "global_step_2" in msg and "global_step_1" in msg
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["global_step_1"]  # no .tmp-* left filling the disk
    assert load_checkpoint(root / "global_step_1")["trainer_state"]["global_step"] == 1


@pytest.mark.parametrize("where", ["under_a_file", "read_only_filesystem"])
def test_an_unusable_run_directory_is_one_error_naming_the_key(rel, refusals: dict, where: str) -> None:
    if where == "read_only_filesystem" and not _read_only_filesystem_here():
        pytest.skip("no read-only filesystem to try on this machine")
    result, _, needles = refusals[where]  # a run directory under a file, or /sys/conveyor-run
    rel.assert_usage_error(result["status"], result["stderr"], needles)


# --------------------------------------------------------------------------- two ranks: kill -9, resume, same run
def _kill_driver(pid: int) -> list:
    """SIGKILL the driver alone; the processes it started (Ray's) still alive 5 s later, killed then."""
    import psutil

    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    family = parent.children(recursive=True)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    _, alive = psutil.wait_procs(family, timeout=5)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    left = [(p.pid, p.name()) for p in alive]
    for p in alive:  # a failed check must not leave them running either
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.fixture(scope="module")
def two_rank_runs(rel, base_model, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """fsdp2 over two Ray ranks: the runs two tests check, made once (a Ray run costs ~30 s here, nearly all of it
    starting processes). An uninterrupted 4-step reference; a run killed -9 after its step-2 checkpoint, during
    step 3 or 4; its resume, which gets a SIGTERM once it has logged step 4 again. The lr is constant (BASE_RUN), so
    the resume's longer total does not change its steps."""
    pytest.importorskip("ray")
    pytest.importorskip("psutil")
    tmp = tmp_path_factory.mktemp("two-ranks")
    ranks = ("trainer.num_cpu_workers=2", "ray.num_cpus=4", "trainer.save_freq=2")
    reference = rel.run_cli(*rel.train_args(tmp / "reference", *ranks, "trainer.total_training_steps=4"))
    assert reference.returncode == 0, reference.stderr[-3000:]

    run_dir = tmp / "run"
    started = []
    try:
        killed = rel.TrainProcess(run_dir, *ranks, "trainer.total_training_steps=4")
        started.append(killed)
        rel.wait_until(
            lambda: 2 in rel.checkpoint_steps(run_dir) and 3 in rel.logged_steps(run_dir), killed, timeout=240
        )
        left_after_kill = _kill_driver(killed.proc.pid)
        checkpoints_after_kill = rel.checkpoint_steps(run_dir)
        logged_before = len(rel.logged_steps(run_dir))
        resumed = rel.TrainProcess(run_dir, *ranks, "trainer.total_training_steps=100000")
        started.append(resumed)
        rel.wait_until(lambda: 4 in rel.logged_steps(run_dir)[logged_before:], resumed, timeout=240)
        resumed.proc.send_signal(signal.SIGTERM)
        status = resumed.wait()
    finally:
        for proc in started:
            proc.kill()
    return {
        "reference": tmp / "reference",
        "run_dir": run_dir,
        "checkpoints_after_kill": checkpoints_after_kill,
        "left_after_kill": left_after_kill,
        "sigterm_status": status,
        "sigterm_stderr": resumed.stderr,
    }


def test_sigkill_of_a_ray_driver_leaves_no_process_of_the_run(two_rank_runs: dict) -> None:
    # Ray's raylet, agents and rank actors: none alive 5 s after the driver was killed with SIGKILL.
    assert two_rank_runs["left_after_kill"] == []


def test_two_ranks_killed_mid_run_resume_to_the_uninterrupted_run(rel, two_rank_runs: dict) -> None:
    """fsdp2 over two Ray ranks: kill -9 after a sharded checkpoint, resume, and the later steps are bitwise the
    steps of a run that was never stopped."""
    assert 2 in two_rank_runs["checkpoints_after_kill"] and 4 not in two_rank_runs["checkpoints_after_kill"]
    assert "(step 2)" in two_rank_runs["sigterm_stderr"]  # the resume started from the step-2 checkpoint
    rel.assert_same_steps(rel.read_steps(two_rank_runs["run_dir"]), rel.read_steps(two_rank_runs["reference"]), [3, 4])
