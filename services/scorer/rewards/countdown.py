"""Countdown (TinyZero): the last `<answer>` equation must use each given number exactly once
and equal the target within 1e-5.

TinyZero `eval`s the equation after a character filter that lets `**` through, so `2**99**99`
hangs the trainer. Here the equation is parsed with `ast` and walked with exact rational
arithmetic; only integer literals, + - * /, unary +/- and parentheses are allowed, the text is
length-bounded, and anything else is a format failure — every input returns a score at once.
Differences from TinyZero, on purpose: a newline after the answer does not zero the score (we
take the last `<answer>` anywhere in the response, not only on its last line), and "1.5" is one
(non-integer) literal, not the numbers 1 and 5.
"""

from __future__ import annotations

import ast
from fractions import Fraction

from services.scorer.rewards.text import last_answer

MAX_EQUATION_CHARS = 500
MAX_LITERAL_DIGITS = 12
MAX_DEPTH = 64


class EquationError(ValueError):
    """The equation is not a plain arithmetic expression over integer literals."""


def parse_ground_truth(ground_truth: object) -> tuple[float, list[int]]:
    if not isinstance(ground_truth, dict) or "target" not in ground_truth or (
        "numbers" not in ground_truth and "nums" not in ground_truth
    ):
        raise ValueError("countdown ground truth must be {'target': t, 'numbers': [...]}")
    numbers = ground_truth.get("numbers", ground_truth.get("nums"))
    numbers = numbers.tolist() if hasattr(numbers, "tolist") else list(numbers)
    return float(ground_truth["target"]), [int(n) for n in numbers]


def evaluate_equation(equation: str) -> tuple[Fraction, list[int]]:
    """Exact value of the equation and the integer literals it uses (in order)."""
    if len(equation) > MAX_EQUATION_CHARS:
        raise EquationError(f"equation longer than {MAX_EQUATION_CHARS} characters")
    try:
        tree = ast.parse(equation.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise EquationError(f"not an expression: {exc}") from None
    literals: list[int] = []
    value = _walk(tree.body, literals, 0)
    return value, literals


def _walk(node: ast.AST, literals: list[int], depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise EquationError("expression nested too deeply")
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:
            raise EquationError(f"only integer literals are allowed, got {node.value!r}")
        if node.value < 0 or len(str(node.value)) > MAX_LITERAL_DIGITS:
            raise EquationError("literal out of range")
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        operand = _walk(node.operand, literals, depth + 1)
        return operand if isinstance(node.op, ast.UAdd) else -operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
        left = _walk(node.left, literals, depth + 1)
        right = _walk(node.right, literals, depth + 1)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise EquationError("division by zero")
        return left / right
    raise EquationError(f"{type(node).__name__} is not allowed")


def countdown(solution_str: str, ground_truth: object, format_score: float = 0.1,
              score: float = 1.0) -> float:
    """TinyZero's `compute_score`: 0 without an answer, `format_score` for a wrong or invalid
    equation, `score` for a correct one."""
    target, numbers = parse_ground_truth(ground_truth)
    equation = last_answer(solution_str)
    if equation is None:
        return 0.0
    try:
        value, literals = evaluate_equation(equation)
    except EquationError:
        return format_score
    if sorted(literals) != sorted(numbers):
        return format_score
    return score if abs(float(value) - target) < 1e-5 else format_score
