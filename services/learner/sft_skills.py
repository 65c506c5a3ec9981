"""Skills of a warm-started policy, measured on held-out demonstrations (issue 15).

Why: a fixed SFT length tuned on one world leaves the tiny policy, on another world, before the
point where it copies names into its queries and answers; RL then has nothing to raise. The SFT
loop measures, every `learner.sft_eval_every` steps, the abilities RL builds on and trains until
they reach `learner.sft_until` (services/learner/sft.py).

Every measurement is greedy, on good-strategy demonstrations of train questions held out of the
SFT set (`sft_heldout.parquet`, written by `forage data synth`):
- format: from the prompt alone, the first turn (stopped at `</search>`, `</answer>` or EOS) is
  `<think> … </think>` followed by one well-formed action.
- first_query (recorded, gateable): that same first turn searches exactly the demonstration's
  first query: the whole hop-1 behaviour RL starts from, copying the name from the question.
- query: at each search turn, with everything up to and including `<search>` teacher-forced
  (prompt, earlier turns and observations, the turn's own think block), the continuation up to
  `</search>` equals the demonstration's query: the entity name for hop 1, the bridge entity
  read from the passage for hop 2.
- answer: after the last observation, the greedy final turn answers the demonstration's answer
  (normalised as the scorer's EM); only demonstrations whose answer is right count.
Prefixes are token ids built as SFT and the agent loop build them (prompt via the chat template,
then each segment tokenised on its own), so a prefix is exactly what the policy sees live.

In the tool_calls protocol (a demonstration whose `extra_info.protocol` is `tool_calls`) the
same four skills are read from Hermes calls (docs/rollout.md, "Tool calls"):
- format: the first turn, cut after its first `</tool_call>` or `</answer>`, is what the
  format reward counts as a well-formed turn (`turn_format`: an optional think block, then one
  well-formed call of a built-in tool, or one answer).
- first_query: that turn calls `search` with exactly the demonstration's first query.
- query: teacher-forced up to and including the call's `"query": "` (the opening of the
  query's JSON string), the continuation closes a call whose `query` is the demonstration's.
- answer: as in the tags protocol (the final turn's `<answer>`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.formats import (
    STOP_STRINGS,
    cut_at_first_stop,
    normalize_answer,
    parse_action,
)
from services.common.skill_gate import SKILLS
from services.common.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCall,
    after_reasoning,
    parse_tool_calls,
    parse_turn,
    turn_format,
)
from services.common.tools import TOOL_REGISTRY

SEARCH_OPEN = "<search>"
SEARCH_CLOSE = "</search>"
TAGS, TOOL_CALLS = "tags", "tool_calls"
# Where a tool_calls query item's teacher-forced head ends: the opening quote of the query's
# JSON string, as `json.dumps` writes the demonstrations' calls (services/tasks/sft.py).
QUERY_OPENING = '"query": "'
# The tools a measured call may name (the format reward's default, `turn_format(..., None)`).
BUILTIN_SPECS = tuple(TOOL_REGISTRY.values())

# A turn is `<think> … </think>` then one action; no tag inside either (a tag there means the
# policy is emitting markup, not reasoning).
_WELL_FORMED = re.compile(r"\s*<think>[^<]*</think>\s*<(search|answer)>[^<]*</\1>\s*")


# ---------------------------------------------------------------------------------- pure parts

def is_well_formed_turn(text: str) -> bool:
    """The turn, cut at its first stop string, is a think block then one non-empty action."""
    turn = cut_at_first_stop(text)
    if not turn.rstrip().endswith(STOP_STRINGS):
        return False
    match = _WELL_FORMED.fullmatch(turn)
    if match is None:
        return False
    action = parse_action(turn)
    return action is not None and action[1] != ""


def searched_query(turn: str) -> str | None:
    """The query of a turn's first action when that action is a search, else None."""
    action = parse_action(cut_at_first_stop(turn))
    return action[1] if action is not None and action[0] == "search" else None


def continued_query(continuation: str) -> str | None:
    """The query a continuation after `<search>` closes with `</search>` (stripped); None when
    it never closes it."""
    end = continuation.find(SEARCH_CLOSE)
    return None if end == -1 else continuation[:end].strip()


def answered(turn: str) -> str | None:
    """The answer of a turn's first action when it is an answer, else None."""
    action = parse_action(cut_at_first_stop(turn))
    return action[1] if action is not None and action[0] == "answer" else None


def cut_tool_turn(text: str) -> str:
    """A tool_calls turn as the rollout's stop strings end it: after its first `</tool_call>`
    or `</answer>`, whichever comes first (the end-of-turn token is dropped in decoding)."""
    ends = [at + len(stop) for stop in (TOOL_CALL_CLOSE, "</answer>")
            if (at := text.find(stop)) != -1]
    return text[: min(ends)] if ends else text


def called_query(turn: str) -> str | None:
    """The query of a tool_calls turn's first action when that action is a well-formed
    `search` call (after any leading think block), else None."""
    body = after_reasoning(cut_tool_turn(turn)).lstrip()
    if not body.startswith(TOOL_CALL_OPEN):
        return None
    calls = parse_tool_calls(body, BUILTIN_SPECS)  # an unclosed call: an error, not a call
    call = calls[0] if calls else None
    if not isinstance(call, ToolCall) or call.name != "search":
        return None
    return str(call.arguments.get("query", "")).strip()


def score_tool_item(kind: str, generated: str, target: str, head: str = "") -> dict[str, bool]:
    """`score_item` for the tool_calls protocol; `head` is a query item's teacher-forced text
    (from the turn's start to the query's opening quote)."""
    if kind == "prompt":
        query = called_query(generated)
        return {"format": turn_format(cut_tool_turn(generated), None) is not None,
                "first_query": query is not None and query == target.strip()}
    if kind == "query":
        return {"query": called_query(head + generated) == target.strip()}
    if kind == "answer":  # read as the rollout reads it: an answer that closes before any call
        got = parse_turn(cut_tool_turn(generated), BUILTIN_SPECS).answer
        return {"answer": got is not None and normalize_answer(got) == normalize_answer(target)}
    raise ValueError(f"unknown skill item kind {kind!r}")


def score_item(kind: str, generated: str, target: str) -> dict[str, bool]:
    """Which skills one generated text shows; `kind` is the item's kind (see `SkillItem`)."""
    if kind == "prompt":
        query = searched_query(generated)
        return {"format": is_well_formed_turn(generated),
                "first_query": query is not None and query == target.strip()}
    if kind == "query":
        return {"query": continued_query(generated) == target.strip()}
    if kind == "answer":
        got = answered(generated)
        return {"answer": got is not None and normalize_answer(got) == normalize_answer(target)}
    raise ValueError(f"unknown skill item kind {kind!r}")


def aggregate(scores: Sequence[Mapping[str, bool]]) -> dict[str, float]:
    """Fraction of items showing each skill, over the items that measure it."""
    sums: dict[str, list[int]] = {}
    for item in scores:
        for skill, ok in item.items():
            sums.setdefault(skill, [0, 0])
            sums[skill][0] += int(ok)
            sums[skill][1] += 1
    return {skill: sums[skill][0] / sums[skill][1] for skill in SKILLS if skill in sums}


# -------------------------------------------------------------------------------- the items

@dataclass(frozen=True)
class SkillItem:
    """One greedy generation to run: `prompt` (a first turn from the prompt alone), `query` (the
    continuation after a teacher-forced `<search>`) or `answer` (the final turn)."""

    kind: str
    prefix: tuple[int, ...]
    target: str
    protocol: str = TAGS
    head: str = ""  # tool_calls query items: the turn's text the prefix ends with

    def score(self, generated: str) -> dict[str, bool]:
        """The skills `generated` (this item's greedy continuation) shows."""
        if self.protocol == TOOL_CALLS:
            return score_tool_item(self.kind, generated, self.target, self.head)
        return score_item(self.kind, generated, self.target)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(x) for x in tokenizer(text, add_special_tokens=False)["input_ids"]]


def build_items(tokenizer: Any, prompt: Any, segments: Sequence[Mapping[str, Any]],
                answer: str | None, protocol: str = TAGS) -> tuple[list[SkillItem], int]:
    """The items of one good demonstration, and how many query splits (at `<search>`, or at
    the call's `"query": "` in the tool_calls protocol) did not tokenise as a prefix of the
    whole turn (then the split's own tokens are used: what a policy that wrote the text up to
    the split would have produced). `answer` None: no answer item (the demonstration
    guessed)."""
    from services.learner.sft import encode_prompt

    if protocol not in (TAGS, TOOL_CALLS):
        raise ValueError(f"unknown protocol {protocol!r}; known: {[TAGS, TOOL_CALLS]}")
    prompt_ids = encode_prompt(tokenizer, prompt)
    items: list[SkillItem] = []
    mismatches = 0
    context = list(prompt_ids)
    first_query: str | None = None
    last_turn = max((i for i, s in enumerate(segments) if s.get("trainable")), default=None)
    for index, segment in enumerate(segments):
        text = str(segment["text"])
        piece = _ids(tokenizer, text)
        if segment.get("trainable"):
            query, head = _query_split(text, protocol)
            if query is not None:
                first_query = query if first_query is None else first_query
            if query is not None and head is not None:
                head_ids = _ids(tokenizer, head)
                if piece[: len(head_ids)] != head_ids:
                    mismatches += 1
                items.append(SkillItem("query", tuple(context + head_ids), query, protocol,
                                       head if protocol == TOOL_CALLS else ""))
            elif (query is None and index == last_turn and answer is not None
                  and answered(text) is not None):
                items.append(SkillItem("answer", tuple(context), answer, protocol))
        context.extend(piece)
    items.insert(0, SkillItem("prompt", tuple(prompt_ids), first_query or "", protocol))
    return items, mismatches


def _query_split(text: str, protocol: str) -> tuple[str | None, str | None]:
    """(the query a demonstration turn searches, the turn's text up to where the query item's
    continuation starts); (None, None) for a turn that does not search, (query, None) for a
    call whose JSON does not open the query as `json.dumps` writes it (no query item)."""
    if protocol == TAGS:
        query = searched_query(text)
        if query is None:
            return None, None
        return query, text[: text.index(SEARCH_OPEN) + len(SEARCH_OPEN)]
    query = called_query(text)
    if query is None:
        return None, None
    at = text.find(QUERY_OPENING, text.find(TOOL_CALL_OPEN))
    return query, (None if at == -1 else text[: at + len(QUERY_OPENING)])


def load_items(path: str, tokenizer: Any, max_length: int) -> tuple[list[SkillItem], int]:
    """Items of every row of a held-out parquet; prefixes longer than `max_length` dropped."""
    import pyarrow.parquet as pq

    from services.learner.sft import _as_python

    table = pq.read_table(str(path))
    columns = set(table.column_names)
    prompts = table.column("prompt").to_pylist()
    segments = table.column("segments").to_pylist()
    extras = table.column("extra_info").to_pylist() if "extra_info" in columns else [None] * len(
        prompts)
    items: list[SkillItem] = []
    mismatches = 0
    for prompt, segs, extra in zip(prompts, segments, extras, strict=True):
        extra = _as_python(extra) or {}
        answer = extra.get("answer") if extra.get("correct", True) else None
        if answer is None and extra.get("correct", True):
            answer = _gold_from_segments(_as_python(segs))
        row_items, bad = build_items(tokenizer, _as_python(prompt), _as_python(segs), answer,
                                     str(extra.get("protocol") or TAGS))
        mismatches += bad
        items.extend(i for i in row_items if len(i.prefix) < max_length)
    return items, mismatches


def _gold_from_segments(segments: Sequence[Mapping[str, Any]]) -> str | None:
    for segment in reversed(segments):
        if segment.get("trainable"):
            return answered(str(segment["text"]))
    return None


# --------------------------------------------------------------------------- the model runs

def stop_token_ids(tokenizer: Any) -> list[int]:
    """EOS ids plus the stop strings' ids where a stop string is one token (the tiny policy's
    tags are); other tokenizers stop at max_new_tokens and the text is cut at the stop."""
    ids = set()
    for token in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")):
        if isinstance(token, int) and token != tokenizer.unk_token_id:
            ids.add(token)
    for stop in (*STOP_STRINGS, TOOL_CALL_CLOSE):
        piece = _ids(tokenizer, stop)
        if len(piece) == 1:
            ids.add(piece[0])
    return sorted(ids)


def generate_greedy(model: Any, prefixes: Sequence[Sequence[int]], max_new_tokens: int,
                    stop_ids: Sequence[int], pad_id: int, batch_size: int = 64) -> list[list[int]]:
    """Greedy continuations of `prefixes` (left-padded batches of similar length), each cut
    after its first stop id."""
    import torch

    order = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i]))
    results: list[list[int]] = [[] for _ in prefixes]
    device = next(model.parameters()).device
    stops = set(stop_ids)
    for start in range(0, len(order), batch_size):
        chunk = order[start: start + batch_size]
        width = max(len(prefixes[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, index in enumerate(chunk):
            prefix = list(prefixes[index])
            ids[row, width - len(prefix):] = torch.tensor(prefix, dtype=torch.long)
            mask[row, width - len(prefix):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=list(stop_ids) or None, pad_token_id=pad_id,
                             temperature=None, top_p=None, top_k=None)
        for row, index in enumerate(chunk):
            generated: list[int] = []
            for token in out[row, width:].tolist():
                generated.append(int(token))
                if token in stops:
                    break
            results[index] = generated
    return results


def measure(model: Any, tokenizer: Any, items: Sequence[SkillItem], max_new_tokens: int,
            batch_size: int = 64) -> dict[str, float]:
    """Skills of `model` on `items` (greedy, no gradients); the model's train/eval mode is
    restored. Also `seconds` (the measurement's wall time)."""
    import torch

    started = time.perf_counter()
    was_training = model.training
    model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    try:
        with torch.no_grad():
            outputs = generate_greedy(model, [i.prefix for i in items], max_new_tokens,
                                      stop_token_ids(tokenizer), pad_id, batch_size)
    finally:
        model.train(was_training)
    texts = tokenizer.batch_decode(outputs, skip_special_tokens=True)
    skills = aggregate([item.score(text) for item, text in zip(items, texts, strict=True)])
    skills["seconds"] = time.perf_counter() - started
    return skills
