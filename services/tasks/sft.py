"""Demonstration trajectories for the SFT warm start, built with the real retriever.

Each demonstration plays one strategy on a train question against the in-process index, and
every observation is `formats.information_block` of what the index returned, so the
`<information>` text is byte-identical to what the agent loop would insert at rollout time.

Strategies (issue 5): the warm-started policy should know the format and be able to execute
the good strategy, but not yet prefer it, so RL has something to raise.
- good: search the question's entity by name, read the answer (or the bridge entity) from the
  first passage that states it, search the bridge for two-hop questions, answer.
- guess: answer at once, a random value of the right type.
- sloppy: one search with a vague or wrong query (part of the name, another entity, a generic
  phrase), then answer from whatever came back.
In every strategy the demonstration answers from what it actually saw: it never writes an
answer the retrieved passages do not support (other than an explicit guess).

Row format (`sft.parquet`), read by services/learner/sft.py:
  prompt:    [{"role": "user", "content": Search-R1 prompt}]  (chat messages)
  segments:  [{"text": str, "trainable": bool}, ...]  the response in order; trainable = policy
             tokens (loss on), not trainable = observations (loss off). Tokenize each segment on
             its own and concatenate, as the agent loop does.
  plus data_source, reward_model, extra_info (split, index, strategy, correct, searches, ...).

Protocols. `tags` (Search-R1's, the default): the turns above. `tool_calls` (`rollout.protocol:
tool_calls`, docs/rollout.md "Tool calls"): the same strategies and reasoning, but a search is a
Hermes call `<tool_call>\n{"name": "search", "arguments": {"query": ...}}\n</tool_call>` and its
result comes back in the chat template's tool turn. The texts are then exactly what the agent
loop's token concatenation builds (`ToolTurns`, over the rollout's own `ChatTurns`):
  prompt:    the rendered text of the user message through the chat template with the tool
             declarations and the generation prompt (what the loop encodes as prompt ids)
  call turn: `<think> … </think>\n<tool_call>…</tool_call>` (trainable; the turn stops there)
  tool turn: the template's text after the call turn: the rest of its closer, the tool message
             with the `Doc i(Title: …)` lines, the next assistant header (not trainable)
  answer:    `<think> … </think>\n<answer> … </answer>` and the template's end-of-turn token,
             which the policy generates to end the trajectory (trainable)
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.common.formats import (
    information_block,
    normalize_question,
    passages_to_string,
    search_r1_prompt,
)
from services.tasks.world import DATA_SOURCE_MULTI, DATA_SOURCE_SINGLE

PROTOCOLS = ("tags", "tool_calls")
STRATEGIES = ("good", "guess", "sloppy")
DEFAULT_MIX: dict[str, float] = {"good": 0.4, "guess": 0.3, "sloppy": 0.3}

# search(queries, topk) -> per query [(doc, score), ...]; Searcher.search has this shape.
SearchFn = Callable[[list[str], int], list[list[tuple[dict[str, Any], float]]]]

_VAGUE_QUERIES = {
    "city": ["city", "born in", "headquartered in"],
    "country": ["country", "a city in"],
    "occupation": ["occupation", "works as"],
    "industry": ["company industry", "company"],
    "genre": ["film genre", "film"],
}


def parse_mix(text: str | Mapping[str, float]) -> dict[str, float]:
    """`good=0.4,guess=0.3,sloppy=0.3` (or a mapping) -> normalised weights."""
    if isinstance(text, Mapping):
        raw = {str(k): float(v) for k, v in text.items()}
    else:
        raw = {}
        for part in str(text).split(","):
            if not part.strip():
                continue
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"mix entry {part!r} must look like strategy=weight")
            raw[name.strip()] = float(value)
    unknown = set(raw) - set(STRATEGIES)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; known: {list(STRATEGIES)}")
    if any(v < 0 for v in raw.values()) or sum(raw.values()) <= 0:
        raise ValueError("mix weights must be non-negative and not all zero")
    total = sum(raw.values())
    return {name: raw.get(name, 0.0) / total for name in STRATEGIES}


# Search-R1's prompt with the search action written as a tool call: a template that ignores
# `tools=` (the tiny policy's ChatML) shows the model no declarations, so the prompt spells the
# call out, as the evaluation's tool_calls prompt does (services/eval/prompts.py).
TOOL_SEARCH_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call the search tool by <tool_call>\n{{\"name\": \"search\", \"arguments\": "
    "{{\"query\": \"...\"}}}}\n</tool_call> and it will return the top searched results as "
    "the tool's message. You can search as many times as your want. If you find no further "
    "external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)


def tool_search_prompt(question: str) -> str:
    """The user message of a question in the tool_calls protocol."""
    return TOOL_SEARCH_TEMPLATE.format(question=normalize_question(question))


def protocol_prompt(question: str, protocol: str = "tags") -> list[dict[str, str]]:
    """A question's chat messages in `protocol` (RL rows and demonstrations share them)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; known: {list(PROTOCOLS)}")
    content = tool_search_prompt(question) if protocol == "tool_calls" else search_r1_prompt(
        question)
    return [{"role": "user", "content": content}]


def search_call(query: str) -> str:
    """A Hermes search call, as Qwen2.5's template renders one."""
    return ("<tool_call>\n" + json.dumps({"name": "search", "arguments": {"query": query}})
            + "\n</tool_call>")


class ToolTurns:
    """The texts of tool_calls demonstrations for one chat template and tool set, built with the
    rollout's `ChatTurns` (services/rollout/tools.py), so a demonstration tokenised segment by
    segment is the token sequence the agent loop builds for the same turns."""

    def __init__(self, tokenizer: Any, tool_names: Sequence[str] = ("search",)) -> None:
        from services.common.tools import tool_specs
        from services.rollout.tools import ChatTurns

        if "search" not in tool_names:
            raise ValueError("tool_calls demonstrations call the search tool: rollout.tools "
                             f"must declare it (got {list(tool_names)})")
        self.tool_names = tuple(tool_names)
        self.chat = ChatTurns(tokenizer, tool_specs(self.tool_names))
        # A turn that answers ends with the template's end-of-turn token, or the EOS token
        # when the template has none; the loop keeps that generated token as the turn's last.
        self.end_of_turn = self.chat.end_of_turn or str(getattr(tokenizer, "eos_token", "") or "")

    def prompt_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt as the loop renders it: the template with the tools, generation prompt."""
        return self.chat.render(messages, True)

    def tool_turn(self, context: Sequence[Mapping[str, Any]], content: str) -> str:
        """What the loop inserts after a call turn that ended on its end-of-turn token (a turn
        runs to its end of turn, since it may hold several calls)."""
        return self.chat.inserted_text(context, [{"role": "tool", "name": "search",
                                                  "content": content,
                                                  "tool_call_id": "0" * 9}], self.end_of_turn)


def template_tokenizer(source: str | None = None) -> Any:
    """A tokenizer whose chat template renders tool_calls demonstrations: the one in `source`
    (a model or tokenizer directory) when given, else the tiny policy's (`forage model init`
    builds it after the world: only its chat template and special tokens matter here, and
    they do not depend on the vocabulary trained later)."""
    from transformers import PreTrainedTokenizerFast

    if source:
        from transformers import AutoTokenizer

        from services.common.paths import LOCAL_ONLY

        return AutoTokenizer.from_pretrained(source, **LOCAL_ONLY)
    from tokenizers import Tokenizer, models

    from services.tasks.tiny_policy import CHAT_TEMPLATE, ENDOFTEXT, IM_END, IM_START

    vocab = {"[UNK]": 0, ENDOFTEXT: 1, IM_START: 2, IM_END: 3}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
        eos_token=IM_END, pad_token=ENDOFTEXT, unk_token="[UNK]",
        additional_special_tokens=[IM_START, IM_END])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _think_search(thought: str, query: str) -> str:
    return f"<think> {thought} </think>\n<search> {query} </search>"


def _think_answer(thought: str, answer: str) -> str:
    return f"<think> {thought} </think>\n<answer> {answer} </answer>"


def _read(results: Sequence[tuple[dict[str, Any], float]], relation: str,
          doc_facts: Mapping[str, Mapping[str, str]], answer_type: str) -> str | None:
    """The value for `relation` stated in the first passage that states one; a passage that
    only mentions a city (a distractor) yields that city when a city is asked for."""
    for doc, _ in results:
        facts = doc_facts.get(str(doc["id"]), {})
        if relation in facts:
            return facts[relation]
    if answer_type == "city":
        for doc, _ in results:
            facts = doc_facts.get(str(doc["id"]), {})
            for key, value in facts.items():
                if key == "mentions_city" or key in ("born_in", "headquarters", "filmed_in"):
                    return value
    return None


class DemoBuilder:
    """Plays strategies against a search function; one call per strategy and question."""

    def __init__(self, search: SearchFn, world_meta: Mapping[str, Any], topk: int,
                 seed: int = 0, turns: ToolTurns | None = None) -> None:
        self.search = search
        self.doc_facts: Mapping[str, Mapping[str, str]] = world_meta["doc_facts"]
        self.entities: Mapping[str, Mapping[str, Any]] = world_meta["entities"]
        self.value_types: Mapping[str, list[str]] = world_meta["value_types"]
        self.topk = topk
        self.rng = random.Random(f"sft-{seed}")
        self.turns = turns  # None: the tags protocol
        self.context: list[dict[str, Any]] = []  # tool_calls: the question's prompt messages

    def _observe(self, query: str) -> tuple[str, list[tuple[dict[str, Any], float]]]:
        results = self.search([query], self.topk)[0]
        found = [{"document": doc, "score": score} for doc, score in results]
        if self.turns is not None:  # the loop's tool message: the passages, stripped
            return self.turns.tool_turn(self.context, passages_to_string(found).strip()), results
        return information_block(found), results

    def _search_text(self, thought: str, query: str) -> str:
        if self.turns is not None:
            return f"<think> {thought} </think>\n{search_call(query)}" + self.turns.end_of_turn
        return _think_search(thought, query)

    def _answer_text(self, thought: str, answer: str) -> str:
        if self.turns is not None:
            return _think_answer(thought, answer) + self.turns.end_of_turn
        return _think_answer(thought, answer)

    def _guess(self, answer_type: str) -> str:
        return self.rng.choice(self.value_types[answer_type])

    def play(self, question: Mapping[str, Any], strategy: str,
             context: Sequence[Mapping[str, Any]] = ()) -> tuple[list[dict], str, int]:
        """(segments, final answer, number of searches). `context`: the prompt messages the
        tool turns are rendered after (tool_calls protocol)."""
        self.context = [dict(message) for message in context]
        if strategy == "good":
            return self._good(question)
        if strategy == "guess":
            answer = self._guess(question["answer_type"])
            text = self._answer_text(f"I will answer without searching. It may be {answer}.",
                                     answer)
            return [{"text": text, "trainable": True}], answer, 0
        if strategy == "sloppy":
            return self._sloppy(question)
        raise ValueError(f"unknown strategy {strategy!r}")

    def _good(self, question: Mapping[str, Any]) -> tuple[list[dict], str, int]:
        relations = str(question["relation"]).split("/")
        answer_type = str(question["answer_type"])
        segments: list[dict[str, Any]] = []
        query = str(question["subject"])
        searches = 0
        for hop, relation in enumerate(relations):
            last = hop == len(relations) - 1
            intro = (f"I need to find {query}." if hop == 0
                     else f"Now I need to search for {query}.")
            segments.append({"text": self._search_text(intro, query), "trainable": True})
            block, results = self._observe(query)
            searches += 1
            segments.append({"text": block, "trainable": False})
            value_type = answer_type if last else ("person" if relation in (
                "founder", "director") else "city")
            value = _read(results, relation, self.doc_facts, value_type)
            if value is None:  # nothing usable came back: fall back to a guess
                answer = self._guess(answer_type)
                segments.append({"text": self._answer_text(
                    f"The passage does not say. I will guess {answer}.", answer),
                    "trainable": True})
                return segments, answer, searches
            if last:
                segments.append({"text": self._answer_text(
                    f"The passage says {value}.", value), "trainable": True})
                return segments, value, searches
            query = value
        raise AssertionError("unreachable")

    def _sloppy(self, question: Mapping[str, Any]) -> tuple[list[dict], str, int]:
        subject = str(question["subject"])
        answer_type = str(question["answer_type"])
        relations = str(question["relation"]).split("/")
        choice = self.rng.random()
        if choice < 0.4:
            query = self.rng.choice(subject.split(" "))  # part of the name
        elif choice < 0.7:
            kind = self.entities[subject]["kind"]
            others = [n for n, e in self.entities.items() if e["kind"] == kind and n != subject]
            query = self.rng.choice(others)  # the wrong entity
        else:
            query = self.rng.choice(_VAGUE_QUERIES[answer_type])
        segments: list[dict[str, Any]] = [
            {"text": self._search_text(f"I will search for {query}.", query), "trainable": True}
        ]
        block, results = self._observe(query)
        segments.append({"text": block, "trainable": False})
        # answer from what came back: the final relation if stated, else any value of the type
        value = _read(results, relations[-1], self.doc_facts, answer_type)
        if value is None or value not in self.value_types[answer_type]:
            value = self._guess(answer_type)
        segments.append({"text": self._answer_text(f"I think the answer is {value}.", value),
                         "trainable": True})
        return segments, value, 1


def build_sft_rows(
    questions: Sequence[Mapping[str, Any]],
    search: SearchFn,
    world_meta: Mapping[str, Any],
    topk: int,
    mix: Mapping[str, float] | str = "good=0.4,guess=0.3,sloppy=0.3",
    seed: int = 0,
    show_progress: bool = False,
    turns: ToolTurns | None = None,
) -> list[dict[str, Any]]:
    """One demonstration per question, its strategy drawn from `mix`. `turns`: demonstrations
    in the tool_calls protocol (the prompt is then the rendered text, see the module's doc);
    None: Search-R1's tags."""
    weights = parse_mix(mix)
    builder = DemoBuilder(search, world_meta, topk, seed, turns)
    rng = random.Random(f"sft-mix-{seed}")
    names = list(weights)
    rows: list[dict[str, Any]] = []
    iterator: Any = questions
    if show_progress:
        from tqdm import tqdm

        iterator = tqdm(questions, desc="sft demonstrations", unit="q")
    for index, question in enumerate(iterator):
        strategy = rng.choices(names, weights=[weights[n] for n in names])[0]
        messages = protocol_prompt(str(question["question"]),
                                   "tags" if turns is None else "tool_calls")
        segments, answer, searches = builder.play(question, strategy, messages)
        row = {
            "data_source": DATA_SOURCE_MULTI if question["hops"] == 2 else DATA_SOURCE_SINGLE,
            "prompt": messages if turns is None else turns.prompt_text(messages),
            "segments": segments,
            "reward_model": {"style": "rule",
                             "ground_truth": {"target": [str(question["answer"])]}},
            "extra_info": {
                "split": "train",
                "index": index,
                "strategy": strategy,
                "answer": answer,
                "correct": answer == question["answer"],
                "searches": searches,
            },
        }
        if turns is not None:
            row["extra_info"]["protocol"] = "tool_calls"
        rows.append(row)
    return rows


def batched_search(searcher: Any, cache: dict[tuple[str, int], Any] | None = None) -> SearchFn:
    """A SearchFn over a Searcher that remembers results (a demo set repeats queries)."""
    cache = {} if cache is None else cache

    def search(queries: list[str], topk: int) -> list[list[tuple[dict[str, Any], float]]]:
        missing = [q for q in dict.fromkeys(queries) if (q, topk) not in cache]
        if missing:
            for query, result in zip(missing, searcher.search(missing, topk), strict=True):
                cache[(query, topk)] = result
        return [cache[(q, topk)] for q in queries]

    return search


def prefetch(searcher: Any, world_meta: Mapping[str, Any], topk: int) -> SearchFn:
    """Search every entity name in one batch first (the good strategy's queries), then serve
    from the cache: one encoder call instead of one per demonstration."""
    search = batched_search(searcher)
    search(sorted(world_meta["entities"]), topk)
    return search
