"""Generation dumps: written, read back exactly, rendered readably, and errors that say how to turn them on."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conveyor.metrics.dumps import dump_due, dump_path, format_generations, latest_generations, write_generations


def _rows():
    return [
        {
            "prompt": [
                {"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": "What is 2+3?"},
            ],
            "response": "5",
            "ground_truth": "5",
            "data_source": "arith",
            "reward": 1.0,
            "advantage": torch.tensor(0.5),  # 0-d tensors become numbers
            "uid": "u0",
            "token_ids": np.array([7, 8]),
        },
        {
            "prompt": "1+1=",
            "response": "3",
            "ground_truth": "2",
            "data_source": "arith",
            "reward": 0.0,
            "advantage": float("nan"),
        },
        {
            "prompt": "2*2=",
            "response": "4",
            "ground_truth": None,
            "data_source": None,
            "reward": 0.5,
            "advantage": -0.25,
        },
    ]


def test_round_trip_and_latest(tmp_path):
    p3 = write_generations(tmp_path, 3, _rows())
    p12 = write_generations(tmp_path, 12, _rows()[:1])
    assert p3 == tmp_path / "generations" / "step_000003.jsonl" == dump_path(tmp_path, 3)
    assert p12.name == "step_000012.jsonl"
    assert not list((tmp_path / "generations").glob("*.tmp"))

    # Every line is strict JSON with the required keys first and the extras kept.
    lines = p3.read_text().splitlines()
    first = json.loads(lines[0], parse_constant=lambda c: pytest.fail(c))
    assert list(first)[:6] == ["prompt", "response", "ground_truth", "data_source", "reward", "advantage"]
    assert first["advantage"] == 0.5 and first["uid"] == "u0" and first["token_ids"] == [7, 8]

    step, rows = latest_generations(tmp_path)
    assert step == 12 and len(rows) == 1
    step, rows = latest_generations(tmp_path, step=3)
    assert step == 3 and len(rows) == 3
    assert rows[1]["advantage"] == "nan"
    assert rows[0]["prompt"][1] == {"role": "user", "content": "What is 2+3?"}
    assert rows[2]["ground_truth"] is None


def test_rewriting_a_step_replaces_it(tmp_path):
    write_generations(tmp_path, 5, _rows())
    write_generations(tmp_path, 5, _rows()[2:])
    assert len(latest_generations(tmp_path, 5)[1]) == 1


def test_errors_say_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        latest_generations(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"no generation dumps in .*trainer\.dump_freq"):
        latest_generations(tmp_path)
    write_generations(tmp_path, 10, _rows())
    write_generations(tmp_path, 20, _rows())
    with pytest.raises(ValueError, match="no generation dump for step 18 .*nearest is step 20"):
        latest_generations(tmp_path, step=18)
    with pytest.raises(ValueError, match=r"rows\[1\] lacks ground_truth, reward"):
        write_generations(
            tmp_path, 1, [_rows()[0], {"prompt": "p", "response": "r", "data_source": "d", "advantage": 0}]
        )
    with pytest.raises(ValueError, match="rows is empty"):
        write_generations(tmp_path, 1, [])
    with pytest.raises(ValueError, match="step must be"):
        write_generations(tmp_path, -1, _rows())


def test_format_is_readable_and_truncates(tmp_path):
    rows = _rows()
    rows[1]["response"] = "\n".join(f"line {i}" for i in range(30))
    rows[2]["prompt"] = "\n".join(f"context {i}" for i in range(20)) + "\nQuestion: 2*2="
    write_generations(tmp_path, 7, rows)
    step, back = latest_generations(tmp_path)
    text = format_generations(step, back, width=60, max_lines=6)
    lines = text.splitlines()
    # Rewards 1.0, 0.0, 0.5: mean 0.5.
    assert lines[0] == "step 7: 3 samples, reward mean 0.500 (min 0.000, max 1.000)"
    assert "[1/3] reward 1.000  advantage +0.500  source arith" in lines
    assert "[2/3] reward 0.000  advantage nan  source arith" in lines
    assert "[3/3] reward 0.500  advantage -0.250" in lines
    assert "    user: What is 2+3?" in lines
    assert "  ground truth: 5" in lines
    assert '  extra: uid="u0", token_ids=[7, 8]' in lines
    # A long response keeps both ends: 2 head lines, a note, 3 tail lines (6 in all).
    i = lines.index("  response:", lines.index("[2/3] reward 0.000  advantage nan  source arith"))
    assert lines[i + 1 : i + 7] == [
        "    line 0",
        "    line 1",
        "    ... [25 more lines] ...",
        "    line 27",
        "    line 28",
        "    line 29",
    ]
    # A long prompt keeps its end, where the question is.
    j = lines.index("[3/3] reward 0.500  advantage -0.250")
    assert lines[j + 1 : j + 8] == [
        "  prompt:",
        "    ... [16 more lines] ...",
        "    context 16",
        "    context 17",
        "    context 18",
        "    context 19",
        "    Question: 2*2=",
    ]
    assert all(len(ln) <= 60 for ln in lines)

    limited = format_generations(step, back, width=60, max_samples=1)
    assert "[2/3]" not in limited and limited.rstrip().endswith("... 2 more samples not shown")
    with pytest.raises(ValueError, match="width"):
        format_generations(step, back, width=10)


@pytest.mark.parametrize("content", [b"", b"\n\n", b"   \n"])
def test_an_empty_dump_is_named_not_shown_as_empty(tmp_path, content):
    write_generations(tmp_path, 4, _rows())
    dump_path(tmp_path, 8).write_bytes(content)  # truncated to nothing after it was renamed into place
    with pytest.raises(ValueError, match=r"step_000008\.jsonl holds no samples .*truncated"):
        latest_generations(tmp_path)
    assert len(latest_generations(tmp_path, step=4)[1]) == 3


def test_a_truncated_last_line_is_named_with_its_line(tmp_path):
    path = write_generations(tmp_path, 2, _rows())
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ValueError, match=r"step_000002\.jsonl, line 3 is not valid JSON"):
        latest_generations(tmp_path)


def test_dump_due_every_freq_steps_and_at_the_last():
    assert [s for s in range(1, 61) if dump_due(s, 100, last=s == 60)] == [60]
    assert [s for s in range(1, 8) if dump_due(s, 3, last=s == 7)] == [3, 6, 7]
    assert not any(dump_due(s, 0, last=s == 5) for s in range(1, 6))


def test_no_dumps_says_why_from_the_runs_config(tmp_path):
    (tmp_path / "config.yaml").write_text("trainer:\n  dump_freq: 100\n  total_training_steps: 60\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    with pytest.raises(ValueError) as err:
        latest_generations(tmp_path)
    message = str(err.value)
    assert "trainer.dump_freq=100 dumps every 100 steps and at the last step" in message
    assert "metrics end at step 2" in message and "N > 0" not in message
    (tmp_path / "config.yaml").write_text("trainer:\n  dump_freq: 0\n")
    with pytest.raises(ValueError, match=r"config\.yaml has trainer\.dump_freq=0; set trainer\.dump_freq=N \(N > 0\)"):
        latest_generations(tmp_path)
