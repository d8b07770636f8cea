"""Sample generations saved with a run, and their rendering for `conveyor show RUN_DIR`.

Every `trainer.dump_freq` steps, and at the run's last step (`dump_due`), the
trainer writes the step's samples to
`run_dir/generations/step_{step:06d}.jsonl`, one JSON object per sample with
at least `prompt`, `response`, `ground_truth`, `data_source`, `reward` and
`advantage` (values may be null), plus any extra keys it gives (a multi-turn
sample has `turns`: its model and tool turns in order, which `conveyor show`
prints each marked `[model]` or `[tool]`). Files are
written whole and renamed into place, so a reader never sees half a dump.

`format_generations` shows model output as text, never as terminal commands:
control characters (ESC, BEL, backspace, carriage return, ...) and the
Unicode controls that reorder or break lines are shown as visible escapes
(`\x1b`, `\r`, `\u202e`), so a response cannot clear, recolour or rewrite
the user's terminal.

This module does not choose which samples to dump or how many (the trainer
does), and it keeps no index: the files are the record.
"""

from __future__ import annotations

import json
import math
import os
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from conveyor.metrics.trackers import read_metrics_jsonl, to_json_value

__all__ = [
    "REQUIRED_KEYS",
    "write_generations",
    "latest_generations",
    "format_generations",
    "dump_due",
    "dump_path",
    "visible",
    "response_turns",
]

REQUIRED_KEYS = ("prompt", "response", "ground_truth", "data_source", "reward", "advantage")

_DUMP_NAME = re.compile(r"^step_(\d+)\.jsonl$")
# What a terminal would act on rather than show: C0 controls but newline and tab,
# DEL and C1 controls, Unicode line/paragraph separators, and bidirectional
# overrides and isolates (which make text read in a different order than stored), and lone surrogates
# (half a UTF-16 pair, which a JSON file may hold escaped and no terminal can be sent).
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_HOW_TO_ENABLE = "set trainer.dump_freq=N (N > 0) to write generation dumps every N steps"


def dump_due(step: int, freq: int, *, last: bool = False) -> bool:
    """Whether the trainer dumps `step`'s generations: every `freq` steps (`trainer.dump_freq`, 0 = off), and at the
    `last` step of the run."""
    # The last step too: a run shorter than dump_freq (60 steps, dump_freq 100) would otherwise leave nothing to show.
    return freq > 0 and (step % freq == 0 or last)


def dump_path(run_dir: str | Path, step: int) -> Path:
    """Where the dump of `step` lives: run_dir/generations/step_{step:06d}.jsonl."""
    return Path(run_dir) / "generations" / f"step_{step:06d}.jsonl"


def write_generations(run_dir: str | Path, step: int, rows: Sequence[dict[str, Any]]) -> Path:
    """Write one step's samples (each a dict with `REQUIRED_KEYS` and any extras) and return the file path."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if not rows:
        raise ValueError(f"rows is empty: nothing to dump for step {step}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"rows[{i}] must be a dict, got {type(row).__name__}")
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise ValueError(
                f"rows[{i}] lacks {', '.join(missing)}; every row needs {', '.join(REQUIRED_KEYS)} (None allowed)"
            )
    path = dump_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for row in rows:
                ordered = {k: row[k] for k in REQUIRED_KEYS}
                ordered.update({k: v for k, v in row.items() if k not in ordered})
                f.write(json.dumps(to_json_value(ordered), ensure_ascii=False, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep half a dump filling it further
        raise
    os.replace(tmp, path)
    return path


def response_turns(tokenizer: Any, response_ids: Any, response_mask: Any) -> tuple[str, list[dict[str, str]] | None]:
    """(text through the last model token, its turns) of one response row; turns is None without tool tokens.

    Each turn is `{"role": "model" | "tool", "text": ...}`: a run of model tokens (mask 1) or of tool
    tokens (mask 0) of a multi-turn trajectory.
    """
    from conveyor.algos.trajectory import segments

    ids = response_ids.tolist() if hasattr(response_ids, "tolist") else list(response_ids)
    runs = segments(response_mask)
    end = runs[-1][2] if runs else 0
    text = tokenizer.decode(ids[:end], skip_special_tokens=True)
    if all(is_model for is_model, _, _ in runs):
        return text, None
    turns = [
        {"role": "model" if is_model else "tool", "text": tokenizer.decode(ids[a:b], skip_special_tokens=True)}
        for is_model, a, b in runs
    ]
    return text, turns


def _turn_lines(turns: Any, body: int, max_lines: int) -> list[str] | None:
    """The lines of a multi-turn response, each turn marked [model] or [tool]; None when `turns` is not a list of
    turns."""
    if not isinstance(turns, list) or not all(isinstance(t, dict) and "text" in t for t in turns):
        return None
    lines = []
    for t in turns:
        role = "tool" if t.get("role") == "tool" else "model"
        wrapped = _wrap(visible(_as_text(t.get("text"))), body - 8, max_lines, keep="both")
        lines.append(f"    {'[' + role + ']':<8}" + (wrapped[0] if wrapped else ""))
        lines.extend(" " * 12 + ln for ln in wrapped[1:])
    return lines


def _available_steps(gen_dir: Path) -> list[int]:
    steps = []
    for p in gen_dir.iterdir():
        m = _DUMP_NAME.match(p.name)
        if m and p.is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_generations(run_dir: str | Path, step: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """(step, rows) of the dump at `step`, or of the latest dump when `step` is None."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(
            f"run directory {run_dir} " + ("is a file, not a run directory" if run_dir.exists() else "does not exist")
        )
    gen_dir = run_dir / "generations"
    steps = _available_steps(gen_dir) if gen_dir.is_dir() else []
    if not steps:
        raise ValueError(f"no generation dumps in {gen_dir}; {_why_no_dumps(run_dir)}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        nearest = min(steps, key=lambda s: (abs(s - step), s))
        raise ValueError(
            f"no generation dump for step {step} in {gen_dir}; nearest is step {nearest} (have {len(steps)} dumps)"
        )
    rows = []
    path = dump_path(run_dir, step)
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as err:
                raise ValueError(
                    f"generation dump {path}, line {number} is not valid JSON ({err}); "
                    "it was not written by conveyor, or was edited"
                ) from err
            if not isinstance(row, dict):
                raise ValueError(
                    f"generation dump {path}, line {number} is a JSON {type(row).__name__}, not an "
                    "object (one sample per line); it was not written by conveyor, or was edited"
                )
            rows.append(row)
    if not rows:
        # conveyor never writes an empty dump: this one was cut short (a full disk, a copy that stopped) or emptied.
        raise ValueError(
            f"generation dump {path} holds no samples ({path.stat().st_size} bytes): it was truncated or emptied; "
            "show another step with --step"
        )
    return step, rows


def _why_no_dumps(run_dir: Path) -> str:
    """Why a run has no generation dumps, from its config.yaml and metrics.jsonl; how to turn them on when off."""
    try:
        trainer = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))["trainer"]
        freq = int(trainer["dump_freq"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return _HOW_TO_ENABLE  # no readable config.yaml (not a run directory of conveyor's): the general advice
    if freq <= 0:
        return f"the run's config.yaml has trainer.dump_freq={freq}; {_HOW_TO_ENABLE}"
    reached = _last_logged_step(run_dir / "metrics.jsonl")
    return (
        f"the run's trainer.dump_freq={freq} dumps every {freq} steps and at the last step"
        + ("" if reached is None else f"; its metrics end at step {reached}")
        + f": no step has reached a multiple of {freq} and the run has not reached its last step (it stopped early, "
        "or is still running)"
    )


def _last_logged_step(path: Path) -> int | None:
    """The last step in a metrics.jsonl, or None when it has none (or cannot be read)."""
    try:
        records = read_metrics_jsonl(path)
    except (OSError, ValueError):
        return None
    return records[-1]["step"] if records and records[-1]["step"] > 0 else None  # sorted; step 0 is validation


def visible(text: str) -> str:
    """`text` with every character a terminal would act on (ESC, BEL, CR, bidi overrides, ...) as a visible escape."""
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def _as_text(value: Any) -> str:
    """Text of a prompt or response: chat messages as 'role: content' lines, other values as-is."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return "\n".join(f"{m.get('role', '?')}: {m['content']}" for m in value)
    return json.dumps(value, ensure_ascii=False)


def _finite(value: Any) -> float | None:
    """`value` as a finite float when it is a number that has one (not a bool, NaN, inf or an int beyond a double)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _fmt_score(value: Any, signed: bool = False) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = _finite(value)
        if number is None:
            return str(value) if isinstance(value, float) else "(too large)"
        return f"{number:+.3f}" if signed else f"{number:.3f}"
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return value
    return "-" if value is None else str(value)


def _wrap(text: str, width: int, max_lines: int, keep: str) -> list[str]:
    """Wrap `text` to `width` and keep at most `max_lines`: the "head", the "tail", or both ends."""
    lines: list[str] = []
    for para in text.splitlines() or [""]:
        lines.extend(textwrap.wrap(para, width=width) or [""])
    if len(lines) <= max_lines:
        return lines
    cut = len(lines) - (max_lines - 1)
    note = f"... [{cut} more lines] ..."
    if keep == "head":
        return lines[: max_lines - 1] + [note]
    if keep == "tail":
        return [note] + lines[-(max_lines - 1) :]
    head = (max_lines - 1) // 2
    return lines[:head] + [note] + lines[-(max_lines - 1 - head) :]


def format_generations(
    step: int,
    rows: Sequence[dict[str, Any]],
    width: int = 100,
    max_samples: int | None = None,
    max_lines: int = 8,
) -> str:
    """A readable rendering of one dump: a summary, then per sample its scores, prompt (tail), response and ground
    truth."""
    if width < 40:
        raise ValueError(f"width must be at least 40 columns, got {width}")
    if max_lines < 3:
        raise ValueError(f"max_lines must be at least 3, got {max_lines}")
    rewards = [r.get("reward") for r in rows]
    numeric = [x for x in map(_finite, rewards) if x is not None]
    summary = f"step {step}: {len(rows)} samples"
    if numeric:
        summary += f", reward mean {sum(numeric) / len(numeric):.3f} (min {min(numeric):.3f}, max {max(numeric):.3f})"
    out = [summary, "=" * min(width, max(len(summary), 40))]
    shown = rows if max_samples is None else rows[:max_samples]
    body = width - 4
    for i, row in enumerate(shown, start=1):
        reward, advantage = _fmt_score(row.get("reward")), _fmt_score(row.get("advantage"), signed=True)
        head = f"[{i}/{len(rows)}] reward {reward}  advantage {advantage}"
        if row.get("data_source") is not None:
            head += f"  source {visible(str(row['data_source']))}"
        out.append(head[:width])
        # A long chat prompt ends with the question, so keep its tail; a response is read from the start.
        out.append("  prompt:")
        # Escaped before wrapping: wrapping would turn a carriage return into a space, unseen.
        out.extend("    " + ln for ln in _wrap(visible(_as_text(row.get("prompt"))), body, max_lines, keep="tail"))
        turn_lines = _turn_lines(row.get("turns"), body, max_lines)
        if turn_lines is not None:
            calls = sum(1 for t in row["turns"] if t.get("role") == "tool")
            out.append(f"  response ({len(row['turns'])} turns, {calls} tool):")
            out.extend(turn_lines)
        else:
            out.append("  response:")
            out.extend(
                "    " + ln for ln in _wrap(visible(_as_text(row.get("response"))), body, max_lines, keep="both")
            )
        if row.get("ground_truth") is not None:
            truth = visible(_as_text(row["ground_truth"])).replace("\n", " ")
            out.append("  " + textwrap.shorten(f"ground truth: {truth}", width=width - 2, placeholder=" ..."))
        extras = {k: v for k, v in row.items() if k not in REQUIRED_KEYS and not (k == "turns" and turn_lines)}
        if extras:
            text = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in extras.items())
            out.append("  " + textwrap.shorten(f"extra: {text}", width=width - 2, placeholder=" ..."))
        out.append("")
    if len(shown) < len(rows):
        out.append(f"... {len(rows) - len(shown)} more samples not shown")
    # Everything else from the file (data source, ground truth, extras, scores) is escaped here.
    return visible("\n".join(out).rstrip()) + "\n"
