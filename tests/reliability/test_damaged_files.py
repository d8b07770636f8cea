"""Damaged, truncated and foreign files under a run directory: every reader names the file, nothing else escapes.

One real two-step run (checkpoints, generation dumps, rollout bundles, metrics) is recorded once per module;
each case damages a copy of one of its files with fixed-seed random bytes (a random 4 kB block, a cut, a few
flipped bytes) and reads it back through the reader that `conveyor export`, a resume, a replay, `conveyor plot`
and `conveyor show` use. The promise: the file reads, or the reader raises the one user-error type
(`ValueError`, exit 2 at the command line) with a message naming the file; the input is never changed and no
half-written output is left. The readers' fuzz loops run no training, so the module takes seconds beyond its
one recorded run.
"""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path

import pytest

from conveyor.trainer import checkpoint as ckpt
from conveyor.trainer.rollout_dumps import read_bundle

CASES = 100
"""Damaged copies per file kind in the readers' fuzz loops."""

STATE = "checkpoints/global_step_2/trainer_state.pt"
METADATA = "checkpoints/global_step_2/actor/.metadata"
SHARD = "checkpoints/global_step_2/actor/__0_0.distcp"
BUNDLE_JSON = "rollouts/step_000002/bundle.json"
BUNDLE_TENSORS = "rollouts/step_000002/tensors.safetensors"

RECORDED = (
    "trainer.total_training_steps=2",
    "trainer.save_freq=1",
    "trainer.max_ckpt_to_keep=null",
    "trainer.dump_freq=1",
    "trainer.dump_rollouts.freq=1",
)
"""The recorded run's settings beside the base run's (a resume repeats them, the step count last)."""


@pytest.fixture(scope="module")
def recorded_run(rel, base_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run with checkpoints, generation dumps and rollout bundles of both steps (never changed)."""
    run_dir = tmp_path_factory.mktemp("recorded") / "run"
    done = rel.run_cli(*rel.train_args(run_dir, *RECORDED))
    assert done.returncode == 0, done.stderr[-3000:]
    for rel_path in (STATE, METADATA, SHARD, BUNDLE_JSON, BUNDLE_TENSORS, "generations/step_000002.jsonl"):
        assert (run_dir / rel_path).is_file(), rel_path
    return run_dir


def damaged(good: bytes, rng: random.Random, case: int) -> bytes:
    """Case `case` of three kinds in turn: a random 4 kB block, a cut at a random point, 1-8 bytes changed."""
    kind = case % 3
    if kind == 0:
        return rng.randbytes(4096)
    if kind == 1:
        return good[: rng.randrange(len(good))]
    data = bytearray(good)
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.getrandbits(8)
    return bytes(data)


def digest(folder: Path) -> str:
    """One hash of every file's path and bytes under `folder` (to show a command changed nothing)."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _fuzz(recorded_run: Path, tmp_path: Path, rel_path: str, seed: int, read, names: str) -> dict[str, int]:
    """Damage `rel_path` of a copy of the run CASES times and `read(copy)`: it returns, or raises a ValueError whose
    message holds `names` (the file it must name); any other exception fails. Counts of each outcome."""
    copy = tmp_path / "run"
    shutil.copytree(recorded_run, copy)
    target = copy / rel_path
    good = target.read_bytes()
    rng = random.Random(seed)
    outcomes = {"read": 0, "refused": 0}
    for case in range(CASES):
        target.write_bytes(damaged(good, rng, case))
        try:
            read(copy)
        except ValueError as err:
            assert names in str(err), (case, str(err))
            assert "\n" not in str(err).strip(), (case, str(err))
            outcomes["refused"] += 1
        else:
            outcomes["read"] += 1
    return outcomes


def test_any_damage_to_trainer_state_is_read_or_refused_naming_the_file(recorded_run: Path, tmp_path: Path) -> None:
    # Random bytes reach torch.load's IndexError, KeyError and UnicodeDecodeError paths, which escaped before.
    step2 = Path("checkpoints/global_step_2")
    outcomes = _fuzz(
        recorded_run, tmp_path, STATE, 1, lambda run: ckpt.load_checkpoint(run / step2), "trainer_state.pt"
    )
    assert outcomes["refused"] >= CASES * 2 // 3, outcomes  # every random block and every cut


def test_any_damage_to_dcp_metadata_is_read_or_refused_naming_the_file(recorded_run: Path, tmp_path: Path) -> None:
    # The allow-list unpickler of the shards' metadata let KeyError, OverflowError, MemoryError and RuntimeError out.
    step2 = Path("checkpoints/global_step_2")
    outcomes = _fuzz(recorded_run, tmp_path, METADATA, 2, lambda run: ckpt.load_checkpoint(run / step2), "actor")
    assert outcomes["refused"] >= CASES * 2 // 3, outcomes


IN_FLIGHT = "checkpoints/global_step_1/in_flight.pt"


@pytest.fixture(scope="module")
def recorded_async_run(rel, base_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step asynchronous run (k = 1) whose step-1 checkpoint keeps batch 2, in flight (never changed)."""
    run_dir = tmp_path_factory.mktemp("recorded-async") / "run"
    done = rel.run_cli(
        *rel.train_args(
            run_dir,
            "trainer.total_training_steps=2",
            "trainer.save_freq=1",
            "trainer.max_ckpt_to_keep=null",
            "trainer.v1.trainer_mode=separate_async",
            "trainer.v1.sampler.max_off_policy_threshold=1",
        )
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run_dir / IN_FLIGHT).is_file()
    return run_dir


def test_any_damage_to_the_batches_in_flight_is_read_or_refused_naming_the_file(
    recorded_async_run: Path, tmp_path: Path
) -> None:
    step1 = Path("checkpoints/global_step_1")
    read = lambda run: ckpt.load_checkpoint(run / step1)  # noqa: E731
    outcomes = _fuzz(recorded_async_run, tmp_path / "fuzz", IN_FLIGHT, 6, read, "in_flight.pt")
    assert outcomes["refused"] >= CASES * 2 // 3, outcomes  # every random block and every cut
    copy = tmp_path / "missing"
    shutil.copytree(recorded_async_run, copy)
    (copy / IN_FLIGHT).unlink()
    with pytest.raises(ValueError, match=r"in_flight\.pt is missing"):
        ckpt.load_checkpoint(copy / step1)


def test_a_resume_from_damaged_batches_in_flight_stops_at_start_naming_the_file(
    rel, recorded_async_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(recorded_async_run, run)
    shutil.rmtree(run / "checkpoints" / "global_step_2")  # a crash right after step 1's checkpoint
    (run / IN_FLIGHT).write_bytes(random.Random(15).randbytes(4096))
    metrics_before = (run / "metrics.jsonl").read_bytes()
    done = rel.run_cli(
        *rel.train_args(
            run,
            "trainer.total_training_steps=2",
            "trainer.save_freq=1",
            "trainer.max_ckpt_to_keep=null",
            "trainer.v1.trainer_mode=separate_async",
            "trainer.v1.sampler.max_off_policy_threshold=1",
        )
    )
    rel.assert_usage_error(done.returncode, done.stderr, ("in_flight.pt",))
    assert (run / "metrics.jsonl").read_bytes() == metrics_before  # no step was trained


def test_a_cut_shard_is_refused_naming_it_when_the_checkpoint_is_chosen(recorded_run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(recorded_run, copy)
    shard = copy / SHARD
    good = shard.read_bytes()
    for cut in random.Random(3).sample(range(len(good)), 20):
        shard.write_bytes(good[:cut])
        with pytest.raises(ValueError, match=r"__0_0\.distcp is truncated"):
            ckpt.load_checkpoint(copy / "checkpoints" / "global_step_2")


def test_any_damage_to_a_bundle_json_is_read_or_refused_naming_it(recorded_run: Path, tmp_path: Path) -> None:
    bundle = Path(BUNDLE_JSON).parent
    _fuzz(recorded_run, tmp_path, BUNDLE_JSON, 4, lambda run: read_bundle(run / bundle), "bundle.json")


def test_any_damage_to_bundle_tensors_is_refused_naming_them(recorded_run: Path, tmp_path: Path) -> None:
    # A changed byte inside a tensor's data reads as a valid file: the digest in bundle.json finds it.
    bundle = Path(BUNDLE_JSON).parent
    outcomes = _fuzz(
        recorded_run, tmp_path, BUNDLE_TENSORS, 5, lambda run: read_bundle(run / bundle), "tensors.safetensors"
    )
    assert outcomes == {"read": 0, "refused": CASES}


@pytest.mark.parametrize("what", ["not_an_object", "list_of_keys_not_strings", "metrics_not_numbers"])
def test_a_bundle_json_of_the_wrong_shape_is_refused_naming_it(recorded_run: Path, tmp_path: Path, what: str) -> None:
    import json

    copy = tmp_path / "bundle"
    shutil.copytree(recorded_run / Path(BUNDLE_JSON).parent, copy)
    record = json.loads((copy / "bundle.json").read_text())
    if what == "not_an_object":
        record = [record]
    elif what == "list_of_keys_not_strings":
        record["keys"] = [1, 2]
    else:
        record["metrics"] = {"reward/mean": "high"}
    (copy / "bundle.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"trainer\.replay_rollouts_from: .*bundle\.json"):
        read_bundle(copy)


# --------------------------------------------------------------------------- the commands, on damaged run directories


def _damage_case(run: Path, case: str) -> str:
    """Damage `run` as `case` says; the text the refusal must name."""
    rng = random.Random(case)
    if case == "empty_dir":
        shutil.rmtree(run)
        run.mkdir()
        return str(run)
    if case == "a_file":
        shutil.rmtree(run)
        run.write_text("not a run\n")
        return str(run)
    target = {
        "state_random": STATE,
        "state_cut": STATE,
        "metadata_random": METADATA,
        "metadata_cut": METADATA,
        "shard_cut": SHARD,
        "config_json_garbage": "checkpoints/global_step_2/hf/config.json",
        "tokenizer_garbage": "checkpoints/global_step_2/hf/tokenizer.json",
    }[case]
    path = run / target
    good = path.read_bytes()
    path.write_bytes(rng.randbytes(4096) if case.endswith(("random", "garbage")) else good[: len(good) // 2])
    return path.name


EXPORT_CASES = [
    "empty_dir",
    "a_file",
    "state_random",
    "state_cut",
    "metadata_random",
    "metadata_cut",
    "shard_cut",
    "config_json_garbage",
    "tokenizer_garbage",
]


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_export_of_a_damaged_run_is_one_line_naming_the_file_and_changes_nothing(
    rel, capsys, recorded_run: Path, tmp_path: Path, case: str
) -> None:
    run = tmp_path / "run"
    shutil.copytree(recorded_run, run)
    needle = _damage_case(run, case)
    before = digest(run) if run.is_dir() else run.read_bytes()
    out = tmp_path / "exported"
    status, err = rel.main_in_process(["export", str(run), "--out", str(out)], capsys)
    rel.assert_usage_error(status, err, (needle,))
    assert (digest(run) if run.is_dir() else run.read_bytes()) == before
    assert not out.exists()
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]  # no half export beside it


def test_export_of_the_undamaged_run_still_works(rel, capsys, recorded_run: Path, tmp_path: Path) -> None:
    before = digest(recorded_run)
    status, err = rel.main_in_process(["export", str(recorded_run), "--out", str(tmp_path / "ok")], capsys)
    assert status == 0, err[-3000:]
    assert (tmp_path / "ok" / "config.json").is_file()
    assert digest(recorded_run) == before


@pytest.mark.parametrize("command", ["plot", "show"])
@pytest.mark.parametrize("case", ["empty_dir", "a_file", "random_bytes", "cut"])
def test_plot_and_show_of_a_damaged_run_name_the_file_and_change_nothing(
    rel, capsys, recorded_run: Path, tmp_path: Path, command: str, case: str
) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    shutil.copytree(recorded_run, run)
    if case in ("empty_dir", "a_file"):
        needle = _damage_case(run, case)
    else:
        target = run / ("metrics.jsonl" if command == "plot" else "generations/step_000002.jsonl")
        good = target.read_bytes()
        if case == "random_bytes":
            target.write_bytes(random.Random(command).randbytes(4096).replace(b"\n", b" "))
        else:
            target.write_bytes(good[: good.index(b"\n") // 2])  # half of the first line: nothing whole is left
        needle = target.name
    before = digest(run) if run.is_dir() else run.read_bytes()
    argv = [command, str(run)] + (["--out", str(tmp_path / "plots")] if command == "plot" else [])
    status, err = rel.main_in_process(argv, capsys)
    rel.assert_usage_error(status, err, (needle,))
    assert (digest(run) if run.is_dir() else run.read_bytes()) == before


def test_plot_of_partly_damaged_metrics_plots_the_rest_and_names_the_bad_lines(
    rel, capsys, recorded_run: Path, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    shutil.copytree(recorded_run, run)
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + random.Random(7).randbytes(300).replace(b"\n", b" ") + b"\n[1, 2]\n")
    before = digest(run)
    status, err = rel.main_in_process(["plot", str(run), "--out", str(tmp_path / "plots")], capsys)
    assert status == 0, err[-3000:]
    assert f"{metrics}:3 is not valid UTF-8 JSON" in err and f"{metrics}:4 is not a JSON object" in err
    assert digest(run) == before


# --------------------------------------------------------------------------- a resume and a replay, at the command line


@pytest.fixture(scope="module")
def refused_starts(rel, recorded_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Runs resumed from, or replaying, damaged copies of the recorded run, one after another in one child process.
    Case -> (result, run directory, what the refusal must name, metrics.jsonl before)."""
    tmp = tmp_path_factory.mktemp("refused-starts")
    cases, info = {}, {}
    for case, target, seed in [
        ("resume_state_random", STATE, 11),
        ("resume_metadata_random", METADATA, 12),
        ("resume_shard_cut", SHARD, None),
        ("replay_bundle_json_random", "rollouts/step_000001/bundle.json", 13),
        ("replay_older_bundle_tensors_flipped", "rollouts/step_000001/tensors.safetensors", 14),
    ]:
        run = tmp / case / "run"
        shutil.copytree(recorded_run, run)
        path = run / target
        good = path.read_bytes()
        if seed is None:
            path.write_bytes(good[: len(good) // 2])
        elif case.endswith("flipped"):
            path.write_bytes(damaged(good, random.Random(seed), 2))
        else:
            path.write_bytes(random.Random(seed).randbytes(4096))
        if case.startswith("resume"):
            cases[case] = rel.train_args(run, *RECORDED[1:], "trainer.total_training_steps=3")
        else:
            # A replay of the whole dump root from step 1: its step-1 bundle is damaged, the newest is not.
            cases[case] = rel.train_args(
                tmp / case / "replay",
                "trainer.total_training_steps=2",
                f"trainer.replay_rollouts_from={run / 'rollouts'}",
            )
        info[case] = (run, path.name, (run / "metrics.jsonl").read_bytes(), digest(run))
    results = rel.run_cases_in_one_process(cases, tmp)
    return {case: (results[case], *info[case]) for case in cases}


@pytest.mark.parametrize(
    "case",
    [
        "resume_state_random",
        "resume_metadata_random",
        "resume_shard_cut",
        "replay_bundle_json_random",
        "replay_older_bundle_tensors_flipped",
    ],
)
def test_a_damaged_checkpoint_or_bundle_stops_the_run_at_start_naming_the_file(rel, refused_starts, case: str) -> None:
    result, run, needle, metrics_before, digest_before = refused_starts[case]
    rel.assert_usage_error(result["status"], result["stderr"], (needle,))
    assert (run / "metrics.jsonl").read_bytes() == metrics_before  # no step was trained
    if case.startswith("replay"):
        assert digest(run) == digest_before  # a replay only reads the recording
        assert rel.logged_steps(run.parent / "replay") == []


def test_an_atomic_write_leaves_the_old_file_or_the_new_one(tmp_path, monkeypatch) -> None:
    from conveyor.files import write_text_atomic

    path = tmp_path / "config.yaml"
    write_text_atomic(path, "old: 1\n")

    def killed(src, dst):
        raise KeyboardInterrupt  # a kill between writing the temporary file and renaming it

    monkeypatch.setattr("conveyor.files.os.replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "new: 2\n")
    assert path.read_text() == "old: 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # no temporary file left behind
    monkeypatch.undo()
    write_text_atomic(path, "new: 2\n")
    assert path.read_text() == "new: 2\n"
