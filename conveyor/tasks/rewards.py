"""Rule-based reward functions, chosen by a sample's `data_source`.

A reward function has the signature
``fn(solution_str, ground_truth, extra_info=None) -> float`` and is added to
``REWARD_FNS`` with the ``register_reward_fn(*data_sources)`` decorator.

Lookup rule (``get_reward_fn``): an exact match on the data source wins;
otherwise the data source is cut back at each "/" from the right and the
longest registered prefix wins, so ``"synthetic/arithmetic/hard"`` uses the
``"synthetic/arithmetic"`` function and ``"openai/gsm8k/test"`` the
``"openai/gsm8k"`` one. Aliases are explicit registrations: the GSM8K scorer
is registered both as ``"openai/gsm8k"`` (verl's name) and ``"gsm8k"``.

Built in:
- ``synthetic/arithmetic``: 1.0 for an exact match (after stripping
  whitespace), else partial credit below 0.5 for digits in the right places
  (``arithmetic_partial_credit``); accuracy is always exact match (score 1.0).
  ``arithmetic_exact_match`` is the strict 0/1 variant.
- ``openai/gsm8k`` and ``gsm8k``: the number after the last ``"####"``
  (strict). For the flexible variant, which takes the last number in the
  text, register ``functools.partial(gsm8k_score, method="flexible")`` with
  ``overwrite=True``.

This module scores strings; it does not decode tokens or place the score on
a token (the reward worker does that).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from conveyor.registry import registrar
from conveyor.user_code import describe_error

__all__ = [
    "REWARD_FNS",
    "RewardFn",
    "RewardFunctionError",
    "arithmetic_exact_match",
    "arithmetic_partial_credit",
    "compute_score",
    "describe_failure",
    "describe_result",
    "extract_gsm8k_answer",
    "finite_score",
    "get_reward_fn",
    "ground_truth_check",
    "ground_truth_problem",
    "gsm8k_score",
    "gsm8k_strict",
    "normalize_number",
    "register_reward_fn",
    "reward_fn_name",
]

RewardFn = Callable[..., float]
"""`fn(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float`."""

REWARD_FNS: dict[str, RewardFn] = {}
"""The registry: data source (or prefix, see the module docstring) -> reward function."""

# How much of a solution to quote in an error message: enough to recognise it,
# short enough to keep logs readable.
_SOLUTION_PREVIEW_CHARS = 200


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something that is not a finite number."""


def register_reward_fn(*data_sources: str, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under each of `data_sources`.

    Registering a name that already maps to a different function is a
    `ValueError` unless `overwrite=True`.
    """
    if not data_sources:
        raise ValueError("register_reward_fn needs at least one data_source name")
    for ds in data_sources:
        if not isinstance(ds, str) or not ds:
            raise ValueError(f"data_source names must be non-empty strings, got {ds!r}")

    registers = [
        registrar(REWARD_FNS, ds, "reward function for data_source", overwrite=overwrite) for ds in data_sources
    ]

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise ValueError(f"register_reward_fn expects a callable, got {type(fn).__name__}")
        for register in registers:
            register(fn)
        return fn

    return decorator


def get_reward_fn(data_source: str) -> RewardFn:
    """The reward function for `data_source`: exact match, else the longest registered "/"-prefix."""
    if not isinstance(data_source, str):
        raise ValueError(f"data_source must be a string, got {data_source!r} ({type(data_source).__name__})")
    fn = REWARD_FNS.get(data_source)
    if fn is not None:
        return fn
    prefix = data_source
    while "/" in prefix:
        prefix = prefix.rsplit("/", 1)[0]
        fn = REWARD_FNS.get(prefix)
        if fn is not None:
            return fn
    raise ValueError(
        f"no reward function for data_source {data_source!r}; registered: {sorted(REWARD_FNS)}. "
        "Register one with conveyor.tasks.register_reward_fn"
    )


def ground_truth_check(check: Callable[[Any], str | None]) -> Callable[[RewardFn], RewardFn]:
    """Decorator giving a reward function `check(ground_truth) -> problem or None`, run on every row at load.

    A row whose ground truth its reward can never match (a GSM8K answer that is not a number) would
    otherwise earn 0 for every response, or fail the step it is drawn in, hours into a run.
    """

    def decorator(fn: RewardFn) -> RewardFn:
        fn.check_ground_truth = check  # type: ignore[attr-defined]
        return fn

    return decorator


def ground_truth_problem(data_source: Any, ground_truth: Any) -> str | None:
    """Why the registered reward of `data_source` can never reward `ground_truth`, or None (also when none is known)."""
    try:
        fn = get_reward_fn(data_source)
    except ValueError:
        return None  # an unknown data source is reported, with the registered ones, when it is scored
    check = getattr(fn, "check_ground_truth", None)
    return check(ground_truth) if check is not None else None


def _gsm8k_truth_problem(ground_truth: Any) -> str | None:
    """GSM8K's ground truth is a number, or a solution ending in "#### number"."""
    gt = str(ground_truth)
    expected = extract_gsm8k_answer(gt, "strict") if "####" in gt else normalize_number(gt)
    if expected is None:
        return (
            f"reward_model.ground_truth {ground_truth!r} is not a number (nor a solution ending in "
            "'#### <number>'), so the GSM8K reward can never match it; fix or drop the row"
        )
    return None


def reward_fn_name(fn: Callable) -> str:
    """How messages name a reward function: its qualified name (its repr when it has none)."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def describe_result(result: Any) -> str:
    """What a reward function returned, short enough for an error message: its repr and type (a huge int by size)."""
    if isinstance(result, int) and not isinstance(result, bool) and result.bit_length() > 1024:
        # Its repr may run to megabytes, or fail beyond Python's int-to-str limit.
        return f"an int of {int(math.log10(abs(result))) + 1} digits, too large for a float"
    try:
        text = repr(result)
    except Exception:  # a user's type whose __repr__ fails: its type still says enough
        return f"a {type(result).__name__}"
    return f"{text if len(text) <= 200 else text[:197] + '...'} ({type(result).__name__})"


def describe_failure(err: BaseException) -> str:
    """How a reward function failed, for an error message: what it raised, or that it called sys.exit."""
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r}); a reward function must return a score, not end the program"
    return f"raised {describe_error(err)}"


def finite_score(result: Any, label: str, context: str = "") -> float:
    """`result` as a finite float; else a RewardFunctionError saying `label` returned it, then `context`."""
    value: float | None = None
    if not isinstance(result, (str, bytes)):
        try:
            value = float(result)
        # OverflowError: an int beyond a double; anything else: a user's type whose __float__ fails.
        except Exception:
            value = None
    if value is None or not math.isfinite(value):
        raise RewardFunctionError(f"{label} returned {describe_result(result)}, not a finite number{context}")
    return value


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *, sandbox: Any = None
) -> float:
    """Score one solution with the reward function for `data_source`, as a finite float.

    A function marked `runs_code` (`conveyor.tasks.sandbox`) is given
    `sandbox` to run the solution in. Raises `ValueError` for an unknown data
    source and `RewardFunctionError` when the function raises (or calls
    sys.exit) or returns something other than a finite number.
    """
    fn = get_reward_fn(data_source)
    preview = solution_str[:_SOLUTION_PREVIEW_CHARS] if isinstance(solution_str, str) else solution_str
    label = f"reward function {reward_fn_name(fn)} for data_source {data_source!r}"
    try:
        if getattr(fn, "runs_code", False):
            result = fn(solution_str, ground_truth, extra_info, sandbox=sandbox)
        else:
            result = fn(solution_str, ground_truth, extra_info)
    except (Exception, SystemExit) as e:  # sys.exit in a reward function must not end the run quietly
        raise RewardFunctionError(f"{label} {describe_failure(e)}; solution starts with {preview!r}") from e
    return finite_score(result, label, f"; solution starts with {preview!r}")


def arithmetic_exact_match(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 when the solution equals the ground truth after stripping surrounding whitespace, else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


@register_reward_fn("synthetic/arithmetic")
def arithmetic_partial_credit(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 for an exact answer; else 0.5 x the fraction of digits right when both are right-aligned (0 if not a number).

    A 0/1 reward gives a group of samples no signal until one of them is exactly
    right; crediting correct digits gives every group a gradient, while any
    wrong answer stays below half of a right one.
    """
    sol, truth = solution_str.strip(), str(ground_truth).strip()
    if sol == truth:
        return 1.0
    if not sol.isdigit() or not truth.isdigit():
        return 0.0
    width = max(len(sol), len(truth))
    matches = sum(a == b for a, b in zip(reversed(sol), reversed(truth)))
    return 0.5 * matches / width


# A number as written in GSM8K text: optional sign and "$", digits with
# optional thousands commas, an optional decimal part. It must end on a digit
# so that a sentence-ending comma or full stop is not taken in.
_NUMBER = r"-?\$?-?\d(?:[\d,]*\d)?(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"####\s*(" + _NUMBER + r")")


def normalize_number(text: str) -> str | None:
    """Canonical decimal string of a number written like "$1,234.50" or "-7" ("1234.5", "-7"); None if not one."""
    cleaned = re.sub(r"[\s,$]", "", text).rstrip(".")
    negative = cleaned.count("-") % 2 == 1
    cleaned = cleaned.replace("-", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if negative:
        value = -value
    # normalize() drops trailing zeros ("42.00" -> "42"); format with "f" to
    # avoid exponent notation ("4E+1") and fold "-0" into "0".
    value = value.normalize()
    if value == 0:
        return "0"
    return format(value, "f")


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """The final numeric answer in `text`, normalised, or None.

    strict: the number after the last "####" marker (GSM8K's answer format);
    flexible: the last number anywhere in the text.
    """
    if method == "strict":
        matches = _STRICT_RE.findall(text)
    elif method == "flexible":
        matches = _NUMBER_RE.findall(text)
    else:
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    if not matches:
        return None
    return normalize_number(matches[-1])


def gsm8k_score(
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals the ground truth, `format_score` if it differs, 0.0 if none is found.

    The ground truth may be a bare number ("1,234") or a full GSM8K solution
    ending in "#### 1234".
    """
    answer = extract_gsm8k_answer(solution_str, method=method)
    if answer is None:
        return 0.0
    gt = str(ground_truth)
    expected = extract_gsm8k_answer(gt, "strict") if "####" in gt else normalize_number(gt)
    if expected is None:
        raise ValueError(f"ground_truth {ground_truth!r} is not a number")
    return score if answer == expected else format_score


@register_reward_fn("openai/gsm8k", "gsm8k")
@ground_truth_check(_gsm8k_truth_problem)
def gsm8k_strict(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """GSM8K reward in strict mode: 1.0 when the number after the last "####" equals the ground truth."""
    return gsm8k_score(solution_str, ground_truth, extra_info, method="strict")
