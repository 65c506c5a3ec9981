"""Search-R1 QA rewards: exact match, substring match, token F1, and the format-aware variant.

All take the decoded response and a ground truth in any shape `gold_answers` accepts. The
format-aware variant reproduces Search-R1 v0.3's `qa_em_format` scoring table; its constants are
options (structure 0.2 / final 0.1 / retrieval 0 in their scripts, all 0 for validation).
"""

from __future__ import annotations

import re
from collections import Counter

from services.scorer.rewards.text import gold_answers, last_answer, normalize_answer, response_part


def em_check(prediction: str, golds: list[str]) -> bool:
    normalized = normalize_answer(prediction)
    return any(normalize_answer(gold) == normalized for gold in golds)


def subem_check(prediction: str, golds: list[str]) -> bool:
    """Some gold (normalised) appears inside the normalised prediction."""
    normalized = normalize_answer(prediction)
    return any(normalize_answer(gold) in normalized for gold in golds)


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 over normalised whitespace tokens."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_em(solution_str: str, ground_truth: object, format_score: float = 0.0,
          score: float = 1.0) -> float:
    answer = last_answer(solution_str)
    if answer is None:
        return 0.0
    return score if em_check(answer, gold_answers(ground_truth)) else format_score


def qa_subem(solution_str: str, ground_truth: object, format_score: float = 0.0,
             score: float = 1.0) -> float:
    answer = last_answer(solution_str)
    if answer is None:
        return 0.0
    return score if subem_check(answer, gold_answers(ground_truth)) else format_score


def qa_f1(solution_str: str, ground_truth: object) -> float:
    answer = last_answer(solution_str)
    if answer is None:
        return 0.0
    return max(token_f1(answer, gold) for gold in gold_answers(ground_truth))


# ---------------------------------------------------------------- format-aware variant

_TAG_SPLIT = re.compile(r"(</?(?:think|search|information|answer)>)")
_TAGS = ("think", "search", "information", "answer")
_INFORMATION = re.compile(r"<information>(.*?)</information>", re.DOTALL)

# state machine: (state, tag) -> next state. A valid response is
# think -> (search -> information -> think)* -> answer, with only whitespace between blocks.
_TRANSITIONS = {
    ("start", "<think>"): "in_think",
    ("information", "<think>"): "in_think",
    ("in_think", "</think>"): "after_think",
    ("after_think", "<search>"): "in_search",
    ("in_search", "</search>"): "after_search",
    ("after_search", "<information>"): "in_information",
    ("in_information", "</information>"): "information",
    ("after_think", "<answer>"): "in_answer",
    ("in_answer", "</answer>"): "end",
}
_INSIDE = {"in_think", "in_search", "in_information", "in_answer"}


def is_valid_sequence(text: str) -> bool:
    """Search-R1's structure check on the response (after the assistant marker if present)."""
    content = response_part(text)
    for tag in _TAGS:
        if content.count(f"<{tag}>") != content.count(f"</{tag}>"):
            return False
    state = "start"
    for part in _TAG_SPLIT.split(content):
        if not part.strip():
            continue
        if _TAG_SPLIT.fullmatch(part):
            state = _TRANSITIONS.get((state, part), "invalid")
            if state == "invalid":
                return False
        elif state not in _INSIDE and state != "end":
            return False  # text between blocks (trailing text after the answer is allowed)
    return state == "end"


def retrieval_correct(text: str, golds: list[str]) -> bool:
    """A gold answer appears in some `<information>` block (substring after normalisation)."""
    blocks = _INFORMATION.findall(response_part(text))
    return any(subem_check(block, golds) for block in blocks)


def qa_em_format(
    solution_str: str,
    ground_truth: object,
    structure_format_score: float = 0.2,
    final_format_score: float = 0.1,
    retrieval_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """Search-R1 v0.3 `compute_score_em` of qa_em_format.py (see reference/search_r1.md 4)."""
    golds = gold_answers(ground_truth)
    valid = is_valid_sequence(solution_str)
    retrieved = valid and retrieval_correct(solution_str, golds)
    answer = last_answer(solution_str)
    structure_credit = structure_format_score + (retrieval_score if retrieved else 0.0)
    if answer is None:
        return structure_credit if valid else 0.0
    if em_check(answer, golds):
        return score if valid else score - structure_format_score
    return structure_credit if valid else final_format_score
