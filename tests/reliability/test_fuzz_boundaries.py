"""Every reader of a file or of outside data, fed arbitrary and adversarial input (property-based, hypothesis).

The promise under test: an input either works, or ends in one `error:` line
that names the file (or key, or tool) with exit status 2 at the command line,
or in the reader's typed error naming it in-process; never an uncaught
exception. Everything runs in this process (the command's `main(argv)`,
the readers themselves), with small example counts, so the module takes
seconds, not a training run per example.
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.tasks.rewards import RewardFunctionError, compute_score, finite_score, register_reward_fn
from conveyor.tools.base import load_tools, run_call
from conveyor.tools.formats import MAX_JSON_DEPTH, ToolCall, ToolCallError, get_format

_QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=_QUIET)
"""For readers that take microseconds."""
SLOW_FUZZ = settings(max_examples=20, deadline=None, suppress_health_check=_QUIET)
"""For whole commands (a config resolved, a plot drawn, parquet written and loaded): ~0.1-0.5 s an example."""

# Text with what breaks naive readers: lone surrogates, NULs, control and bidi characters, brackets.
nasty_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=200) | st.sampled_from(
    ["\ud800", "\udfff", "\x00", "\x1b[2J", "\u202e", "{" * 3000, "[" * 3000 + "]", "#### 12", "1e400", "-0", ""]
)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | nasty_text
    | st.sampled_from([10**400, -(10**400), 2**63, 1e308, -1e308, 5e-324])
)
json_values = st.recursive(
    json_scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=12,
)


def _assert_ok_or_one_error_line(status: int, err: str, *needles: str) -> None:
    """Status 0, or status 2 with a last line `error: ...` holding every needle and no traceback."""
    assert "Traceback" not in err, err[-3000:]
    if status == 0:
        return
    assert status == 2, (status, err[-3000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err[-3000:]
    for needle in needles:
        assert needle in last, (needle, last)


def _encode(line: Any) -> bytes:
    """One JSONL line: JSON when the value can be written (surrogates escaped), else its raw bytes."""
    if isinstance(line, bytes):
        return line
    try:
        return json.dumps(line).encode()
    except (ValueError, TypeError):
        return repr(line).encode("utf-8", "surrogateescape") if isinstance(line, str) else b"?"


jsonl_lines = st.lists(
    json_values
    | st.binary(max_size=40)
    | st.fixed_dictionaries(
        {"step": json_scalars}, optional={"reward/mean": json_scalars, "actor/pg_loss": json_scalars}
    ),
    max_size=6,
)


# --------------------------------------------------------------------------- config YAML and overrides


@SLOW_FUZZ
@given(
    body=st.binary(max_size=300)
    | nasty_text.map(lambda t: t.encode("utf-8", "surrogatepass"))
    | st.sampled_from(
        [
            b"- a\n",
            b"3\n",
            b"trainer: 5\n",
            b"trainer:\n  seed: 1e999\n",
            b"\xff\xfe\x00",
            b"a: &x [*x]\n",
            b"[" * 3000,
            b"trainer: {total_training_steps: 99999999999999999999}\n",
        ]
    )
)
def test_config_yaml_of_any_bytes_is_read_or_one_error_line_naming_the_file(rel, capsys, body: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_bytes(body)
        status, err = rel.main_in_process(["config", "--config", str(path)], capsys)
    _assert_ok_or_one_error_line(status, err)  # the file, or the key in it, is named: checked below


def test_a_config_that_is_not_utf8_names_the_file_and_the_byte(rel, capsys, tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("trainer:\n  experiment_name: caf\xe9\n".encode("latin-1"))
    status, err = rel.main_in_process(["config", "--config", str(path)], capsys)
    _assert_ok_or_one_error_line(status, err, str(path), "not UTF-8", "0xe9", "line 2")
    assert status == 2


override_keys = st.sampled_from(
    [
        "trainer.total_training_steps",
        "trainer.seed",
        "data.train_batch_size",
        "actor_rollout_ref.rollout.temperature",
        "trainer.logger",
        "algorithm.adv_estimator",
        "trainer.nope",
        "",
        "a..b",
        "+trainer.seed",
        "trainer",
    ]
)


@SLOW_FUZZ
@given(
    overrides=st.lists(st.tuples(override_keys, nasty_text).map(lambda kv: f"{kv[0]}={kv[1]}") | nasty_text, max_size=3)
)
def test_any_command_line_override_is_applied_or_one_error_line(rel, capsys, overrides: list[str]) -> None:
    overrides = [o for o in overrides if not o.startswith("-")]  # an option is argparse's, not an override
    status, err = rel.main_in_process(["config", *overrides], capsys)
    _assert_ok_or_one_error_line(status, err)


# --------------------------------------------------------------------------- metrics (plot) and dumps (show)


@settings(max_examples=8, deadline=None, suppress_health_check=_QUIET)
@given(lines=jsonl_lines)
def test_plot_of_any_metrics_file_plots_the_good_lines_or_says_what_is_missing(rel, capsys, lines: list) -> None:
    pytest.importorskip("matplotlib")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        good = b'{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.7}\n'
        (run / "metrics.jsonl").write_bytes(good + b"\n".join(_encode(x) for x in lines) + b"\n")
        status, err = rel.main_in_process(["plot", str(run)], capsys)
    _assert_ok_or_one_error_line(status, err)
    assert status == 0, err[-3000:]  # two good lines are always there to plot


def test_plot_skips_a_step_of_10_to_the_400_and_a_huge_value(rel, capsys, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "reward/mean": 0.5}\n'
        '{"step": 1%s, "reward/mean": 0.6}\n'
        % ("0" * 400)
        + '{"step": 2, "reward/mean": 1%s}\n' % ("0" * 400)
        + '{"step": 3, "reward/mean": 0.7}\n'
    )
    (tmp_path / "metrics.jsonl").open("ab").write(b'{"step": 4, "reward/mean": "\xff"}\n')
    status, err = rel.main_in_process(["plot", str(tmp_path)], capsys)
    assert status == 0, err[-3000:]
    from conveyor.metrics.trackers import read_metrics_jsonl

    records = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "reward/mean" not in records[1]  # the value too large for a float is dropped, the step kept


dump_rows = st.fixed_dictionaries(
    {k: json_values for k in ("prompt", "response", "ground_truth", "data_source", "reward", "advantage")},
    optional={"turns": json_values, "extra": json_values},
)


def test_plot_draws_metrics_with_values_at_the_edge_of_a_double(rel, capsys, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, v in enumerate([1e308, -1e308, 5e-324, 0.5, float("inf"), 1.7e308, float("nan")]):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        **{
                            k: v
                            for k in (
                                "reward/mean",
                                "reward/max",
                                "reward/min",
                                "actor/pg_loss",
                                "actor/entropy",
                                "val/accuracy",
                                "timing_s/step",
                                "perf/throughput",
                            )
                        },
                    }
                )
                + "\n"
            )
    status, err = rel.main_in_process(
        ["plot", str(tmp_path)], capsys
    )  # matplotlib refused the axis: "arange: cannot compute length"
    assert status == 0, err[-3000:]


@FUZZ
@given(lines=st.lists(dump_rows, max_size=4) | jsonl_lines)
def test_show_of_any_dump_prints_it_or_names_the_file_and_line(rel, capsys, lines: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        (run / "generations").mkdir()
        path = run / "generations" / "step_000001.jsonl"
        path.write_bytes(b"\n".join(_encode(x) for x in lines) + b"\n")
        status, err = rel.main_in_process(["show", str(run)], capsys)
    _assert_ok_or_one_error_line(status, err, *(("generation",) if status else ()))


def test_show_names_the_line_of_a_dump_that_is_not_an_object(rel, capsys, tmp_path: Path) -> None:
    (tmp_path / "generations").mkdir()
    (tmp_path / "generations" / "step_000003.jsonl").write_text('{"prompt": "1+1", "response": "2"}\n[1, 2]\n')
    status, err = rel.main_in_process(["show", str(tmp_path)], capsys)
    assert status == 2
    _assert_ok_or_one_error_line(status, err, "step_000003.jsonl", "line 2", "not an object")


# --------------------------------------------------------------------------- checkpoint side files


def _optimizer_groups() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[dict]]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(2, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim, get_state_dict(model, optim)[1]["param_groups"]


@FUZZ
@given(groups=json_values | st.just([]) | st.just([{}]) | st.just({"params": []}))
def test_param_groups_of_any_json_are_refused_at_load_naming_the_file(groups: Any) -> None:
    from conveyor.workers.training.shards import CheckpointFormatError, _check_param_groups

    _, _, expected = _optimizer_groups()
    with pytest.raises(CheckpointFormatError, match="param_groups.json"):
        _check_param_groups(groups, expected, Path("/run/ckpt/actor/param_groups.json"))


def test_an_emptied_param_groups_json_is_refused_when_the_checkpoint_loads(tmp_path: Path) -> None:
    from conveyor.workers.training.shards import CheckpointFormatError, load_shards, save_shards

    model, optim, _ = _optimizer_groups()
    model(torch.ones(1, 2)).sum().backward()
    optim.step()
    save_shards(tmp_path / "actor", model, optim)
    load_shards(tmp_path / "actor", model, optim)  # the untouched file loads
    for emptied in ("[]", "[{}]", '[{"params": []}]'):
        (tmp_path / "actor" / "param_groups.json").write_text(emptied)
        with pytest.raises(CheckpointFormatError, match="param_groups.json.*resume from another checkpoint"):
            load_shards(tmp_path / "actor", model, optim)


model_files = (
    st.binary(max_size=120)
    | json_values.map(lambda v: _encode(v))
    | st.sampled_from([b"[" * 5000, b'{"weight_map": {"a": ["x"]}}', b'{"weight_map": 3}', b"\xff\xfe{}"])
)


@FUZZ
@given(
    config=model_files,
    index=st.none() | model_files,
    weights=st.binary(max_size=64)
    | st.sampled_from([(8).to_bytes(8, "little") + b"{" * 8, (2**63).to_bytes(8, "little") + b"{}"]),
)
def test_a_model_directory_of_any_files_is_accepted_or_named_with_what_to_do(
    config: bytes, index: Any, weights: bytes
) -> None:
    from conveyor.models.loading import check_checkpoint_dir

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "config.json").write_bytes(config)
        (d / "model.safetensors").write_bytes(weights)
        if index is not None:
            (d / "model.safetensors.index.json").write_bytes(index)
        try:
            check_checkpoint_dir(d)
        except ValueError as err:
            assert tmp in str(err) and "actor_rollout_ref.model.path" in str(err), err


def _stub_trainer(ckpt_path: Path) -> Any:
    """Just what `maybe_resume` touches: the real dataset, source, validation, accumulators and RNG code, no model.

    The parts are registered under the names `PPOTrainer` gives them, with the same readers of older checkpoints.
    """
    from conveyor.algos.kl import FixedKLController
    from conveyor.metrics.moe_load_balance import RolloutMoELoadBalanceMetricsAccumulator
    from conveyor.metrics.moe_router import RouterMarginAccumulator
    from conveyor.tasks.dataset import PromptDataset
    from conveyor.trainer.sources import SyncSource
    from conveyor.trainer.state import Checkpoints
    from conveyor.trainer.validation import Validation

    loaded: list[str] = []
    worker = SimpleNamespace(load_checkpoint=lambda path, state: loaded.append(path))
    stages = SimpleNamespace(train_data=PromptDataset([{"p": i} for i in range(8)], seed=1), global_step=0)
    source = SyncSource(stages, pipeline=None)  # the checkpoint's prompt order is the source's
    kl_ctrl = FixedKLController(0.0)
    ck = Checkpoints(
        cfg=SimpleNamespace(trainer=SimpleNamespace(resume_mode="resume_path", resume_from_path=str(ckpt_path))),
        ckpt_root=ckpt_path.parent,
        workers=SimpleNamespace(actor=worker, critic=None),
    )
    ck.register("val_history", Validation([]), older=lambda st: [])
    ck.register("kl_coef", kl_ctrl, save=lambda: kl_ctrl.value, load=lambda v: setattr(kl_ctrl, "value", float(v)))
    ck.register(
        "moe_load",
        RolloutMoELoadBalanceMetricsAccumulator(),
        older=lambda st: {"counts": st.get("moe_counts"), "retry_step": st.get("moe_retry_step", 0)},
    )
    ck.register("router_margins", RouterMarginAccumulator(0.01), older=lambda st: None)
    ck.register(
        "dataset",
        source,
        save=lambda: source.state_dict()["dataset"],
        load=lambda d: source.load_state_dict({"dataset": d}),
    )
    ck.loaded = loaded
    return ck


def _good_state(older: bool = False) -> dict[str, Any]:
    """A trainer state as conveyor writes it (`older`: as it wrote it before the MoE parts had entries of their own)."""
    from conveyor.tasks.dataset import PromptDataset
    from conveyor.trainer.checkpoint import rng_state

    state = {
        "global_step": 2,
        "config": {},
        "roles": {"actor": {}},
        "dataset": PromptDataset([{"p": i} for i in range(8)], seed=1).state_dict(),
        "rng": rng_state(),
        "kl_coef": 0.001,
        "val_history": [(1, 0.5)],
    }
    if older:
        return {**state, "moe_counts": None, "moe_retry_step": 0}
    margins = {"known": torch.tensor([5, 4]), "near": torch.tensor([1, 0]), "hist": torch.ones(2, 6, dtype=torch.long)}
    moe_load = {"counts": torch.ones(2, 4, dtype=torch.long), "retry_step": 0}
    return {**state, "moe_load": moe_load, "router_margins": margins}


state_edits = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "global_step",
                "dataset",
                "rng",
                "kl_coef",
                "roles",
                "moe_load",
                "moe_load.counts",
                "moe_load.retry_step",
                "router_margins",
                "router_margins.known",
                "router_margins.hist",
                "moe_retry_step",
                "val_history",
                "rng.python",
                "rng.numpy",
                "rng.torch",
                "dataset.epoch",
                "dataset.position",
            ]
        ),
        st.none() | st.integers(-3, 3) | st.text(max_size=4) | st.just("<delete>") | st.just({}) | st.just([[1]]),
    ),
    min_size=1,
    max_size=3,
)


@FUZZ
@given(edits=state_edits, older=st.booleans())
def test_a_trainer_state_with_entries_missing_or_changed_resumes_or_names_the_file(edits: list, older: bool) -> None:
    from conveyor.trainer.state import maybe_resume

    state = _good_state(older)
    for key, value in edits:
        node, *rest = key.split(".")
        holder, name = (state, node) if not rest else (state.get(node), rest[0])
        if not isinstance(holder, dict) or (value == "<delete>" and name not in holder):
            continue
        if value == "<delete>":
            del holder[name]
        else:
            holder[name] = value
    if "global_step" not in state or not isinstance(state["global_step"], int):
        return  # load_checkpoint's own check; covered by the resume tests
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"global_step_{state['global_step']}"
        (path / "actor").mkdir(parents=True)
        torch.save(state, path / "trainer_state.pt")
        trainer = _stub_trainer(path)
        random_state = torch.get_rng_state()
        try:
            maybe_resume(trainer)
        except ValueError as err:
            assert "trainer_state.pt" in str(err), err
            assert not trainer.loaded  # refused before any worker loaded its shards
        finally:
            torch.set_rng_state(random_state)


def test_a_state_file_without_its_rng_entry_is_refused_naming_it(tmp_path: Path) -> None:
    from conveyor.trainer.state import maybe_resume

    state = _good_state()
    del state["rng"]
    path = tmp_path / "global_step_2"
    (path / "actor").mkdir(parents=True)
    torch.save(state, path / "trainer_state.pt")
    with pytest.raises(ValueError, match=r"trainer_state.pt lacks the entry 'rng'.*resume from another checkpoint"):
        maybe_resume(_stub_trainer(path))


# --------------------------------------------------------------------------- tool YAML, tool outputs, tool calls


@SLOW_FUZZ
@given(
    body=st.binary(max_size=200)
    | st.sampled_from(
        [
            b"tools: 3\n",
            b"tools: []\n",
            b"tools:\n- name: x\n",
            b"tools:\n- name: x\n  path: no_such_module:f\n",
            b"tools:\n- {name: x, path: 'conveyor.tools.calculator:calculate', extra: 1}\n",
            b"\xff\xfe",
            b"[" * 3000,
        ]
    )
)
def test_a_tool_yaml_of_any_bytes_loads_or_names_the_key_and_file(body: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tools.yaml"
        path.write_bytes(body)
        try:
            load_tools(path)
        except ValueError as err:
            assert "multi_turn.tool_config_path" in str(err) and "tools.yaml" in str(err), err


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


tool_outputs = (
    json_values
    | st.binary(max_size=20)
    | st.tuples(nasty_text, json_scalars)
    | st.sampled_from(["x" * 2_000_000, "\ud800 lone", ("ok", 10**400), object(), b"\xff"])
)


@FUZZ
@given(output=tool_outputs)
def test_a_tool_returning_anything_gives_a_tool_result_of_printable_text(output: Any) -> None:
    result = run_call({"t": lambda **kw: output}, ToolCall("t", arguments={}), "s0", set())
    result.text.encode("utf-8")  # no lone surrogates: it is tokenized, dumped and printed
    assert math.isfinite(result.reward)
    assert (result.error is None) == (not result.text.startswith("error: "))


@pytest.mark.parametrize("raised", [asyncio.CancelledError(), _Unprintable(), SystemExit(3), RecursionError()])
def test_a_tool_that_raises_anything_but_a_stop_is_a_failed_call(raised: BaseException) -> None:
    def tool(**kw):
        raise raised

    async def async_tool(**kw):
        raise raised

    for fn in (tool, async_tool):
        result = run_call({"t": fn}, ToolCall("t", arguments={}), "s0", set())
        assert result.error and result.text.startswith("error: "), result


@FUZZ
@given(
    inner=json_values.map(lambda v: json.dumps(v)) | nasty_text,
    depth=st.integers(0, 5000),
    opener=st.sampled_from(["[", "{", '{"a":']),
)
def test_tool_call_text_of_any_nesting_parses_or_is_a_tool_call_error(inner: str, depth: int, opener: str) -> None:
    hermes, hashed = get_format("hermes"), get_format("hash")
    for text in (
        f"<tool_call>{inner}</tool_call>",
        f"<tool_call>{opener * depth}{inner}</tool_call>",
        f'<tool_call>{{"name": "t", "arguments": {opener * depth}1}}</tool_call>',
        f"#t {inner};",
        inner,
    ):
        for fmt in (hermes, hashed):
            try:
                call = fmt.parse(text)
            except ToolCallError:
                continue
            assert call is None or isinstance(call, ToolCall)


def test_a_tool_call_nested_3000_deep_is_refused_before_parsing() -> None:
    with pytest.raises(ToolCallError, match=f"deeper than {MAX_JSON_DEPTH}"):
        get_format("hermes").parse("<tool_call>" + "[" * 3000 + "</tool_call>")


# --------------------------------------------------------------------------- reward results and data rows


class _BadFloat:
    def __float__(self) -> float:
        raise RuntimeError("no float")


@FUZZ
@given(
    result=json_values
    | st.sampled_from(
        [_BadFloat(), torch.tensor([1.0, 2.0]), torch.tensor(float("nan")), torch.tensor(0.5), 10**400, object()]
    )
)
def test_a_reward_function_returning_anything_is_a_score_or_a_reward_function_error(result: Any) -> None:
    try:
        score = finite_score(result, "reward function f")
    except RewardFunctionError as err:
        assert "reward function f returned" in str(err)
    else:
        assert math.isfinite(score)

    name = "fuzz/returns"
    register_reward_fn(name, overwrite=True)(lambda s, gt, extra=None: result)
    try:
        assert math.isfinite(compute_score(name, "\ud800" * 300, "1"))
    except RewardFunctionError as err:
        assert name in str(err)


rows = st.fixed_dictionaries(
    {
        "data_source": st.sampled_from(["openai/gsm8k", "synthetic/arithmetic", "", "no/such"]) | nasty_text,
        "prompt": st.sampled_from(
            [
                [{"role": "user", "content": "What is 1+1?"}],
                [],
                [{"role": "", "content": "x"}],
                [{"role": "user", "content": ""}],
            ]
        ),
        "ability": st.none() | st.text(max_size=5),
        "reward_model": st.fixed_dictionaries(
            {
                "ground_truth": st.none()
                | st.text(max_size=12)
                | st.sampled_from(["42", "#### 7", "1,234", "seven", "nan", "1e999"])
            }
        ),
        "extra_info": st.just({"index": 0}),
    }
)


@settings(max_examples=15, deadline=None, suppress_health_check=_QUIET)
@given(records=st.lists(rows, min_size=1, max_size=3))
def test_parquet_rows_of_any_content_load_or_name_the_file_and_row(records: list[dict]) -> None:
    from conveyor.config import load_config
    from conveyor.tasks.parquet import write_parquet_records
    from conveyor.trainer.setup import load_prompt_records

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.parquet"
        try:
            write_parquet_records(
                [{**r, "data_source": r["data_source"].encode("utf-8", "replace").decode()} for r in records], path
            )
        except ValueError:
            return  # what cannot be written as one table cannot be handed to a run either
        cfg = load_config(
            None,
            [
                f"data.train_files=[{path}]",
                f"data.val_files=[{path}]",
                "actor_rollout_ref.model.tiny.warmstart_steps=0",
            ],
        )
        try:
            load_prompt_records(cfg)
        except ValueError as err:
            assert "rows.parquet" in str(err), err


def test_a_gsm8k_row_whose_ground_truth_is_not_a_number_is_reported_at_load(tmp_path: Path) -> None:
    from conveyor.config import load_config
    from conveyor.tasks.parquet import write_parquet_records
    from conveyor.trainer.setup import load_prompt_records

    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "How many?"}],
        "ability": "math",
        "reward_model": {"ground_truth": "#### 3"},
        "extra_info": {},
    }
    path = tmp_path / "gsm8k.parquet"
    write_parquet_records([row, {**row, "reward_model": {"ground_truth": "three apples"}}], path)
    cfg = load_config(None, [f"data.train_files=[{path}]", "actor_rollout_ref.model.tiny.warmstart_steps=0"])
    with pytest.raises(
        ValueError,
        match=r"gsm8k.parquet', row 1: reward_model.ground_truth 'three apples' is not "
        "a number",
    ):
        load_prompt_records(cfg)
    # A custom reward function decides for itself what a ground truth is.
    (tmp_path / "score.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    custom = load_config(
        None,
        [
            f"data.train_files=[{path}]",
            "actor_rollout_ref.model.tiny.warmstart_steps=0",
            f"reward.custom_reward_function.path={tmp_path / 'score.py'}",
        ],
    )
    assert len(load_prompt_records(custom)[0]) == 2


# --------------------------------------------------------------------------- the command's boundary itself


@pytest.mark.parametrize(
    "raised, user_caused",
    [
        (OSError(28, "No space left on device", "/full/metrics.jsonl"), True),
        (RuntimeError("no cause"), False),
        (OSError(9, "Bad file descriptor"), False),
        (KeyError("bug"), False),
        (RecursionError("bug"), False),
    ],
)
def test_the_command_turns_what_the_environment_caused_into_one_line_and_keeps_bugs_tracebacks(
    rel, capsys, monkeypatch, raised: BaseException, user_caused: bool
) -> None:
    import conveyor.cli as cli

    def command(args):
        raise raised

    monkeypatch.setitem(cli._COMMANDS, "plot", command)
    if user_caused:
        status, err = rel.main_in_process(["plot", "run"], capsys)
        rel.assert_usage_error(status, err, ("No space left on device", "/full/metrics.jsonl", "free space"))
    else:
        with pytest.raises(type(raised)):
            rel.main_in_process(["plot", "run"], capsys)


def test_an_environment_error_behind_a_wrapper_is_found(rel, capsys, monkeypatch) -> None:
    import conveyor.cli as cli
    from conveyor.workers.placement.group import WorkerError

    def command(args):
        # A worker's failure wraps the disk's, as a Rust library's message carries its errno.
        raise WorkerError("actor", 0, "save_checkpoint", RuntimeError("I/O error: Read-only file system (os error 30)"))

    monkeypatch.setitem(cli._COMMANDS, "plot", command)
    status, err = rel.main_in_process(["plot", "run"], capsys)
    rel.assert_usage_error(status, err, ("Read-only file system", "writable folder"))
