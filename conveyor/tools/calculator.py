"""A calculator tool: evaluates one arithmetic expression, safely (no Python `eval`).

`calculate("123*456")` returns ``"56088"``. Numbers, ``+ - * / // %``,
``**`` with a small exponent, unary signs and parentheses are allowed;
anything else (names, calls, attributes) is refused with a ValueError, which
the agent loop shows the model as an error answer.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

__all__ = ["calculate"]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Bounds that keep one call cheap whatever the model writes.
_MAX_CHARS = 200
_MAX_EXPONENT = 64


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponents must be integers up to {_MAX_EXPONENT}")
            return left ** int(right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return Fraction(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of the arithmetic `expression` as text: an integer when exact, else a decimal."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("give an expression such as 12*34")
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"the expression is longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"cannot read {expression.strip()!r} as arithmetic") from err
    value = _eval(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6g}"
