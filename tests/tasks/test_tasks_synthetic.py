"""Tests for the synthetic arithmetic task: determinism, correct answers, disjoint splits."""

from __future__ import annotations

import re

import pytest

from conveyor.tasks.synthetic import (
    ARITHMETIC_ALPHABET,
    ARITHMETIC_DATA_SOURCE,
    TEST_FRACTION,
    arithmetic_split,
    make_arithmetic_records,
)

_EXPR = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def _triple(rec: dict) -> tuple[int, str, int]:
    m = _EXPR.match(rec["prompt"][0]["content"])
    assert m is not None, rec["prompt"]
    return int(m.group(1)), m.group(2), int(m.group(3))


def _full_split(split: str, max_operand: int, ops: tuple[str, ...]) -> list[dict]:
    """Every problem of a split, found by asking for more than exist and reading the count off the error."""
    with pytest.raises(ValueError, match=r"holds \((\d+) with") as info:
        make_arithmetic_records(10**9, seed=0, max_operand=max_operand, ops=ops, split=split)
    size = int(re.search(r"holds \((\d+) with", str(info.value)).group(1))
    return make_arithmetic_records(size, seed=0, max_operand=max_operand, ops=ops, split=split)


def test_record_format_and_hand_computed_answer() -> None:
    records = _full_split("train", 45, ("+",)) + _full_split("test", 45, ("+",))
    by_content = {r["prompt"][0]["content"]: r for r in records}
    rec = by_content["23+45="]
    assert rec["reward_model"] == {"style": "rule", "ground_truth": "68"}
    assert rec["data_source"] == ARITHMETIC_DATA_SOURCE == "synthetic/arithmetic"
    assert rec["prompt"] == [{"role": "user", "content": "23+45="}]
    assert rec["ability"] == "arithmetic"
    assert rec["extra_info"]["a"] == 23 and rec["extra_info"]["b"] == 45
    assert by_content["0+0="]["reward_model"]["ground_truth"] == "0"
    assert by_content["45+45="]["reward_model"]["ground_truth"] == "90"


def test_same_seed_same_records_other_seed_differs() -> None:
    a = make_arithmetic_records(50, seed=7)
    b = make_arithmetic_records(50, seed=7)
    c = make_arithmetic_records(50, seed=8)
    assert a == b
    assert [r["prompt"] for r in a] != [r["prompt"] for r in c]


@pytest.mark.parametrize("ops", [("+",), ("-",), ("*",), ("+", "-", "*")])
def test_answers_are_correct_and_bounded(ops: tuple[str, ...]) -> None:
    max_operand = 30
    records = make_arithmetic_records(300, seed=1, max_operand=max_operand, ops=ops)
    assert len(records) == 300
    expected_fn = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for rec in records:
        a, op, b = _triple(rec)
        assert op in ops
        assert 0 <= a <= max_operand and 0 <= b <= max_operand
        answer = expected_fn[op](a, b)
        assert answer >= 0
        assert rec["reward_model"]["ground_truth"] == str(answer)
        assert set(rec["prompt"][0]["content"] + rec["reward_model"]["ground_truth"]) <= set(ARITHMETIC_ALPHABET)


def test_default_is_addition_up_to_99() -> None:
    records = make_arithmetic_records(500, seed=3)
    triples = [_triple(r) for r in records]
    assert {op for _, op, _ in triples} == {"+"}
    assert max(max(a, b) for a, _, b in triples) <= 99
    # With 500 draws from 0..99 the largest operand is near the bound, so the bound is really used.
    assert max(max(a, b) for a, _, b in triples) >= 95


def test_records_within_a_call_are_distinct() -> None:
    records = make_arithmetic_records(2000, seed=0, max_operand=60, ops=("+", "-"))
    assert len({_triple(r) for r in records}) == 2000


def test_splits_partition_all_problems() -> None:
    ops = ("+", "-", "*")
    max_operand = 20
    train = {_triple(r) for r in _full_split("train", max_operand, ops)}
    test = {_triple(r) for r in _full_split("test", max_operand, ops)}
    everything = {
        (a, op, b) for op in ops for a in range(max_operand + 1) for b in range(max_operand + 1) if op != "-" or a >= b
    }
    assert train.isdisjoint(test)
    assert train | test == everything
    # The hash split should give roughly TEST_FRACTION of the problems to test.
    assert abs(len(test) / len(everything) - TEST_FRACTION) < 0.03


def test_train_and_test_disjoint_across_seeds_and_settings() -> None:
    train = set()
    for seed in range(3):
        for ops in [("+",), ("+", "*")]:
            train |= {_triple(r) for r in make_arithmetic_records(800, seed=seed, ops=ops, split="train")}
    test = set()
    for seed in range(3, 6):
        test |= {_triple(r) for r in make_arithmetic_records(400, seed=seed, ops=("+", "*"), split="test")}
    assert train and test
    assert train.isdisjoint(test)
    assert all(arithmetic_split(*t) == "train" for t in train)
    assert all(arithmetic_split(*t) == "test" for t in test)


def test_large_operands_use_the_same_split_rule() -> None:
    # 1001**2 problems is past the enumeration limit, so this takes the rejection-sampling path.
    train = make_arithmetic_records(1500, seed=0, max_operand=1000, split="train")
    test = make_arithmetic_records(1500, seed=0, max_operand=1000, split="test")
    assert train == make_arithmetic_records(1500, seed=0, max_operand=1000, split="train")
    train_t = {_triple(r) for r in train}
    test_t = {_triple(r) for r in test}
    assert len(train_t) == len(test_t) == 1500
    assert train_t.isdisjoint(test_t)
    assert all(arithmetic_split(*t) == "test" for t in test_t)
    assert max(max(a, b) for a, _, b in train_t) > 900
    for rec in test:
        a, _, b = _triple(rec)
        assert rec["reward_model"]["ground_truth"] == str(a + b)


def test_split_is_recorded_in_extra_info() -> None:
    recs = make_arithmetic_records(5, seed=0, split="test")
    assert [r["extra_info"]["split"] for r in recs] == ["test"] * 5
    assert [r["extra_info"]["index"] for r in recs] == list(range(5))


def test_zero_records() -> None:
    assert make_arithmetic_records(0, seed=0) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": -1}, "n must be"),
        ({"max_operand": -2}, "max_operand"),
        ({"ops": ("/",)}, r"unsupported operator.*'/'"),
        ({"ops": ()}, "at least one"),
        ({"ops": "+-"}, "the string"),
        ({"split": "validation"}, "split must be one of"),
        ({"n": 50, "max_operand": 3}, r"n=50 asks for more distinct problems than the train split"),
        ({"n": 10**6, "max_operand": 1000}, r"more than half"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, match: str) -> None:
    args = {"n": 5, "seed": 0, **kwargs}
    n = args.pop("n")
    with pytest.raises(ValueError, match=match):
        make_arithmetic_records(n, **args)


def test_alphabet_is_digits_ops_and_equals() -> None:
    assert set(ARITHMETIC_ALPHABET) == set("0123456789+-*=")
    assert len(ARITHMETIC_ALPHABET) == len(set(ARITHMETIC_ALPHABET))
