"""Tests of the `conveyor` command as a user runs it: real subprocesses, exit statuses and error output.

Each `run_cli` is a child process running `python -m conveyor.cli ARGS`'s module as `__main__`, with its own
stdout, stderr and exit status; the children are forked from one server (`cli_server.py`, the `run_cli`
fixture) that imported torch, transformers and conveyor once, instead of each importing them again (~10 s).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_server import CliServer

from conveyor.cli import main
from conveyor.config import Config, config_to_dict

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_cli(tmp_path_factory: pytest.TempPathFactory):
    """`run_cli(*ARGS, cwd=ROOT)`: `python -m conveyor.cli ARGS` in a fresh child process, as a user would run it."""
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_DEBUG"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    server = CliServer(ROOT, env, tmp_path_factory.mktemp("cli-server") / "stderr")
    yield server.run
    server.close()


def assert_usage_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit status 2, one `error:` message naming every needle, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("error:"), proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    for needle in needles:
        assert needle in proc.stderr


def test_config_prints_yaml_that_parses(run_cli) -> None:
    proc = run_cli("config", "actor_rollout_ref.rollout.temperature=0.7", "trainer.logger=[console]")
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)
    assert data["actor_rollout_ref"]["rollout"]["temperature"] == 0.7
    assert data["trainer"]["logger"] == ["console"]
    expected = config_to_dict(Config())
    expected["actor_rollout_ref"]["rollout"]["temperature"] = 0.7
    expected["trainer"]["logger"] = ["console"]
    assert data == expected


def test_config_describe_has_comments(run_cli, tmp_path: Path) -> None:
    proc = run_cli("config", "--describe")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines and all("  # " in ln for ln in lines)
    assert "moe_load_balance_metrics_interval: 0  # " in proc.stdout
    # the described YAML is still a config file the command accepts
    path = tmp_path / "described.yaml"
    path.write_text(proc.stdout)
    again = run_cli("config", "--config", str(path))
    assert again.returncode == 0 and yaml.safe_load(again.stdout) == config_to_dict(Config())


def test_config_file_and_overrides(run_cli, tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  total_training_steps: 7\n  experiment_name: mine\n")
    proc = run_cli("config", "--config", str(path), "trainer.total_training_steps=9")
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)
    assert data["trainer"]["total_training_steps"] == 9 and data["trainer"]["experiment_name"] == "mine"


def test_bad_override_is_a_one_line_error(run_cli) -> None:
    proc = run_cli("config", "trainer.totl_training_steps=3")
    assert_usage_error(proc, "trainer.totl_training_steps", "did you mean trainer.total_training_steps")
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1


def test_removed_key_is_an_error(run_cli) -> None:
    proc = run_cli("config", "actor_rollout_ref.rollout.moe_load_balance_monitor_interval=5")
    assert_usage_error(proc, "actor_rollout_ref.rollout.moe_load_balance_metrics_interval")


def test_missing_config_file(run_cli, tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    proc = run_cli("config", "--config", str(missing))
    assert_usage_error(proc, str(missing), "no such file")


def test_train_with_bad_config_fails_before_training(run_cli) -> None:
    proc = run_cli("train", "actor_rollout_ref.actor.optim.lr=-1")
    assert_usage_error(proc, "actor_rollout_ref.actor.optim.lr")


def _has_module(name: str) -> bool:
    """Whether `name` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize(
    ("command", "module"), [("plot", "conveyor.metrics.plots"), ("show", "conveyor.metrics.dumps")]
)
def test_missing_run_dir(run_cli, tmp_path: Path, command: str, module: str) -> None:
    if not _has_module(module):
        pytest.skip(f"{module} (behind `conveyor {command}`) is not written yet")
    missing = tmp_path / "no-such-run"
    proc = run_cli(command, str(missing))
    assert_usage_error(proc, str(missing))


def test_main_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["data"]["train_batch_size"] == 32
    assert main(["config", "nonsense=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key nonsense")


def test_debug_env_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_DEBUG", "1")
    with pytest.raises(ValueError, match="unknown config key"):
        main(["config", "nonsense=1"])


def test_argparse_usage_errors_exit_2(run_cli) -> None:
    proc = run_cli("config", "--no-such-flag")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "unrecognized arguments" in proc.stderr


def test_lean_forward_on_a_model_it_cannot_run_is_a_usage_error(run_cli, tmp_path: Path) -> None:
    proc = run_cli(
        "train",
        "actor_rollout_ref.model.tiny.arch=mixtral",
        "actor_rollout_ref.model.forward_impl=lean",
        "actor_rollout_ref.model.tiny.warmstart_steps=0",
        "trainer.total_training_steps=1",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={tmp_path}",
    )
    # The tiny model is built (and logged) before a worker finds it cannot run it.
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: actor_rollout_ref.model.forward_impl=lean cannot run this model"), last
    assert "MixtralForCausalLM" in last and "set it to auto or hf" in last


def test_config_file_may_stand_among_the_overrides(run_cli, tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  total_training_steps: 7\n  experiment_name: mine\n")
    proc = run_cli("config", "data.seed=5", "--config", str(path), "trainer.total_training_steps=9")
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)
    assert data["data"]["seed"] == 5 and data["trainer"]["total_training_steps"] == 9
    assert data["trainer"]["experiment_name"] == "mine"


@pytest.mark.parametrize("command", ["train", "config", "warmstart"])
def test_every_command_with_overrides_takes_config_between_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str
) -> None:
    import conveyor.cli as cli

    seen: dict = {}
    monkeypatch.setitem(cli._COMMANDS, command, lambda args: seen.update(vars(args)) or 0)
    path = str(tmp_path / "f.yaml")
    assert main([command, "a.b=1", "--config", path, "c.d=2"]) == 0
    assert seen["config"] == path and seen["overrides"] == ["a.b=1", "c.d=2"]
    seen.clear()
    assert main(["-v", command, "--config", path, "a.b=1", "c.d=2"]) == 0
    assert seen["config"] == path and seen["overrides"] == ["a.b=1", "c.d=2"] and seen["verbose"] is True


def test_an_error_stays_one_printable_line() -> None:
    """A carriage return, newline or lone surrogate from the user's input is escaped in the error line."""
    from conveyor.cli import one_line

    assert one_line("plain text, é 中") == "plain text, é 中"
    assert one_line("a\rb\nc\td\ud800") == "a\\rb\\nc\\td\\ud800"
    assert len(one_line("x=\r'").splitlines()) == 1


def _piped_three_step_run(run_dir: Path) -> subprocess.Popen:
    """`conveyor train` of the default config for three steps, its stdout and stderr pipes for the test to close."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conveyor.cli",
            "train",
            "--config",
            "examples/tiny_cpu.yaml",
            "trainer.total_training_steps=3",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "actor_rollout_ref.model.tiny.warmstart_steps=0",
            "trainer.progress_bar=false",
            f"trainer.default_local_dir={run_dir}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_a_run_piped_into_a_reader_that_stops_early_finishes(tmp_path: Path) -> None:
    # `conveyor train ... | head -c 50`: the console's reader leaves after the first bytes; the run must not.
    run_dir = tmp_path / "run"
    proc = _piped_three_step_run(run_dir)
    assert proc.stdout is not None and proc.stdout.read(50)
    proc.stdout.close()  # the reader is gone: the next console line meets a broken pipe
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert "its output is gone (BrokenPipeError" in err.decode()
    assert (run_dir / "checkpoints" / "global_step_3").is_dir()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3


def test_config_checks_a_gpu_run_on_a_machine_without_one(run_cli) -> None:
    # The plan is built for the device the config names, not the one this machine has.
    proc = run_cli("config", "trainer.device=cuda")
    assert proc.returncode == 0, proc.stderr
    assert "device: cuda" in proc.stdout


def test_a_run_whose_stdout_and_stderr_readers_both_go_away_finishes_and_logs_it_to_its_file(tmp_path: Path) -> None:
    # A terminal or ssh session that goes away takes both streams: the run goes on, and says so in train.log.
    run_dir = tmp_path / "run"
    proc = _piped_three_step_run(run_dir)
    assert proc.stderr is not None and proc.stderr.read(20)
    proc.stderr.close()  # gone before the first step: every later log line meets a broken pipe
    assert proc.stdout is not None and proc.stdout.read(50)
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0
    assert (run_dir / "checkpoints" / "global_step_3").is_dir()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    log = (run_dir / "train.log").read_text()
    assert "its output is gone (BrokenPipeError" in log and "Traceback" not in log


def test_a_mistake_reported_to_a_stderr_that_is_gone_still_exits_2(tmp_path: Path) -> None:
    # The `error:` line is lost with its reader; the exit status a script checks is not.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "conveyor.cli", "config", "trainer.no_such_key=1"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=write_end,
            cwd=Path(__file__).resolve().parents[1],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 2


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_version(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    import conveyor

    with pytest.raises(SystemExit) as done:
        main([flag])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"conveyor {conveyor.__version__}"
    # One version: the package's and the distribution's (pyproject.toml) agree.
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'\nversion = "{conveyor.__version__}"\n' in pyproject


def test_show_refuses_a_negative_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.metrics.dumps import write_generations

    row = {"prompt": "1+1=", "response": "2", "ground_truth": "2", "data_source": "d", "reward": 1, "advantage": 0}
    write_generations(tmp_path, 1, [row] * 3)
    assert main(["show", str(tmp_path), "-n", "-2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: -n must be 0 or more") and len(err.strip().splitlines()) == 1
    assert main(["show", str(tmp_path), "-n", "0"]) == 0
    out = capsys.readouterr().out
    assert "step 1: 3 samples" in out and "3 more samples not shown" in out
