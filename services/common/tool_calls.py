"""Parse a policy turn's tool calls (docs/rollout.md, "Tool calls"), in the format its chat
template teaches (`detect_format`):

- Hermes (Qwen2.5, Qwen3, ChatML models fine-tuned on Hermes data): one block per call,
  several blocks in a turn,

      <tool_call>
      {"name": "search", "arguments": {"query": "Brixol"}}
      </tool_call>

- Llama 3.1 / 3.2 / 3.3 JSON tool calls: the turn is the call, `{"name": ..., "parameters":
  {...}}`, optionally after `<|python_tag|>`; several calls as a JSON list or separated by `;`.
- Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]` (v3 tokenizers),
  or `[TOOL_CALLS]name[ARGS]{...}` per call (newer tokenizers).

The text is sampled, so anything can be inside: every call becomes either a `ToolCall` (known
tool, arguments valid against its schema) or a `ToolCallError` whose `message` is written for
the model to read as the tool's answer. A bad call is the policy's mistake, to be seen and
learnt from; it never errors the trajectory. Pure functions: no I/O, nothing evaluated
(json only).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.tools import TOOL_REGISTRY, ToolSpec

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# The user turn a tool_calls policy gets after a turn that neither called a tool nor answered
# (the counterpart of Search-R1's corrective message in the tags protocol).
TOOL_CORRECTIVE_MESSAGE = (
    "Your previous message neither called a tool nor gave the final answer. To call a tool, "
    'write <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>. To give the '
    "final answer, write it between <answer> and </answer>."
)
# Longest raw call text quoted back to the model in an error message.
_QUOTE_CHARS = 200

ErrorKind = Literal["malformed_json", "not_a_call", "unknown_tool", "bad_arguments", "unterminated"]


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of a declared tool with arguments that match its schema; `id` is the
    call id the policy wrote (Mistral's), if any."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""
    id: str | None = None


@dataclass(frozen=True)
class ToolCallError:
    """A call that cannot run; `message` is the observation the model gets instead."""

    kind: ErrorKind
    message: str
    name: str | None = None
    raw: str = ""


Parsed = ToolCall | ToolCallError


@dataclass(frozen=True)
class TurnParse:
    """What one assistant turn did: its tool calls (in order) or its answer, or neither."""

    calls: list[Parsed] = field(default_factory=list)
    answer: str | None = None

    @property
    def action(self) -> Literal["tool", "answer", "invalid"]:
        if self.answer is not None:
            return "answer"
        return "tool" if self.calls else "invalid"


THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def after_reasoning(text: str) -> str:
    """The turn without its leading reasoning block: the text after the first `</think>` when
    the turn opens with `<think>` (whitespace before it allowed), else the turn as it is.
    Qwen3-style policies think before they act; what they write in the block (a draft
    `<answer>`, a `<tool_call>` they considered) is not an action. An unclosed block (the turn
    ran out of tokens while thinking) is not stripped: the turn is read as written."""
    start = len(text) - len(text.lstrip())
    if not text.startswith(THINK_OPEN, start):
        return text
    close = text.find(THINK_CLOSE, start + len(THINK_OPEN))
    return text if close == -1 else text[close + len(THINK_CLOSE):]


def parse_turn(text: str, specs: Sequence[ToolSpec],
               fmt: ToolCallFormat | None = None) -> TurnParse:
    """An answer wins if its `<answer>...</answer>` closes before the first tool call starts;
    otherwise every call of the turn is parsed, in order (an answer after a tool call is
    ignored: the call's result was not seen yet). A leading `<think>...</think>` block is
    reasoning, not an action (`after_reasoning`). `fmt`: the template's format (Hermes)."""
    fmt = fmt or HERMES
    text = after_reasoning(text)
    answer = _ANSWER.search(text)
    first_call = fmt.first_call(text)
    if answer is not None and (first_call == -1 or answer.end() <= first_call):
        return TurnParse(answer=answer.group(1).strip())
    if first_call == -1:
        return TurnParse()
    return TurnParse(calls=fmt.parse_calls(text[first_call:], specs))


def parse_tool_calls(text: str, specs: Sequence[ToolSpec]) -> list[Parsed]:
    """Every `<tool_call>...</tool_call>` block of `text`, in order, parsed and validated; an
    opened block that never closes (the turn ran out of tokens) is an `unterminated` error."""
    by_name = {spec.name: spec for spec in specs}
    parsed: list[Parsed] = [parse_call(m.group(1), by_name) for m in _BLOCK.finditer(text)]
    tail = text.rfind(TOOL_CALL_OPEN)
    if tail != -1 and text.find(TOOL_CALL_CLOSE, tail) == -1:
        raw = text[tail + len(TOOL_CALL_OPEN):]
        parsed.append(ToolCallError(
            "unterminated", f"Error: the tool call was not closed with {TOOL_CALL_CLOSE}.",
            raw=raw))
    return parsed


HERMES_EXAMPLE = '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>'


def parse_call(body: str, tools: Mapping[str, ToolSpec], example: str = HERMES_EXAMPLE
               ) -> Parsed:
    """One call's JSON text: `{"name": str, "arguments": object}` of a declared tool.
    `example` is how a call is written in the template's format (for the error message)."""
    raw = body.strip()
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        return _malformed(detail, raw, example)
    return call_from_payload(payload, raw, tools)


def _malformed(detail: str, raw: str, example: str) -> ToolCallError:
    return ToolCallError(
        "malformed_json",
        f"Error: the tool call is not valid JSON ({detail}): {_quote(raw)}. Write {example}.",
        raw=raw)


def call_from_payload(payload: Any, raw: str, tools: Mapping[str, ToolSpec]) -> Parsed:
    """A decoded call, `{"name": str, "arguments" (or Llama's "parameters"): object}`,
    checked against the declared tools."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCallError(
            "not_a_call",
            'Error: a tool call must be a JSON object with a "name" string and an '
            f'"arguments" object, got: {_quote(raw)}.', raw=raw)
    name = payload["name"]
    spec = tools.get(name)
    if spec is None:
        known = ", ".join(sorted(tools)) or "none"
        return ToolCallError("unknown_tool", f"Error: unknown tool {name!r}. Available tools: {known}.",
                             name=name, raw=raw)
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's wire format sends arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return ToolCallError("bad_arguments",
                             f'Error: the "arguments" of {name} must be a JSON object.',
                             name=name, raw=raw)
    problem = validate(arguments, spec.parameters)
    if problem is not None:
        return ToolCallError("bad_arguments", f"Error: bad arguments for {name}: {problem}.",
                             name=name, raw=raw)
    call_id = payload.get("id")
    return ToolCall(name, arguments, raw, call_id if isinstance(call_id, str) else None)


# ---------------------------------------------------------------- formats


def _json_values(text: str) -> tuple[list[tuple[Any, str]], str]:
    """The JSON values at the start of `text`, one after another (separated by whitespace,
    `;` or `,`), each with its source text; and what is left that is not one."""
    decoder = json.JSONDecoder()
    values: list[tuple[Any, str]] = []
    position = 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] in ";,"):
            position += 1
        if position >= len(text) or text[position] not in "[{":
            return values, text[position:]
        try:
            value, end = decoder.raw_decode(text, position)
        except (json.JSONDecodeError, RecursionError):
            return values, text[position:]
        values.append((value, text[position:end]))
        position = end


def _calls_from_json(text: str, tools: Mapping[str, ToolSpec], example: str) -> list[Parsed]:
    """Calls written as JSON objects or lists of them; text after them that is not JSON is
    one malformed call."""
    parsed: list[Parsed] = []
    values, rest = _json_values(text)
    for value, raw in values:
        items = value if isinstance(value, list) else [value]
        parsed.extend(call_from_payload(item, json.dumps(item) if isinstance(value, list)
                                        else raw, tools) for item in items)
    if rest.strip() or not values:
        try:
            json.loads(rest)
            detail = "not a call"
        except (json.JSONDecodeError, RecursionError) as exc:
            detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        parsed.append(_malformed(detail, rest.strip(), example))
    return parsed


def _hermes_calls(text: str, specs: Sequence[ToolSpec]) -> list[Parsed]:
    return parse_tool_calls(text, specs)


def _hermes_first(text: str) -> int:
    return text.find(TOOL_CALL_OPEN)


PYTHON_TAG = "<|python_tag|>"


def _llama_first(text: str) -> int:
    """Llama's call is the whole turn: JSON from its start, or after `<|python_tag|>`."""
    tag = text.find(PYTHON_TAG)
    if tag != -1:
        return tag
    body = text.lstrip()
    return len(text) - len(body) if body[:1] in ("{", "[") else -1


def _llama_calls(text: str, specs: Sequence[ToolSpec]) -> list[Parsed]:
    tools = {spec.name: spec for spec in specs}
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    return _calls_from_json(body, tools, LLAMA3_JSON.example)


MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _mistral_first(text: str) -> int:
    return text.find(MISTRAL_CALLS)


def _mistral_calls(text: str, specs: Sequence[ToolSpec]) -> list[Parsed]:
    """`[TOOL_CALLS] [{...}, ...]` (a JSON list), or `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`
    per call (the id optional)."""
    tools = {spec.name: spec for spec in specs}
    parsed: list[Parsed] = []
    for chunk in text.split(MISTRAL_CALLS)[1:]:
        body = chunk.strip()
        if body[:1] in ("[", "{") or MISTRAL_ARGS not in body:
            parsed.extend(_calls_from_json(body, tools, MISTRAL.example))
            continue
        head, _, arguments = body.partition(MISTRAL_ARGS)
        name, _, call_id = head.partition(MISTRAL_CALL_ID)
        values, rest = _json_values(arguments)
        if len(values) != 1 or rest.strip():
            parsed.append(_malformed("the arguments are not one JSON object", body,
                                     MISTRAL.example))
            continue
        payload = {"name": name.strip(), "arguments": values[0][0]}
        if call_id.strip():
            payload["id"] = call_id.strip()
        parsed.append(call_from_payload(payload, body, tools))
    return parsed


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family's chat template writes tool calls.

    `keep`: special tokens the parser reads (kept when a turn is decoded for parsing; every
    other special token is dropped). `stops`: text that ends a turn besides its end of turn,
    where the model starts writing a tool's result itself. `end_tokens`: further end-of-turn
    tokens of the family (Llama's `<|eom_id|>`, which it writes after a call)."""

    name: str
    example: str
    first_call: Callable[[str], int]
    parse_calls: Callable[[str, Sequence[ToolSpec]], list[Parsed]]
    keep: tuple[str, ...] = ()
    stops: tuple[str, ...] = ()
    end_tokens: tuple[str, ...] = ()

    @property
    def corrective(self) -> str:
        """The user turn after a turn that neither called a tool nor answered."""
        if self.name == "hermes":
            return TOOL_CORRECTIVE_MESSAGE
        return ("Your previous message neither called a tool nor gave the final answer. To "
                f"call a tool, write {self.example}. To give the final answer, write it "
                "between <answer> and </answer>.")


HERMES = ToolCallFormat("hermes", HERMES_EXAMPLE, _hermes_first, _hermes_calls,
                        stops=("<tool_response>",))
LLAMA3_JSON = ToolCallFormat("llama3_json", '{"name": "<tool name>", "parameters": {...}}',
                             _llama_first, _llama_calls, keep=(PYTHON_TAG,),
                             end_tokens=("<|eom_id|>",))
MISTRAL = ToolCallFormat("mistral", '[TOOL_CALLS] [{"name": "<tool name>", "arguments": {...}}]',
                         _mistral_first, _mistral_calls,
                         keep=(MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID),
                         stops=("[TOOL_RESULTS]",))
FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def detect_format(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template teaches, by the markers it writes: Mistral's `[TOOL_CALLS]`,
    Hermes' `<tool_call>`, Llama 3's `ipython` tool role; Hermes for a template that shows
    none (it then must be taught by the prompt, as for a template that ignores tools)."""
    template = chat_template or ""
    if MISTRAL_CALLS in template:
        return MISTRAL
    if TOOL_CALL_OPEN in template:
        return HERMES
    if "ipython" in template or PYTHON_TAG in template:
        return LLAMA3_JSON
    return HERMES


def validate(value: Any, schema: Mapping[str, Any]) -> str | None:
    """First problem of `value` against `schema` (None: valid). jsonschema when it is
    installed, else `validate_small`, which covers the keywords Forage's tools use."""
    try:
        import jsonschema
    except ImportError:  # not a runtime dependency of the rollout
        return validate_small(value, schema)
    validator = jsonschema.Draft202012Validator(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float), "null": (type(None),),
}


def validate_small(value: Any, schema: Mapping[str, Any], where: str = "") -> str | None:
    """A small JSON-schema subset: type, properties, required, additionalProperties (false),
    enum, items. Wording follows jsonschema's so both paths read alike to the model."""
    prefix = f"{where}: " if where else ""
    expected = schema.get("type")
    if expected is not None:
        types = [expected] if isinstance(expected, str) else list(expected)
        ok = any(isinstance(value, _TYPES[t]) and not (t in ("integer", "number")
                                                       and isinstance(value, bool))
                 for t in types if t in _TYPES)
        if not ok:
            return f"{prefix}{json.dumps(value)[:_QUOTE_CHARS]} is not of type {', '.join(map(repr, types))}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{prefix}{json.dumps(value)[:_QUOTE_CHARS]} is not one of {schema['enum']}"
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"{prefix}{key!r} is a required property"
        if schema.get("additionalProperties") is False:
            extra = sorted(set(value) - set(properties))
            if extra:
                return (f"{prefix}Additional properties are not allowed "
                        f"({', '.join(map(repr, extra))} {'was' if len(extra) == 1 else 'were'} unexpected)")
        for key, sub in properties.items():
            if key in value:
                problem = validate_small(value[key], sub, f"{where}/{key}".lstrip("/"))
                if problem is not None:
                    return problem
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            problem = validate_small(item, schema["items"], f"{where}/{index}".lstrip("/"))
            if problem is not None:
                return problem
    return None


def _quote(raw: str) -> str:
    return raw if len(raw) <= _QUOTE_CHARS else raw[:_QUOTE_CHARS] + "..."


# ---------------------------------------------------------------- whole trajectories
#
# The scorer reads a tool_calls response as text decoded with the template's special tokens
# kept (services/scorer/worker.py), so the turn structure is in the text: the rendering of
# assistant turn 1, the template's closer, the tool (or corrective user) messages, the next
# assistant header, assistant turn 2, and so on. The first turn's header is in the prompt.

# (assistant header, end of turn) of the chat formats whose turns these functions split:
# ChatML (Qwen2/2.5/3, SmolLM2, the tiny policy) and Llama 3.
TURN_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|im_start|>assistant\n", "<|im_end|>"),
    ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
)
# End-of-sequence tokens a turn may end with instead of its end of turn (a model with several
# EOS ids, e.g. the tiny policy's <|im_end|> and <|endoftext|>).
_OTHER_ENDS: tuple[str, ...] = ("<|endoftext|>", "<|end_of_text|>")
# Text of the template around messages, dropped from observations before they are read.
_TEMPLATE_TOKENS = re.compile(
    r"<\|im_start\|>(?:\w+)?\n?|<\|im_end\|>|<\|start_header_id\|>\w*<\|end_header_id\|>"
    r"|<\|eot_id\|>|<\|endoftext\|>|<\|end_of_text\|>|</?tool_response>")


@dataclass(frozen=True)
class ResponseTurns:
    """A tool_calls response split at the template's turn markers: the content of every
    assistant turn (the policy's text, without header and end of turn) and the text between
    them (the template's closers, tool results and headers: what the environment inserted)."""

    assistant: list[str]
    observations: list[str]


def split_response(text: str) -> ResponseTurns:
    """Split a decoded tool_calls response (special tokens kept) into its turns. A text
    without any known turn marker is one assistant turn (e.g. a bare `<answer>X</answer>`)."""
    for header, end in TURN_MARKERS:
        if end in text or header in text:
            break
    else:
        header, end = TURN_MARKERS[0]  # no turn marker: one turn (up to an EOS token)
    assistant: list[str] = []
    observations: list[str] = []
    for index, part in enumerate(text.split(header)):
        found = [at for at in (part.find(marker) for marker in (end, *_OTHER_ENDS)) if at != -1]
        close = min(found, default=-1)
        content, rest = (part, "") if close == -1 else (part[:close], part[close:])
        if index:
            observations[-1] += header
        assistant.append(content)
        observations.append(rest)
    observations.pop()  # whatever follows the last turn's end of turn belongs to no turn
    return ResponseTurns(assistant, observations)


def observation_text(raw: str) -> str:
    """An observation without the template's markers (role headers, end of turn,
    `<tool_response>`): the tool results as the model read them."""
    return _TEMPLATE_TOKENS.sub(" ", raw)


def final_answer(text: str) -> str | None:
    """The answer that ended a tool_calls trajectory: the last assistant turn's answer as the
    rollout reads it (`parse_turn`: an `<answer>...</answer>` that closes before the turn's
    first `<tool_call>`), stripped; None when the last turn did not answer. Earlier turns and
    tool results are never read (a passage quoting `<answer>X</answer>` is not the policy's).
    Linear in the text, as the scorer's tag scans are (services/scorer/rewards/text.py). A
    leading `<think>...</think>` block is reasoning: an answer drafted in it is not read."""
    turn = after_reasoning(split_response(text).assistant[-1])
    found = _first_block(turn, "<answer>", "</answer>")
    if found is None:
        return None
    first_call = turn.find(TOOL_CALL_OPEN)
    if first_call != -1 and found[1] > first_call:
        return None
    return found[2].strip()


def _first_block(text: str, opening: str, closing: str,
                 position: int = 0) -> tuple[int, int, str] | None:
    """(start, end, content) of the first `opening...closing` block from `position`: what
    the lazy regex finds, without its rescans from every unclosed opening tag."""
    start = text.find(opening, position)
    if start == -1:
        return None
    end = text.find(closing, start + len(opening))
    if end == -1:
        return None
    return start, end + len(closing), text[start + len(opening):end]


TurnKind = Literal["tool", "answer"]


def turn_format(content: str, specs: Sequence[ToolSpec] | None,
                open_names: bool = False) -> TurnKind | None:
    """What a well-formed assistant turn is, or None for an ill-formed one.

    "tool": an optional `<think>...</think>`, then one or more `<tool_call>` blocks, each a
    well-formed call (valid JSON `{"name", "arguments"}`, a declared tool, arguments valid
    against its schema: `parse_call`), nothing but whitespace around them. "answer": an
    optional `<think>...</think>`, then exactly one `<answer>...</answer>`, nothing after it
    (Search-R1's rule: text after `</answer>` is invalid). `specs` None: the built-in tools.
    `open_names`: a name outside `specs` (a tool the scorer cannot see, e.g. an MCP server's)
    is judged on the call's shape only.
    """
    body = content.strip()
    think = _first_block(body, "<think>", "</think>")
    if think is not None and think[0] == 0:
        body = body[think[1]:].strip()
    if "<think>" in body or "</think>" in body:
        return None
    if body.startswith("<answer>"):
        if (body.endswith("</answer>") and body.count("<answer>") == 1
                and body.count("</answer>") == 1 and TOOL_CALL_OPEN not in body):
            return "answer"
        return None
    if not body.startswith(TOOL_CALL_OPEN) or "<answer>" in body or "</answer>" in body:
        return None
    tools = {spec.name: spec for spec in (TOOL_REGISTRY.values() if specs is None else specs)}
    position = 0
    while position < len(body):
        block = _first_block(body, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, position)
        if block is None or body[position:block[0]].strip():
            return None  # an unclosed call, or text before or between the calls
        call = parse_call(block[2], tools)
        if isinstance(call, ToolCallError) and not (open_names and call.kind == "unknown_tool"):
            return None
        position = block[1]
        while position < len(body) and body[position].isspace():
            position += 1
    return "tool"


def well_formed_response(text: str, specs: Sequence[ToolSpec] | None = None,
                         open_names: bool = False) -> bool:
    """The tool_calls counterpart of Search-R1's structure rule: every assistant turn but the
    last is well-formed tool call(s), and the last one is exactly one answer (`turn_format`).
    An invalid turn (neither), a bad call (malformed JSON, unknown tool, bad arguments, an
    unclosed block) or a trajectory that did not end with an answer is ill-formed."""
    turns = split_response(text).assistant
    if turn_format(turns[-1], specs, open_names) != "answer":
        return False
    return all(turn_format(turn, specs, open_names) == "tool" for turn in turns[:-1])


def specs_from_schemas(schemas: Mapping[str, Any]) -> list[ToolSpec]:
    """ToolSpecs from `{name: JSON schema of the arguments}` (what the scorer passes rewards
    in `extra_info["tool_specs"]`); a schema that is not a mapping allows any arguments."""
    return [ToolSpec(str(name), "", dict(schema) if isinstance(schema, Mapping) else {})
            for name, schema in schemas.items()]
