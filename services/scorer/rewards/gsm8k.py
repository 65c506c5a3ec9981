"""GSM8K (verl's `gsm8k.compute_score`): the answer after `####` (strict) or the last number
(flexible), compared with the gold as an exact string.

Strict takes the last `#### n` within the last 300 characters, as verl upstream does (TinyZero's
copy takes the first). Commas and `$` are removed in strict mode only, so "1,000" matches in
strict mode and fails in flexible mode — upstream's behaviour, kept so scores compare.
"""

from __future__ import annotations

import re

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
_CLIP_CHARS = 300


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str[-_CLIP_CHARS:] if len(solution_str) > _CLIP_CHARS else solution_str
    if method == "strict":
        matches = _STRICT.findall(text)
        if not matches:
            return None
        return matches[-1].replace(",", "").replace("$", "")
    for candidate in reversed(_FLEXIBLE.findall(text)):
        if candidate not in ("", "."):
            return candidate
    return None


def gsm8k(solution_str: str, ground_truth: object, method: str = "strict",
          format_score: float = 0.0, score: float = 1.0) -> float:
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth).strip() else format_score
