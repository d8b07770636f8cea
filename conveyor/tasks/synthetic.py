"""A seeded, verifiable arithmetic task: the prompt source of the default run.

Each record asks for the value of one binary expression such as ``"23+45="``
and carries the decimal answer (``"68"``) as its ground truth, so the reward
is an exact string match and a tiny model can visibly learn it on a CPU.

Train and test never share a problem. Which split a problem belongs to is a
fixed function of the problem itself, not of the seed or of any other
argument: the triple ``(a, op, b)`` is hashed with BLAKE2b and the problem is
a test problem when the hash, read as a fraction of 2**64, is below
``TEST_FRACTION``. So a test set drawn with any seed, operand bound or set of
operators is disjoint from every train set.

This module makes records only; it does not tokenize, score or batch them
(``rewards`` scores them, ``dataset`` batches them).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence

__all__ = [
    "evaluate",
    "ARITHMETIC_ALPHABET",
    "ARITHMETIC_DATA_SOURCE",
    "SUPPORTED_OPS",
    "TEST_FRACTION",
    "split_of",
    "arithmetic_split",
    "make_arithmetic_records",
]

ARITHMETIC_DATA_SOURCE = "synthetic/arithmetic"
"""The `data_source` of every arithmetic record; its reward function is registered under this name."""

SUPPORTED_OPS: tuple[str, ...] = ("+", "-", "*")
"""Operators the generator knows; subtraction only yields non-negative results."""

ARITHMETIC_ALPHABET = "0123456789+-*="
"""Every character that can appear in an arithmetic prompt or answer (for building a char tokenizer)."""

TEST_FRACTION = 0.1
"""Share of all problems that belong to the test split (fixed so splits never move)."""

_SPLITS = ("train", "test")
# Enumerating the whole split and sampling from it is exact (no duplicates, a
# clear error when too many are asked for) but costs one hash per problem;
# past this many problems rejection sampling is used instead.
_ENUMERATE_LIMIT = 200_000


def split_of(problem: str, test_fraction: float = TEST_FRACTION) -> str:
    """The split ("train" or "test") a problem belongs to, fixed by hashing its text (`problem`): about
    `test_fraction` of all problems are "test"."""
    digest = hashlib.blake2b(problem.encode(), digest_size=8).digest()
    fraction = int.from_bytes(digest, "big") / 2**64
    return "test" if fraction < test_fraction else "train"


def arithmetic_split(a: int, op: str, b: int) -> str:
    """The split ("train" or "test") problem `a op b` belongs to, fixed by hashing the triple."""
    return split_of(f"{a}{op}{b}")


def evaluate(a: int, op: str, b: int) -> int:
    """`a op b` for one of SUPPORTED_OPS (the ground truth of a synthetic problem)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    assert op == "*", op
    return a * b


def _count_problems(max_operand: int, op: str) -> int:
    side = max_operand + 1
    # Subtraction keeps a >= b so the answer is never negative.
    return side * (side + 1) // 2 if op == "-" else side * side


def _all_problems(max_operand: int, ops: Sequence[str]) -> Iterator[tuple[int, str, int]]:
    for op in ops:
        for a in range(max_operand + 1):
            for b in range(a + 1 if op == "-" else max_operand + 1):
                yield a, op, b


def _draw_problem(rng: random.Random, max_operand: int, ops: Sequence[str]) -> tuple[int, str, int]:
    op = ops[rng.randrange(len(ops))]
    a = rng.randint(0, max_operand)
    b = rng.randint(0, max_operand)
    if op == "-" and b > a:
        a, b = b, a
    return a, op, b


def _make_record(a: int, op: str, b: int, split: str, index: int) -> dict:
    return {
        "data_source": ARITHMETIC_DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(evaluate(a, op, b))},
        "extra_info": {"split": split, "index": index, "a": a, "op": op, "b": b},
    }


def make_arithmetic_records(
    n: int,
    *,
    seed: int,
    max_operand: int = 99,
    ops: Sequence[str] = ("+",),
    split: str = "train",
) -> list[dict]:
    """`n` distinct problems `a op b` with 0 <= a, b <= `max_operand`, from `split`, in a seeded random order.

    The same arguments always give the same records. Operators are drawn
    uniformly from `ops`; subtraction orders its operands so the answer is
    non-negative. Raises `ValueError` when the split holds fewer than `n`
    distinct problems.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if not isinstance(max_operand, int) or isinstance(max_operand, bool) or max_operand < 0:
        raise ValueError(f"max_operand must be a non-negative int, got {max_operand!r}")
    if isinstance(ops, str):
        # A bare string would be iterated character by character, which silently
        # works for "+" but not for "+-"; ask for a sequence instead.
        raise ValueError(f"ops must be a sequence of operators such as ('+', '-'), got the string {ops!r}")
    ops = tuple(dict.fromkeys(ops))
    if not ops:
        raise ValueError(f"ops must name at least one of {SUPPORTED_OPS}, got an empty sequence")
    unknown = [op for op in ops if op not in SUPPORTED_OPS]
    if unknown:
        raise ValueError(f"ops holds unsupported operator(s) {unknown}; supported: {SUPPORTED_OPS}")
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")

    rng = random.Random(seed)
    total = sum(_count_problems(max_operand, op) for op in ops)
    if total <= _ENUMERATE_LIMIT:
        pool = [p for p in _all_problems(max_operand, ops) if arithmetic_split(*p) == split]
        if n > len(pool):
            raise ValueError(
                f"n={n} asks for more distinct problems than the {split} split holds "
                f"({len(pool)} with max_operand={max_operand}, ops={ops}); "
                "raise max_operand, add ops, or cycle epochs with PromptDataset"
            )
        problems = rng.sample(pool, n)
    else:
        # The pool is large, so rejection sampling finds new problems quickly;
        # the attempt cap only guards against a pathological request.
        expected_pool = total * (TEST_FRACTION if split == "test" else 1 - TEST_FRACTION)
        if n > 0.5 * expected_pool:
            raise ValueError(
                f"n={n} is more than half of the about {int(expected_pool)} problems in the {split} split "
                f"(max_operand={max_operand}, ops={ops}); raise max_operand or add ops"
            )
        problems, seen = [], set()
        attempts, max_attempts = 0, 100 * n + 1000
        while len(problems) < n:
            attempts += 1
            assert attempts <= max_attempts, "rejection sampling failed to find enough problems"
            p = _draw_problem(rng, max_operand, ops)
            if p in seen or arithmetic_split(*p) != split:
                continue
            seen.add(p)
            problems.append(p)
    return [_make_record(a, op, b, split, i) for i, (a, op, b) in enumerate(problems)]
