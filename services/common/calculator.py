"""Safe arithmetic for the `calculator` tool (docs/rollout.md, "Tool calls").

The expression comes from the policy, i.e. from sampled text: it is parsed with `ast` and only
number literals, `+ - * / // % **`, unary `+`/`-` and parentheses are evaluated. Nothing is
ever passed to `eval`, no name is looked up and no call is made. Exponents and the size of
every intermediate result are bounded so that a sampled `9**9**9` cannot stall a rollout
replica (the worst case is a few big-int multiplications of at most `MAX_INT_BITS` bits).
Every refusal is a `CalculatorError` whose text is written for the model to read.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 512
MAX_EXPONENT = 1000
MAX_INT_BITS = 4096
MAX_DEPTH = 200

Number = int | float

_BINARY: dict[type[ast.operator], tuple[str, Callable[[Number, Number], Number]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; str() is the model's message."""


def evaluate(expression: str) -> Number:
    """Value of an arithmetic expression, or CalculatorError saying what is not allowed."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    text = expression.strip()
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(
            f"the expression is longer than {MAX_EXPRESSION_CHARS} characters ({len(text)})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not a valid arithmetic expression ({exc.msg})") from None
    except (ValueError, MemoryError, RecursionError):  # NUL bytes, absurd nesting
        raise CalculatorError("not a valid arithmetic expression") from None
    return _eval(tree.body, 0)


def format_result(value: Number) -> str:
    """The observation text of a result: ints exactly, floats in Python's shortest repr."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _eval(node: ast.AST, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"the expression is nested more than {MAX_DEPTH} levels deep")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {type(value).__name__} {value!r}")
        return _checked(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        symbol, function = _BINARY[type(node.op)]
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if symbol in ("/", "//", "%") and right == 0:
            raise CalculatorError("division by zero")
        if symbol == "**":
            _check_power(left, right)
        try:
            result = function(left, right)
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        if isinstance(result, complex):
            raise CalculatorError("the result is not a real number")
        return _checked(result)
    raise CalculatorError(
        f"'{_describe(node)}' is not allowed: use numbers, + - * / // % **, and parentheses")


def _check_power(base: Number, exponent: Number) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponents are limited to {MAX_EXPONENT} in absolute value")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and base not in (0, 1, -1):
        if base.bit_length() * exponent > MAX_INT_BITS:
            raise CalculatorError("the result is too large")


def _checked(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError("the result is too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def _describe(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # noqa: BLE001 - only used to word the refusal
        text = type(node).__name__
    return text if len(text) <= 40 else text[:37] + "..."
