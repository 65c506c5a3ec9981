"""Text formats both sides of a contract share (Search-R1's, byte for byte; docs/architecture.md).

The data builder writes prompts and SFT observations with these functions and the rollout
agent loop inserts observations with the same ones, so a demonstration and a live trajectory
are token-identical.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. You can search as many times "
    "as your want. If you find no further external knowledge needed, you can directly provide "
    "the answer inside <answer> and </answer>, without detailed illustrations. For example, "
    "<answer> Beijing </answer>. Question: {question}\n"
)

CORRECTIVE_MESSAGE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let me try again.\n"
)

STOP_STRINGS: tuple[str, ...] = ("</search>", "</answer>")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD/Search-R1 normalisation: lower, drop punctuation, drop articles, squash spaces.
    Shared by the scorer's EM rewards and the SFT warm start's skill measurement."""
    text = text.lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def gold_answers(ground_truth: object) -> list[str]:
    """Gold strings from `{"target": [...]}` (Search-R1 parquet), a list, or a single value.
    Shared by the scorer's QA rewards and the rollout's retrieval-health check."""
    if isinstance(ground_truth, dict):
        if "target" not in ground_truth:
            raise ValueError(f"QA ground truth needs a 'target' key, got keys {sorted(ground_truth)}")
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, str | int | float) and not isinstance(ground_truth, bool):
        return [str(ground_truth)]
    if isinstance(ground_truth, list | tuple) or hasattr(ground_truth, "tolist"):
        values = ground_truth.tolist() if hasattr(ground_truth, "tolist") else ground_truth
        return [str(value) for value in values]
    raise ValueError(f"QA ground truth must be a string, a list or {{'target': ...}}, "
                     f"got {type(ground_truth).__name__}")


def contains_answer(passage: str, answer: str) -> bool:
    """Whole-word containment of `answer` in `passage`, both normalised as answers are
    (normalize_answer): "1" is not found in "1990", "Paris" is in "the city of paris."."""
    needle = normalize_answer(answer)
    return bool(needle) and f" {needle} " in f" {normalize_answer(passage)} "

ACTION_PATTERN = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)

# Suffixes that force an answer after a truncated reasoning prefix (docs/architecture.md; docs/probe.md).
# TinyZero-PRM's (countdown), byte for byte: note the trailing space after <answer>.
PROBE_SUFFIX_THINK = "</think> Thus, the final answer is <answer> "
# Search trajectories (no reference probe): the policy's own answer markup and nothing else. A
# search response reaches its answer as `</think>\n<answer>` (Search-R1's format), so a prefix
# is closed the way the policy closes it (ProbeRule.closers) and then `<answer>` opens the
# answer. TinyZero-PRM's `</think> Thus, the final answer is <answer>` was used before: after a
# prefix whose think block is already closed (every 100% cut, most cuts after a passage) it
# gave `</think>\n</think> Thus, ...`, which a policy trained on its own format never saw; on
# the demo's seed-2 world it answered right on 0 of 10 correct trajectories at 100% against 10
# of 10 with `<answer>` (docs/probe.md). No trailing space: in BPE vocabularies the answer's
# leading space belongs to its first token.
PROBE_SUFFIX_TAGGED = "<answer>"
# Math-PRM's (\boxed{} answers), byte for byte.
PROBE_SUFFIX_BOXED = " Thus, the final answer is: \\boxed{"
# GSM8K in verl's `####` form: the answer line of its solutions ("#### 72").
PROBE_SUFFIX_GSM8K = "\n#### "


def normalize_question(question: str) -> str:
    """Search-R1's question normalisation: strip, and end with a question mark."""
    question = question.strip()
    if not question.endswith("?"):
        question += "?"
    return question


def search_r1_prompt(question: str) -> str:
    return SEARCH_R1_TEMPLATE.format(question=normalize_question(question))


def corpus_contents(title: str, text: str) -> str:
    """A corpus row's `contents`: quoted title line, newline, text (wiki-18 format)."""
    return f'"{title}"\n{text}'


def passages_to_string(results: Sequence[Mapping[str, Any]]) -> str:
    """Search-R1's `_passages2string`: `Doc {i}(Title: {title}) {text}` lines.

    Accepts per-query results in either /retrieve shape: `{"document": doc, "score": s}` items
    (return_scores=true) or plain docs. The title keeps its quotes, as Search-R1's does.
    """
    lines = []
    for index, item in enumerate(results, start=1):
        doc = item["document"] if "document" in item else item
        content_lines = str(doc["contents"]).split("\n")
        title, text = content_lines[0], "\n".join(content_lines[1:])
        lines.append(f"Doc {index}(Title: {title}) {text}\n")
    return "".join(lines)


def doc_refs(results: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """`[{"id", "title"}]` of one query's /retrieve results (either shape), best first; the
    title is the first line of `contents` without its quotes."""
    refs = []
    for item in results:
        doc = item["document"] if "document" in item else item
        title = str(doc.get("contents", "")).split("\n", 1)[0].strip().strip('"')
        refs.append({"id": str(doc.get("id", "")), "title": title})
    return refs


def information_block(results: Sequence[Mapping[str, Any]]) -> str:
    """The observation appended after a search action."""
    return "\n\n<information>" + passages_to_string(results).strip() + "</information>\n\n"


def parse_action(text: str) -> tuple[str, str] | None:
    """First `<search>` / `<answer>` action in a turn's text: (action, stripped content)."""
    match = ACTION_PATTERN.search(text)
    if match is None:
        return None
    return match.group(1), match.group(2).strip()


def cut_at_first_stop(text: str) -> str:
    """Text up to and including the first `</search>`, else the first `</answer>`."""
    for stop in STOP_STRINGS:
        position = text.find(stop)
        if position != -1:
            return text[: position + len(stop)]
    return text


# Data sources whose answers are `\boxed{...}` (the probe forces a boxed answer for them).
BOXED_ANSWER_MARKERS: tuple[str, ...] = ("math", "aime", "amc")


def is_boxed_answer_task(data_source: str) -> bool:
    lowered = data_source.lower()
    return any(marker in lowered for marker in BOXED_ANSWER_MARKERS)


@dataclass(frozen=True)
class ProbeRule:
    """Where a response's reasoning span lies for one task, and the suffix that forces an answer.

    The span starts after the first `start_after` marker when one is set (the probe prefix
    always keeps the text before it) and ends before the first occurrence of the first marker
    kind in `ends_before` that occurs at all (none: the span runs to the end of the response).
    Markers count only where they start in the policy's own tokens (loss mask 1), never inside
    retrieved text. docs/probe.md gives the rule per task with its reference.
    """

    task: str
    suffix: str
    ends_before: tuple[str, ...]
    start_after: str | None = None
    # (opening tag, what closes it): a prefix that ends inside one of these gets its closer
    # before the suffix, the way the policy itself ends that block (probe_closer).
    closers: tuple[tuple[str, str], ...] = ()


PROBE_RULES: dict[str, ProbeRule] = {
    # TinyZero-PRM `find_cot_boundaries`: after the first <think>; the first </think>, else the
    # first <answer> (its fix for prompts that already end with <think>), else everything.
    "think": ProbeRule("think", PROBE_SUFFIX_THINK, ("</think>", "<answer>"), "<think>"),
    # Math-PRM: from the start of the response to the first \boxed{.
    "boxed": ProbeRule("boxed", PROBE_SUFFIX_BOXED, ("\\boxed{",)),
    # GSM8K `####` form: before the first ####; a boxed answer is the fallback boundary.
    "gsm8k": ProbeRule("gsm8k", PROBE_SUFFIX_GSM8K, ("####", "\\boxed{")),
    # Search trajectories: the policy's own tokens before its first <answer>; an open think or
    # search block is closed as the policy closes it before the answer is forced.
    "search": ProbeRule("search", PROBE_SUFFIX_TAGGED, ("<answer>",),
                        closers=(("<think>", "</think>\n"), ("<search>", "</search>\n"))),
}


def probe_closer(rule: ProbeRule, prefix_text: str) -> str:
    """What closes the block a probe prefix ends inside (ProbeRule.closers): the closer of the
    tag opened last and not closed since, or "" when the prefix ends outside every block."""
    best, closer = -1, ""
    for opening, closing in rule.closers:
        opened = prefix_text.rfind(opening)
        if opened > best and opened > prefix_text.rfind(closing.strip()):
            best, closer = opened, closing
    return closer


def probe_task(data_source: str) -> str:
    """The probe rule a data source follows: think (countdown), gsm8k, boxed (math), search."""
    lowered = data_source.lower()
    if "countdown" in lowered:
        return "think"
    if "gsm8k" in lowered:
        return "gsm8k"
    if is_boxed_answer_task(data_source):
        return "boxed"
    return "search"


# The search rule in rollout.protocol tool_calls (docs/probe.md, "Tool calls"). The span and
# the suffix are the tags rule's: every token the template inserts between two assistant turns
# (the rest of the closer, the tool messages and the next assistant header) has loss mask 0,
# so a cut after a turn's last policy token runs on to the next policy token, i.e. right after
# the last tool message's end of turn and the assistant header that follows it, where the
# policy's next turn begins. A prefix that ends inside an unfinished `<tool_call>` is closed
# as the policy closes one before `<answer>` is forced (the call is never run).
PROBE_RULE_TOOL_CALLS_SEARCH = replace(
    PROBE_RULES["search"], closers=(*PROBE_RULES["search"].closers, ("<tool_call>", "</tool_call>\n")))


def probe_rule(data_source: str, suffix: str | None = None, protocol: str = "tags") -> ProbeRule:
    """The data source's rule; `suffix` (config `probe.suffix`) replaces only its suffix;
    `protocol` (rollout.protocol) "tool_calls" closes an unfinished tool call in a search
    prefix (PROBE_RULE_TOOL_CALLS_SEARCH)."""
    rule = PROBE_RULES[probe_task(data_source)]
    if protocol == "tool_calls" and rule.task == "search":
        rule = PROBE_RULE_TOOL_CALLS_SEARCH
    # A suffix of the user's own is used as written: no closer is put in front of it.
    return rule if suffix is None else replace(rule, suffix=suffix, closers=())


def probe_suffix(data_source: str, override: str | None = None) -> str:
    """The suffix that forces an answer after a truncated reasoning prefix (docs/architecture.md).

    One rule for both sides of the contract: the rollout appends it to build probe prompts and
    the scorer prepends it to each completion so the answer markup is complete.
    """
    return probe_rule(data_source, override).suffix


def probe_stops(suffix: str) -> tuple[str, ...]:
    """Stop strings of a probe completion: the end of the answer markup the suffix opened."""
    if "<answer>" in suffix:
        return ("</answer>",)
    if suffix.rstrip(" ").endswith("####"):
        return ("\n",)  # a `#### n` answer is one line
    return ()  # \boxed{: completions are short (mc_max_tokens) and the reward reads the box
