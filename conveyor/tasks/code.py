"""A seeded code task scored by running the response: write the body of `f(x)` from two examples.

Each record hides a function ``f(x) = x op c`` (``op`` drawn from
`data.synthetic.ops`, ``0 <= c <= data.synthetic.max_operand``), shows two of
its values and the start of the program, and asks for the rest::

    f(3)=48 f(7)=52
    def f(x): return            <- the prompt ends here
    x+45                        <- a right response (the program is prompt's last line + response)

The ground truth is a JSON test specification: the program's first line and
four assertions (the two shown values and two hidden ones). The reward
(`code_tests_score`, registered for ``synthetic/code``) runs the program and
the assertions in the sandbox (`conveyor.tasks.sandbox`) and returns the share
of assertions that hold: a constant that matches one shown value earns 0.25,
the rule earns 1.0, a program that fails to compile, loops, or attacks the
machine earns 0. Accuracy is the share of responses that pass every test.

Which split a problem belongs to is fixed by hashing ``(op, c, x1, x2)``, as the
arithmetic task does, so train and test never share a problem.

This module makes records and scores them; the sandbox's mechanics live in
`sandbox.py`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any

from conveyor.tasks.rewards import register_reward_fn
from conveyor.tasks.sandbox import Sandbox, runs_code

__all__ = [
    "CODE_DATA_SOURCE",
    "CODE_OPS",
    "code_program",
    "code_split",
    "code_tests_score",
    "make_code_records",
    "parse_test_report",
]

CODE_DATA_SOURCE = "synthetic/code"
"""The `data_source` of every code record; its reward runs the program in the sandbox."""

CODE_OPS: tuple[str, ...] = ("+", "-", "*")
"""Operators of the hidden rule ``x op c``."""

_TEST_FRACTION = 0.1
_HEADER = "def f(x): return "
# The harness's report line starts with this; anything the program prints before it is ignored.
_REPORT = "@@conveyor-tests"
_HARNESS = """import sys
_tests = {tests!r}
_ns = {{"__name__": "solution"}}
_passed = 0
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), _ns)
except BaseException:
    sys.stdout.write("\\n{report} 0 {total}\\n")
    raise  # its traceback on stderr says how it failed (MemoryError: the memory limit)
for _t in _tests:
    try:
        _passed += eval(_t, _ns) is True
    except BaseException:
        pass
sys.stdout.write("\\n{report} %d %d\\n" % (_passed, {total}))
"""


def _rule(op: str, c: int, x: int) -> int:
    return x + c if op == "+" else x - c if op == "-" else x * c


def code_split(op: str, c: int, x1: int, x2: int) -> str:
    """The split ("train" or "test") a problem belongs to, fixed by hashing it."""
    digest = hashlib.blake2b(f"code{op}{c}:{x1}:{x2}".encode(), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") / 2**64 < _TEST_FRACTION else "train"


def _make_record(op: str, c: int, xs: list[int], split: str, index: int) -> dict:
    shown, hidden = xs[:2], xs[2:]
    prompt = " ".join(f"f({x})={_rule(op, c, x)}" for x in shown) + "\n" + _HEADER
    tests = [f"f({x}) == {_rule(op, c, x)}" for x in shown + hidden]
    return {
        "data_source": CODE_DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "code",
        "reward_model": {"style": "rule", "ground_truth": json.dumps({"header": _HEADER, "tests": tests})},
        "extra_info": {"split": split, "index": index, "op": op, "c": c, "warmstart_target": f"x{op}{c}"},
    }


def make_code_records(
    n: int, *, seed: int, max_operand: int = 99, ops: Sequence[str] = ("+",), split: str = "train"
) -> list[dict]:
    """`n` distinct code problems from `split` in a seeded order (the signature of every synthetic task's maker)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(ops, str) or not ops or any(op not in CODE_OPS for op in ops):
        raise ValueError(f"ops must be a non-empty sequence of {CODE_OPS}, got {ops!r}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    ops = tuple(dict.fromkeys(ops))
    # Two shown inputs from 1..19 (distinct, ordered: 171 pairs per rule) and two hidden ones from 20..99.
    capacity = len(ops) * (max_operand + 1) * 171 * (1 - _TEST_FRACTION if split == "train" else _TEST_FRACTION)
    if n > 0.5 * capacity:
        raise ValueError(
            f"n={n} is more than half of the about {int(capacity)} code problems in the {split} split "
            f"(max_operand={max_operand}, ops={ops}); raise data.synthetic.max_operand or add ops"
        )
    rng = random.Random(seed)
    seen: set[tuple] = set()
    records: list[dict] = []
    while len(records) < n:
        op, c = ops[rng.randrange(len(ops))], rng.randint(0, max_operand)
        x1, x2 = sorted(rng.sample(range(1, 20), 2))
        if (op, c, x1, x2) in seen or code_split(op, c, x1, x2) != split:
            continue
        seen.add((op, c, x1, x2))
        records.append(_make_record(op, c, [x1, x2, *rng.sample(range(20, 100), 2)], split, len(records)))
    return records


def code_program(solution_str: str, ground_truth: str) -> dict[str, str]:
    """The files the sandbox runs for one response: ``solution.py`` (header + response) and the test harness."""
    spec = json.loads(ground_truth)
    tests = list(spec["tests"])
    harness = _HARNESS.format(tests=tests, total=len(tests), report=_REPORT)
    return {"solution.py": spec.get("header", "") + solution_str, "main.py": harness}


def parse_test_report(stdout: str) -> tuple[int, int] | None:
    """(passed, total) from the harness's last report line, or None when the program never got there."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(_REPORT + " "):
            parts = line.split()
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                return int(parts[1]), int(parts[2])
            return None
    return None


@register_reward_fn(CODE_DATA_SOURCE)
@runs_code
def code_tests_score(
    solution_str: str, ground_truth: str, extra_info: dict | None = None, *, sandbox: Sandbox | Any = None
) -> float:
    """The share of the ground truth's tests that the program passes in `sandbox` (0 for anything but a clean run)."""
    if sandbox is None:
        raise ValueError("code_tests_score runs the program: call it with sandbox=conveyor.tasks.sandbox.Sandbox()")
    files = code_program(solution_str, ground_truth)
    total = len(json.loads(ground_truth)["tests"])
    result = sandbox.run(files)
    report = parse_test_report(result.stdout) if result.ok else None
    if report is None or report[1] != total or total == 0:
        return 0.0
    return min(report[0], total) / total
