"""Search-R1 QA rewards: exact match, substring match, token F1, and the format-aware variant.

All take the decoded response and a ground truth in any shape `gold_answers` accepts. The
format-aware variant follows Search-R1 v0.3's `qa_em_format` scoring table; its constants are
options (structure 0.2 / final 0.1 / retrieval 0 in their scripts, all 0 for validation).
`mode="search_r1"` reproduces Search-R1's function case for case, its bugs included;
the default fixes those (docs/scorer.md lists every difference).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Literal

from services.common import tool_calls
from services.common.formats import SEARCH_R1_TEMPLATE
from services.common.tools import ToolSpec
from services.scorer.rewards.text import (
    gold_answers,
    last_answer,
    normalize_answer,
    response_part,
    tag_contents,
)


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


def final_answer(solution_str: str, protocol: str = "tags") -> str | None:
    """The answer a QA reward reads: in `tags`, the last `<answer>` of the response (Search-R1);
    in `tool_calls`, the answer of the last assistant turn as the rollout parsed it, never one
    inside a tool result (services.common.tool_calls.final_answer; docs/scorer.md)."""
    if protocol == "tool_calls":
        return tool_calls.final_answer(solution_str)
    if protocol != "tags":
        raise ValueError(f"protocol must be 'tags' or 'tool_calls', got {protocol!r}")
    return last_answer(solution_str)


def qa_em(solution_str: str, ground_truth: object, format_score: float = 0.0,
          score: float = 1.0, protocol: str = "tags") -> float:
    answer = final_answer(solution_str, protocol)
    if answer is None:
        return 0.0
    return score if em_check(answer, gold_answers(ground_truth)) else format_score


def qa_subem(solution_str: str, ground_truth: object, format_score: float = 0.0,
             score: float = 1.0, protocol: str = "tags") -> float:
    answer = final_answer(solution_str, protocol)
    if answer is None:
        return 0.0
    return score if subem_check(answer, gold_answers(ground_truth)) else format_score


def qa_f1(solution_str: str, ground_truth: object, protocol: str = "tags") -> float:
    answer = final_answer(solution_str, protocol)
    if answer is None:
        return 0.0
    return max(token_f1(answer, gold) for gold in gold_answers(ground_truth))


# ---------------------------------------------------------------- format-aware variant

_TAG_SPLIT = re.compile(r"(</?(?:think|search|information|answer)>)")
_TAGS = ("think", "search", "information", "answer")

# state machine: (state, tag) -> next state. A valid response is
# think -> (search -> information -> think)* -> answer, with only whitespace between blocks
# and after the answer.
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


def valid_structure(content: str) -> bool:
    """Search-R1's structure rule on a response: balanced tags, the state machine above, and
    nothing but whitespace outside the blocks (text after `</answer>` makes it invalid)."""
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
        elif state not in _INSIDE:
            return False  # text between blocks or after the answer
    return state == "end"


def is_valid_sequence(text: str) -> bool:
    """The structure rule on the response (the text after the last assistant marker if any)."""
    return valid_structure(response_part(text))


def retrieval_correct(text: str, golds: list[str]) -> bool:
    """A gold answer appears in some `<information>` block (substring after normalisation)."""
    blocks = tag_contents(response_part(text), "information")
    return any(subem_check(block, golds) for block in blocks)


def _table(valid: bool, retrieved: bool, answer: str | None, golds: list[str],
           structure_format_score: float, final_format_score: float, retrieval_score: float,
           score: float) -> float:
    """Search-R1 v0.3 `compute_score_em`'s table (both modes share it)."""
    structure_credit = structure_format_score + (retrieval_score if retrieved else 0.0)
    if answer is None:
        return structure_credit if valid else 0.0
    if em_check(answer, golds):
        return score if valid else score - structure_format_score
    return structure_credit if valid else final_format_score


def qa_em_format(
    solution_str: str,
    ground_truth: object,
    structure_format_score: float = 0.2,
    final_format_score: float = 0.1,
    retrieval_score: float = 0.0,
    score: float = 1.0,
    mode: Literal["forage", "search_r1"] = "forage",
    protocol: str = "tags",
    tools: list[ToolSpec] | None = None,
    open_tool_names: bool = False,
) -> float:
    """Search-R1 v0.3 `compute_score_em` of qa_em_format.py (see reference/search_r1.md 4).

    `mode="forage"` reads the response only: its last complete answer (none → no answer) and
    its own `<information>` blocks. `mode="search_r1"` is Search-R1's function exactly,
    prompt included (see `search_r1_view`). `protocol="tool_calls"` keeps the same table with
    the tool_calls structure rule (`tool_calls.well_formed_response` against `tools`, None: the
    built-ins), the final answer of `tool_calls.final_answer`, and the retrieval credit from
    the tool results; `mode` is then ignored (Search-R1 has no tool_calls reading)."""
    golds = gold_answers(ground_truth)
    if protocol == "tool_calls":
        valid = tool_calls.well_formed_response(solution_str, tools, open_tool_names)
        retrieved = valid and any(
            subem_check(tool_calls.observation_text(text), golds)
            for text in tool_calls.split_response(solution_str).observations)
        answer = tool_calls.final_answer(solution_str)
    elif protocol != "tags":
        raise ValueError(f"qa_em_format: protocol must be 'tags' or 'tool_calls', got {protocol!r}")
    elif mode == "search_r1":
        text = search_r1_view(solution_str)
        valid = search_r1_valid(text)
        retrieved = valid and any(subem_check(block, golds)
                                  for block in tag_contents(text, "information"))
        answer = search_r1_answer(text)
    elif mode == "forage":
        valid = is_valid_sequence(solution_str)
        retrieved = valid and retrieval_correct(solution_str, golds)
        answer = last_answer(solution_str)
    else:
        raise ValueError(f"qa_em_format: mode must be 'forage' or 'search_r1', got {mode!r}")
    return _table(valid, retrieved, answer, golds, structure_format_score, final_format_score,
                  retrieval_score, score)


# ---------------------------------------------------------------- Search-R1's exact reading

SEARCH_R1_MARKER = re.compile(r"<\|im_start\|>assistant\s*")
# What Search-R1's reward sees before a response: its Qwen chat prompt. Only the instruction's
# tags matter to the reward (two answer pairs, one information pair); the question does not.
SEARCH_R1_CONTEXT = (
    "<|im_start|>user\n" + SEARCH_R1_TEMPLATE.format(question="?")
    + "<|im_end|>\n<|im_start|>assistant\n"
)


def search_r1_view(solution_str: str) -> str:
    """The text Search-R1's reward manager decodes: prompt + response with special tokens. A
    text without `<|im_start|>assistant` is taken as a response to Search-R1's own prompt."""
    if SEARCH_R1_MARKER.search(solution_str):
        return solution_str
    return SEARCH_R1_CONTEXT + solution_str


def search_r1_valid(text: str) -> bool:
    """Search-R1's `is_valid_sequence`: the rule on the text after the FIRST
    `<|im_start|>assistant` (and its whitespace); no marker → invalid."""
    marker = SEARCH_R1_MARKER.search(text)
    return marker is not None and valid_structure(text[marker.end():])


def search_r1_answer(text: str) -> str | None:
    """Search-R1's `extract_solution`: over the whole text, prompt included, None when there
    are fewer than two complete answers, else the last one, stripped. Its prompt holds two
    (`<answer> and </answer>`, `<answer> Beijing </answer>`), so a response without one is
    read as answering "Beijing"."""
    matches = tag_contents(text, "answer")
    if len(matches) <= 1:
        return None
    return matches[-1].strip()
