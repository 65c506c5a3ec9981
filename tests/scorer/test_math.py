"""math_verify rewards in the main thread: equivalences, timeouts raised, threads refused."""

from __future__ import annotations

import threading

import pytest

from services.scorer.rewards.math import RewardTimeout, gold_latex, math_verify_reward


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        ("so $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("so $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("The answer is \\boxed{41}.", "42", 0.0),
        ("first \\boxed{7} then finally \\boxed{42}", "42", 1.0),
        ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("no answer at all", "42", 0.0),
        ("\\boxed{42}", 42, 1.0),
        ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
    ],
)
def test_math_verify_table(response, gold, expected):
    assert math_verify_reward(response, gold) == expected


def test_gold_latex():
    assert gold_latex("42") == "\\boxed{42}"
    assert gold_latex("$x$") == "$x$"
    assert gold_latex({"target": ["7"]}) == "\\boxed{7}"
    with pytest.raises(ValueError):
        gold_latex(None)


def test_pathological_input_raises_timeout():
    with pytest.raises(RewardTimeout):
        math_verify_reward("\\boxed{9^{9^{9^{9}}}}", "1", timeout_s=1)


def test_refuses_to_run_off_the_main_thread():
    """Upstream returns a silent 0 on a thread; here it is an error the caller sees."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            math_verify_reward("\\boxed{1}", "1")
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors and isinstance(errors[0], RuntimeError)
