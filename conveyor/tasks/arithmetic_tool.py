"""A task that needs a tool: multiplication of two n-digit numbers, with a calculator the model may call.

A prompt is ``"123*456="``; the ground truth is the product. A tiny model
cannot multiply 3-digit numbers in its head, but it can copy the problem into
a call and the answer out of the tool's reply (the ``hash`` call format,
`conveyor.tools.formats`)::

    123*456=#calc 123*456;=56088;56088

(``#calc 123*456;`` is the model's call, ``=56088;`` the tool's answer, ``56088``
the model's final answer). The answer is the text after the last ``;``
(the whole response when there is none), compared exactly with the product.

Operands have as many digits as `max_operand` (``data.synthetic.max_operand``:
999 gives 100..999). Train and test are split by the same fixed hash as the
arithmetic task (`conveyor.tasks.synthetic.arithmetic_split`), so they never
share a problem. For the warm start, a seeded share (`tool_trace_fraction`) of
the training records carry the tool-use trace above as
``extra_info["warmstart_target"]``; the others carry the bare product, which the
model cannot learn to compute, so the warm-started policy calls the tool only
sometimes and reinforcement learning has something to raise.

This module makes records and scores answers; the tools and the loop that
runs them are elsewhere (`conveyor.tools`, `conveyor.rollout.agent_loop`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from conveyor.tasks.rewards import register_reward_fn
from conveyor.tasks.synthetic import SUPPORTED_OPS, arithmetic_split, evaluate

__all__ = [
    "ARITHMETIC_TOOL_DATA_SOURCE",
    "TOOL_NAME",
    "arithmetic_tool_score",
    "extract_final_answer",
    "make_arithmetic_tool_records",
    "tool_trace",
]

ARITHMETIC_TOOL_DATA_SOURCE = "synthetic/arithmetic_tool"
"""The `data_source` of every record; its reward function is registered under this name."""

TOOL_NAME = "calc"
"""The name the model writes in its call (examples/agent_tools.yaml maps it to the calculator)."""

TOOL_TRACE_FRACTION = 0.3
"""Default share of training records whose warm-start target is a tool-use trace."""


def tool_trace(a: int, op: str, b: int) -> str:
    """The response of a model that uses the calculator on `a op b`: call, the tool's answer, the final answer."""
    value = evaluate(a, op, b)
    return f"#{TOOL_NAME} {a}{op}{b};={value};{value}"


def extract_final_answer(solution: str) -> str:
    """The model's final answer: the text after the last ';' (the whole text when there is none), stripped."""
    return solution.rsplit(";", 1)[-1].strip()


@register_reward_fn(ARITHMETIC_TOOL_DATA_SOURCE)
def arithmetic_tool_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 when the final answer (after the last ';') equals the ground truth exactly, else 0.0."""
    return 1.0 if extract_final_answer(solution_str) == str(ground_truth).strip() else 0.0


def make_arithmetic_tool_records(
    n: int,
    *,
    seed: int,
    max_operand: int = 999,
    ops: Sequence[str] = ("*",),
    split: str = "train",
    tool_trace_fraction: float = TOOL_TRACE_FRACTION,
) -> list[dict[str, Any]]:
    """`n` distinct problems `a op b` with operands of as many digits as `max_operand`, from `split`, seeded."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(max_operand, int) or isinstance(max_operand, bool) or max_operand < 1:
        raise ValueError(f"max_operand must be a positive int (999: 3-digit operands), got {max_operand!r}")
    if isinstance(ops, str) or not ops or any(op not in SUPPORTED_OPS for op in ops):
        raise ValueError(f"ops must be a non-empty sequence of {SUPPORTED_OPS}, got {ops!r}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not 0.0 <= tool_trace_fraction <= 1.0:
        raise ValueError(f"tool_trace_fraction must be in [0, 1], got {tool_trace_fraction}")
    low = 10 ** (len(str(max_operand)) - 1) if max_operand >= 10 else 0
    ops = tuple(dict.fromkeys(ops))
    side = max_operand - low + 1
    pool_size = len(ops) * side * side
    if n > pool_size // 4:
        raise ValueError(
            f"n={n} is too many distinct problems for operands {low}..{max_operand} ({pool_size} "
            "in all, a tenth of them held out, at most a quarter drawn); raise "
            "data.synthetic.max_operand (999: 3-digit operands) or lower data.synthetic.num_train"
        )
    rng = random.Random(seed)
    problems: list[tuple[int, str, int]] = []
    seen: set[tuple[int, str, int]] = set()
    while len(problems) < n:
        p = (rng.randint(low, max_operand), ops[rng.randrange(len(ops))], rng.randint(low, max_operand))
        if p[1] == "-" and p[2] > p[0]:
            p = (p[2], "-", p[0])
        if p in seen or arithmetic_split(*p) != split:
            continue
        seen.add(p)
        problems.append(p)
    # A separate stream, so the choice of traces does not move the problems.
    traced = random.Random(seed + 1)
    records = []
    for i, (a, op, b) in enumerate(problems):
        value = str(evaluate(a, op, b))
        extra: dict[str, Any] = {"split": split, "index": i, "a": a, "op": op, "b": b}
        if split == "train":
            extra["warmstart_target"] = tool_trace(a, op, b) if traced.random() < tool_trace_fraction else value
        records.append(
            {
                "data_source": ARITHMETIC_TOOL_DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": value},
                "extra_info": extra,
            }
        )
    return records
