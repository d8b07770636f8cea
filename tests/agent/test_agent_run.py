"""Multi-turn with tools around the loop: call formats, the tool interface and its YAML, the config keys, the
arithmetic_tool task, dumps and `conveyor show`, and a short training run with tools, R3 and load-balance metrics."""

from __future__ import annotations

import json

import pytest
import torch

from conveyor.algos.trajectory import response_span, segments, span_lengths
from conveyor.cli import main as cli_main
from conveyor.config import ConfigError, load_config
from conveyor.metrics.dumps import format_generations, response_turns
from conveyor.metrics.trackers import read_metrics_jsonl
from conveyor.models.tokenizer import build_char_tokenizer
from conveyor.tasks import SYNTHETIC_TASKS, get_reward_fn
from conveyor.tasks.arithmetic_tool import (
    ARITHMETIC_TOOL_DATA_SOURCE,
    arithmetic_tool_score,
    make_arithmetic_tool_records,
    tool_trace,
)
from conveyor.tools import (
    CallFormat,
    ToolCall,
    ToolCallError,
    calculate,
    get_format,
    load_tools,
    make_tool,
    register_call_format,
    release_all,
    run_call,
)
from conveyor.trainer.run import run_training

# For the run below: an untrained model calls the calculator whenever a turn ends at a digit (frequent), so
# trajectories hold tool turns without a warm start.
register_call_format(
    CallFormat(
        "test_digit_calls",
        stop_texts=tuple("0123456789"),
        parser=lambda turn: ToolCall("calc", text=turn) if turn[-1:].isdigit() else None,
    ),
    overwrite=True,
)


def test_hash_and_hermes_formats_parse_calls() -> None:
    h = get_format("hash")
    assert h.stop_texts == (";",)
    assert h.parse("#calc 123*456;") == ToolCall("calc", text="123*456")
    assert h.parse("123") is None and h.parse("no call;") is None
    with pytest.raises(ToolCallError, match="malformed call"):
        h.parse("#Calc 1;")
    assert h.response_content("5") == "=5;"
    hermes = get_format("hermes")
    call = hermes.parse('ok <tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>')
    assert call == ToolCall("calc", arguments={"expression": "2+3"})
    assert hermes.parse("no call") is None
    with pytest.raises(ToolCallError, match="not valid JSON"):
        hermes.parse("<tool_call>{oops</tool_call>")
    with pytest.raises(ValueError, match="multi_turn.format: unknown 'xml'; valid names are hash, hermes"):
        get_format("xml")


def test_calculator_is_exact_and_refuses_code() -> None:
    assert calculate("123*456") == "56088"
    assert calculate(" (2+3)**2 ") == "25"
    assert calculate("7/2") == "3.5"
    for bad in ("__import__('os')", "1/0", "2**1000", ""):
        with pytest.raises(ValueError):
            calculate(bad)


class Counter:
    """A stateful tool: counts the calls of each trajectory."""

    def __init__(self, start: int = 0) -> None:
        self.start, self.state, self.log = start, {}, []

    def create(self, instance_id):
        self.state[instance_id] = self.start
        self.log.append(("create", instance_id))

    def execute(self, instance_id, call):
        self.state[instance_id] += 1
        return str(self.state[instance_id]), 0.5

    def release(self, instance_id):
        self.log.append(("release", instance_id))
        del self.state[instance_id]


def test_tool_yaml_functions_and_stateful_classes(tmp_path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n  - name: calc\n    path: conveyor.tools.calculator:calculate\n"
        f"  - name: count\n    path: {__name__}.Counter\n    config: {{start: 10}}\n"
    )
    tools = load_tools(path)
    created: set[str] = set()
    assert run_call(tools, ToolCall("calc", text="6*7"), "t1", created).text == "42"
    first = run_call(tools, ToolCall("count", text=""), "t1", created)
    second = run_call(tools, ToolCall("count", text=""), "t1", created)
    assert (first.text, first.reward, second.text) == ("11", 0.5, "12")
    bad = run_call(tools, ToolCall("calc", text="x+1"), "t1", created)
    assert bad.error and bad.text.startswith("error: ValueError")
    unknown = run_call(tools, ToolCall("nope", text=""), "t1", created)
    assert unknown.error == "unknown tool 'nope'; tools: calc, count"
    assert release_all(tools, "t1", created) == []
    assert tools["count"].log == [("create", "t1"), ("release", "t1")]
    for text, match in [
        ("tools: []\n", "non-empty list"),
        ("tools:\n  - name: a\n", "give `name`"),
        (
            "tools:\n  - name: a\n    path: no.such.module:f\n",
            "tools\\[0\\]: importing module 'no.such.module' failed: ModuleNotFoundError",
        ),
        (
            "tools:\n  - name: a\n    path: conveyor.tools.calculator:calculate\n    config: {x: 1}\n",
            "for tool classes",
        ),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_tools(path)
    with pytest.raises(ValueError, match="no file at"):
        load_tools(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="not a tool"):
        make_tool(object())


def test_multi_turn_config_keys() -> None:
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.tool_config_path=t.yaml",
            "actor_rollout_ref.rollout.multi_turn.format=hash",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
            "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=64",
            "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left",
        ],
    )
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert (mt.enable, mt.format, mt.max_assistant_turns, mt.max_user_turns) == (True, "hash", 3, 2)
    with pytest.raises(ConfigError, match="tool_config_path"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.enable=true"])
    with pytest.raises(ConfigError, match="multi_turn.format: unknown 'hashh' \\(did you mean 'hash'\\?\\)"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.format=hashh"])
    with pytest.raises(ConfigError, match="max_user_turns"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.max_user_turns=0"])


def test_arithmetic_tool_task() -> None:
    train = make_arithmetic_tool_records(200, seed=1)
    test = make_arithmetic_tool_records(50, seed=2, split="test")
    key = lambda r: r["prompt"][0]["content"]  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert SYNTHETIC_TASKS["arithmetic_tool"] is make_arithmetic_tool_records
    for r in train:
        e = r["extra_info"]
        assert (
            100 <= e["a"] <= 999 and 100 <= e["b"] <= 999 and r["reward_model"]["ground_truth"] == str(e["a"] * e["b"])
        )
    traces = [r for r in train if r["extra_info"]["warmstart_target"].startswith("#calc ")]
    assert 0.15 < len(traces) / len(train) < 0.45
    assert tool_trace(123, "*", 456) == "#calc 123*456;=56088;56088"
    assert get_reward_fn(ARITHMETIC_TOOL_DATA_SOURCE) is arithmetic_tool_score
    assert arithmetic_tool_score("#calc 123*456;=56088;56088", "56088") == 1.0
    assert arithmetic_tool_score("56088", "56088") == 1.0
    assert arithmetic_tool_score("#calc 123*456;=56088;", "56088") == 0.0  # read the tool, never answered


def test_span_helpers_and_turn_rendering() -> None:
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert response_span(mask).int().tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0] * 6]
    assert span_lengths(mask).tolist() == [5, 3, 0]
    assert segments(mask[0]) == [(True, 0, 2), (False, 2, 4), (True, 4, 5)]
    tok = build_char_tokenizer()
    ids = tok("#calc 2*3;=6;6", add_special_tokens=False)["input_ids"]
    row_mask = [True] * 10 + [False] * 3 + [True]
    text, turns = response_turns(tok, torch.tensor(ids + [0, 0]), torch.tensor(row_mask + [False, False]))
    assert text == "#calc 2*3;=6;6"
    assert turns == [
        {"role": "model", "text": "#calc 2*3;"},
        {"role": "tool", "text": "=6;"},
        {"role": "model", "text": "6"},
    ]
    assert response_turns(tok, torch.tensor(ids[:3]), torch.ones(3, dtype=torch.bool)) == ("#ca", None)
    row = {
        "prompt": "2*3=",
        "response": text,
        "ground_truth": "6",
        "data_source": "d",
        "reward": 1.0,
        "advantage": 0.5,
        "turns": turns + [{"role": "tool", "text": "\x1b[2J"}],
    }
    shown = format_generations(3, [row])
    assert "response (4 turns, 2 tool):" in shown and "[model] #calc 2*3;" in shown and "[tool]  =6;" in shown
    assert "\x1b" not in shown and "\\x1b[2J" in shown and "turns=" not in shown


def test_training_with_tools_r3_and_load_balance_metrics(tiny_run, tmp_path, capsys) -> None:
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - name: calc\n    path: conveyor.tools.calculator:calculate\n")
    mt = "actor_rollout_ref.rollout.multi_turn"
    run_training(
        load_config(
            None,
            tiny_run
            + [
                "data.synthetic.task=arithmetic_tool",
                "data.synthetic.ops=['*']",
                "data.synthetic.max_operand=99",
                "data.max_response_length=24",
                f"{mt}.enable=true",
                f"{mt}.format=test_digit_calls",
                f"{mt}.tool_config_path={tools}",
                f"{mt}.max_user_turns=3",
                "actor_rollout_ref.actor.router_replay.mode=R3",
                "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=1",
                "trainer.dump_freq=1",
                "trainer.dump_num=8",
                "trainer.test_freq=2",
            ],
        )
    )
    rows = {r["step"]: r for r in read_metrics_jsonl(tmp_path / "metrics.jsonl")}
    last = rows[2]
    assert last["rollout/multi_turn/tool_calls"] > 0
    assert 0 < last["rollout/multi_turn/model_token_frac"] < 1
    assert "rollout/multi_turn/tool_error_rate" in last and "rollout/multi_turn/tool_latency_s" in last
    assert last["rollout/moe/routed_experts_found"] == 1.0 and "rollout/moe/max_vio/max" in last
    assert "val/accuracy" in last
    dumped = [json.loads(line) for line in (tmp_path / "generations" / "step_000002.jsonl").read_text().splitlines()]
    assert any(r.get("turns") for r in dumped)
    assert cli_main(["show", str(tmp_path)]) == 0
    assert "[tool] " in capsys.readouterr().out


def test_tool_turns_are_rendered_by_the_chat_template() -> None:
    from conveyor.rollout.agent_loop import tool_turn_ids

    tok = build_char_tokenizer()
    # Like Qwen's: a default system text before the first message, a wrapper around tool messages, a
    # generation prompt after; the default system text is dropped from the tool turn, as verl does.
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}sys.{% endif %}{% for m in messages %}"
        "{% if m['role'] == 'tool' %}(t {{ m['content'] }}){% else %}{{ m['content'] }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
    )
    assert tok.decode(tool_turn_ids(tok, "42")) == "(t 42)a:"
    tok.chat_template = None
    assert tok.decode(tool_turn_ids(tok, "42")) == "42"


def test_reward_reads_the_span_and_adds_tool_rewards() -> None:
    from conveyor.data_plane import make_data_plane
    from conveyor.workers.ranks.reward import RewardWorker

    tok = build_char_tokenizer()
    dp = make_data_plane("memory")
    try:
        ids = tok("#calc 2*3;=6;6", add_special_tokens=False)["input_ids"] + [tok.eos_token_id, 0, 0]
        mask = [True] * 10 + [False] * 3 + [True, True, False, False]
        responses = torch.tensor([ids, ids])
        rmask = torch.tensor([mask, [True] * 10 + [False] * 7])  # the second never answered after the tool
        meta = dp.kv_batch_put(
            keys=["a", "b"],
            partition_id="p",
            fields={
                "responses": responses,
                "response_mask": rmask,
                "data_source": [ARITHMETIC_TOOL_DATA_SOURCE] * 2,
                "ground_truth": ["6", "6"],
                "tool_rewards": torch.tensor([0.25, 0.0]),
            },
        )
        RewardWorker(tokenizer=tok, data_plane=dp).compute_reward(meta)
        td = dp.kv_batch_get(keys=["a", "b"], partition_id="p", select_fields=["rm_scores", "acc"])
        assert td["acc"].tolist() == [1.0, 0.0]
        assert td["rm_scores"][0, 14] == 1.25 and td["rm_scores"][0].sum() == 1.25  # on the last model token
        assert td["rm_scores"][1, 9] == 0.0 and td["rm_scores"][1].sum() == 0.0
    finally:
        dp.close()
