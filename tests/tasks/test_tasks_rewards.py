"""Tests for the reward registry, the built-in reward functions and compute_score's error handling."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import pytest

from conveyor.tasks.rewards import (
    REWARD_FNS,
    RewardFunctionError,
    arithmetic_exact_match,
    arithmetic_partial_credit,
    compute_score,
    extract_gsm8k_answer,
    get_reward_fn,
    gsm8k_score,
    gsm8k_strict,
    normalize_number,
    register_reward_fn,
)


@pytest.fixture(autouse=True)
def _restore_registry() -> Iterator[None]:
    saved = dict(REWARD_FNS)
    yield
    REWARD_FNS.clear()
    REWARD_FNS.update(saved)


@pytest.mark.parametrize(
    "solution, truth, expected",
    [
        ("68", "68", 1.0),
        (" 68\n", "68", 1.0),
        ("68", " 68 ", 1.0),
        ("680", "68", 0.0),
        ("6 8", "68", 0.0),
        ("", "68", 0.0),
        ("68.0", "68", 0.0),
        ("0", "0", 1.0),
    ],
)
def test_arithmetic_exact_match(solution: str, truth: str, expected: float) -> None:
    assert arithmetic_exact_match(solution, truth) == expected
    # The registered scorer agrees with exact match on every exact or non-numeric case.
    assert (compute_score("synthetic/arithmetic", solution, truth) == 1.0) == (expected == 1.0)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,234", "1234"),
        ("$1,234", "1234"),
        ("$1,234.50", "1234.5"),
        ("42.00", "42"),
        ("-7", "-7"),
        ("$-7", "-7"),
        ("-$7", "-7"),
        ("-0", "0"),
        ("40", "40"),
        ("007", "7"),
        ("abc", None),
        ("", None),
    ],
)
def test_normalize_number(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    "text, strict, flexible",
    [
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72", "72"),
        ("#### 1,234", "1234", "1234"),
        ("so the cost is #### $1,000.00", "1000", "1000"),
        ("#### -5", "-5", "-5"),
        ("####42.", "42", "42"),
        ("first #### 3 then #### 4", "4", "4"),
        ("#### 18 dollars, 3 days later", "18", "3"),
        ("The answer is 42.", None, "42"),
        ("I had $1,000 and now -3 left", None, "-3"),
        ("3 apples, 4 pears, 7 in total", None, "7"),
        ("no numbers here", None, None),
        ("#### no number", None, None),
    ],
)
def test_extract_gsm8k_answer(text: str, strict: str | None, flexible: str | None) -> None:
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


def test_extract_rejects_unknown_method() -> None:
    with pytest.raises(ValueError, match="method must be 'strict' or 'flexible'"):
        extract_gsm8k_answer("#### 1", method="loose")


@pytest.mark.parametrize(
    "solution, truth, strict, flexible",
    [
        ("Step 1... #### 72", "72", 1.0, 1.0),
        ("The answer is 72", "72", 0.0, 1.0),
        ("#### 72", "73", 0.0, 0.0),
        ("#### 1,234", "1234", 1.0, 1.0),
        ("#### 1234", "1,234", 1.0, 1.0),
        ("#### $5", "5", 1.0, 1.0),
        ("#### -7", "-7", 1.0, 1.0),
        ("#### 7", "-7", 0.0, 0.0),
        ("#### -7", "7", 0.0, 0.0),
        ("#### 3.50", "3.5", 1.0, 1.0),
        ("#### 72", "She earns 12*6 = 72.\n#### 72", 1.0, 1.0),
        ("", "72", 0.0, 0.0),
    ],
)
def test_gsm8k_score(solution: str, truth: str, strict: float, flexible: float) -> None:
    assert gsm8k_score(solution, truth, method="strict") == strict
    assert gsm8k_score(solution, truth, method="flexible") == flexible
    assert compute_score("openai/gsm8k", solution, truth) == strict
    assert compute_score("gsm8k", solution, truth) == strict


def test_gsm8k_format_score_and_bad_ground_truth() -> None:
    assert gsm8k_score("#### 5", "6", format_score=0.1) == 0.1
    assert gsm8k_score("no answer", "6", format_score=0.1) == 0.0
    with pytest.raises(ValueError, match="ground_truth 'seventy' is not a number"):
        gsm8k_score("#### 70", "seventy")


def test_lookup_exact_and_by_prefix() -> None:
    assert get_reward_fn("synthetic/arithmetic") is arithmetic_partial_credit
    assert get_reward_fn("openai/gsm8k") is gsm8k_strict
    assert get_reward_fn("gsm8k") is gsm8k_strict
    assert get_reward_fn("synthetic/arithmetic/hard") is arithmetic_partial_credit
    assert get_reward_fn("openai/gsm8k/test/v2") is gsm8k_strict
    assert get_reward_fn("gsm8k/socratic") is gsm8k_strict


def test_longest_prefix_wins() -> None:
    @register_reward_fn("lab")
    def lab(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return 0.25

    @register_reward_fn("lab/math")
    def lab_math(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return 0.75

    assert get_reward_fn("lab/math/algebra") is lab_math
    assert get_reward_fn("lab/code") is lab
    assert compute_score("lab/math/algebra", "x", "y") == 0.75


@pytest.mark.parametrize("name", ["foo/bar", "synthetic", "openai", "arithmetic", "synthetic/arith"])
def test_unknown_data_source_lists_registered(name: str) -> None:
    with pytest.raises(ValueError) as info:
        get_reward_fn(name)
    msg = str(info.value)
    assert repr(name) in msg
    for registered in ("synthetic/arithmetic", "openai/gsm8k", "gsm8k"):
        assert repr(registered) in msg
    with pytest.raises(ValueError, match="no reward function"):
        compute_score(name, "1", "1")


def test_non_string_data_source() -> None:
    with pytest.raises(ValueError, match="data_source must be a string, got None"):
        get_reward_fn(None)  # type: ignore[arg-type]


def test_register_rules() -> None:
    def a(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return 1.0

    def b(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return 0.0

    assert register_reward_fn("mine", "mine/alias")(a) is a
    assert REWARD_FNS["mine"] is a and REWARD_FNS["mine/alias"] is a
    register_reward_fn("mine")(a)  # registering the same function again is harmless
    with pytest.raises(
        ValueError, match=r"reward function for data_source 'mine' is already registered .*\.a\).*overwrite=True"
    ):
        register_reward_fn("mine")(b)
    assert REWARD_FNS["mine"] is a
    register_reward_fn("mine", overwrite=True)(b)
    assert REWARD_FNS["mine"] is b
    with pytest.raises(ValueError, match="at least one"):
        register_reward_fn()
    with pytest.raises(ValueError, match="non-empty strings"):
        register_reward_fn("")
    with pytest.raises(ValueError, match="expects a callable"):
        register_reward_fn("x")(42)


def test_flexible_gsm8k_can_be_registered_over_strict() -> None:
    register_reward_fn("openai/gsm8k", overwrite=True)(functools.partial(gsm8k_score, method="flexible"))
    assert compute_score("openai/gsm8k", "The answer is 72", "72") == 1.0
    assert compute_score("gsm8k", "The answer is 72", "72") == 0.0


def test_extra_info_is_passed_through() -> None:
    seen = []

    @register_reward_fn("echo")
    def echo(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
        seen.append(extra_info)
        return float(extra_info["weight"])

    assert compute_score("echo", "s", "g", {"weight": 0.5}) == 0.5
    assert seen == [{"weight": 0.5}]


def test_raising_fn_becomes_reward_function_error() -> None:
    @register_reward_fn("boom/task")
    def boom(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
        raise KeyError("missing_field")

    solution = "A" * 150 + "B" * 500
    with pytest.raises(RewardFunctionError) as info:
        compute_score("boom/task/v1", solution, "1")
    err = info.value
    msg = str(err)
    assert isinstance(err, RuntimeError)
    assert "'boom/task/v1'" in msg
    assert "<locals>.boom" in msg and "KeyError" in msg and "missing_field" in msg
    assert "A" * 150 + "B" * 50 in msg
    assert "B" * 51 not in msg
    assert isinstance(err.__cause__, KeyError)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None, "1.0", [1.0], {"score": 1.0}])
def test_non_finite_or_non_number_result_is_an_error(bad: object) -> None:
    @register_reward_fn("weird")
    def weird(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> object:
        return bad

    with pytest.raises(RewardFunctionError) as info:
        compute_score("weird", "my solution", "1")
    msg = str(info.value)
    assert "'weird'" in msg and "not a finite number" in msg and repr(bad) in msg
    assert "'my solution'" in msg


@pytest.mark.parametrize("good, expected", [(1, 1.0), (0.5, 0.5), (np.float32(0.25), 0.25), (np.int64(-1), -1.0)])
def test_numeric_results_become_float(good: object, expected: float) -> None:
    register_reward_fn("num", overwrite=True)(lambda s, g, e=None: good)
    out = compute_score("num", "x", "y")
    assert type(out) is float and out == expected


@pytest.mark.parametrize(
    "solution, truth, expected",
    [
        ("165", "165", 1.0),
        (" 165 ", "165", 1.0),
        ("160", "165", 0.5 * 2 / 3),  # hundreds and tens right
        ("65", "165", 0.5 * 2 / 3),  # right-aligned: 6 and 5 match, the missing digit does not
        ("1650", "165", 0.0),  # shifted by one: no aligned digit matches
        ("999", "165", 0.0),
        ("abc", "165", 0.0),
        ("", "7", 0.0),
        ("8", "7", 0.0),
    ],
)
def test_arithmetic_partial_credit(solution: str, truth: str, expected: float) -> None:
    score = arithmetic_partial_credit(solution, truth)
    assert score == pytest.approx(expected)
    # Any wrong answer scores below half of a right one, so accuracy (score >= 1) stays exact match.
    assert (score >= 1.0) == (arithmetic_exact_match(solution, truth) == 1.0)
    assert score < 0.5 or score == 1.0


def test_a_score_beyond_a_float_and_a_sys_exit_are_reward_function_errors() -> None:
    import sys

    register_reward_fn("huge", overwrite=True)(lambda s, g, e=None: 10**5000)
    with pytest.raises(RewardFunctionError, match=r"returned an int of 5001 digits, too large for a float"):
        compute_score("huge", "x", "y")
    register_reward_fn("exits", overwrite=True)(lambda s, g, e=None: sys.exit(3))
    with pytest.raises(RewardFunctionError, match=r"called sys\.exit\(3\); a reward function must return a score"):
        compute_score("exits", "x", "y")
