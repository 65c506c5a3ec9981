"""The loop side of `rollout.protocol: tool_calls` (docs/rollout.md, "Tool calls").

`ChatTurns` computes the tokens of the turns the environment inserts (a `tool` message, or a
corrective `user` message) from the model's own chat template, without ever re-tokenising an
earlier turn: the inserted text is the difference between rendering a conversation that ends
with an assistant message and rendering the same conversation with the new messages and the
next assistant header, plus whatever of the assistant turn's closing text (`<|im_end|>\\n` in
ChatML) the policy did not generate itself (generation stopped on the end-of-turn token, or on
where the model began writing a tool result itself). Only
that text is encoded, on its own, and appended after the generated ids, so the ids trained on
are exactly prompt ids + generated ids + inserted ids.

Templates with thinking blocks (Qwen3's) render an assistant message differently depending on
what follows it: the last one gets `<think>\n\n</think>\n\n` before its content, an earlier one
keeps or drops its reasoning depending on where the last user message is. Only the prompt
messages before the assistant turn and the text after its content are compared and used: the
assistant turn itself is never rendered into the ids (its generated tokens stand for it, think
block included, as generated), so how the template would re-render it does not matter.

`run_calculator` runs the synchronous tool; `search` calls are batched by the agent loop through
the existing RetrieverClient (services.rollout.agent).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from services.common.calculator import CalculatorError, evaluate, format_result
from services.common.tools import ToolSpec

log = logging.getLogger("forage.rollout.tools")

# Assistant content used to find where the template closes an assistant turn. Any text would
# do; this one cannot collide with what the template adds around it.
PLACEHOLDER = "FORAGE-ASSISTANT-TURN-PLACEHOLDER"


class TemplateError(ValueError):
    """The chat template cannot be extended by concatenation (see ChatTurns)."""


class ChatTurns:
    """Token ids of prompts and inserted turns for one tokenizer + chat template + tool set.

    Rules (checked, TemplateError otherwise): rendering a conversation with more messages must
    start with the rendering of the shorter one (a template that rewrites earlier turns when a
    later one arrives cannot be extended by concatenation), and the assistant turn must be
    closed by text that follows its content.
    """

    def __init__(self, tokenizer: Any, specs: Sequence[ToolSpec]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("rollout.protocol tool_calls needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.tools = [spec.schema() for spec in specs]
        closed = self.render([{"role": "user", "content": "q"}, self._assistant()], False)
        self.closer = closed[closed.rindex(PLACEHOLDER) + len(PLACEHOLDER):]
        ids = tokenizer.encode(self.closer, add_special_tokens=False) if self.closer else []
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        # The template's end-of-turn token: the first token of the closer when it is special
        # (<|im_end|> in ChatML). Generation stops on it as on `</tool_call>`.
        self.end_of_turn: str | None = None
        if ids and ids[0] in special:
            self.end_of_turn = tokenizer.convert_ids_to_tokens(ids[0])
        bare = self.render([{"role": "user", "content": "q"}], True, tools=False)
        self.shows_tools = self.render([{"role": "user", "content": "q"}], True) != bare
        if not self.shows_tools:
            log.warning("the chat template ignores tools=: the policy is not shown the tool "
                        "declarations (say them in the prompt)")

    def render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool,
               tools: bool = True) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools if tools else None, tokenize=False,
            add_generation_prompt=generation_prompt)
        return str(text)

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt as the template renders it with the tools, ending in the assistant header.
        Rendered to text and encoded once (what `apply_chat_template(tokenize=True)` does)."""
        return list(self.tokenizer.encode(self.render(messages, True), add_special_tokens=False))

    def inserted_text(self, context: Sequence[Mapping[str, Any]],
                      new_messages: Sequence[Mapping[str, Any]], generated_end: str = "") -> str:
        """Text that follows a generated assistant turn: the rest of the template's closer, the
        new messages and the next assistant header.

        `context` is the conversation before the assistant turn (the prompt messages). The
        assistant turn is rendered with a placeholder content: only what comes after it is
        used, so its content never matters and is never re-tokenised, and neither does how the
        template opens it (an empty `<think>` block on the last assistant message, Qwen3's).
        What is checked: the prompt messages render the same whether or not the new messages
        follow, and the assistant turn is closed the same way. `generated_end` is the text of
        the turn's last generated token when the turn ended on the end-of-turn token itself
        (EOS or a stop token id), so that it is not inserted twice.

        A template that moves the tool declarations to the last user message (Mistral's) renders
        the prompt differently once a user message follows; the new messages are then rendered
        without the declarations, which stay where the prompt put them (nothing generated or
        inserted before is rendered again either way).
        """
        try:
            return self._inserted(context, new_messages, generated_end, tools=True)
        except TemplateError:
            if not self.shows_tools:
                raise
            try:
                return self._inserted(context, new_messages, generated_end, tools=False)
            except TemplateError:
                pass
            raise

    def _inserted(self, context: Sequence[Mapping[str, Any]],
                  new_messages: Sequence[Mapping[str, Any]], generated_end: str,
                  tools: bool) -> str:
        before = [*context, self._assistant()]
        without = self.render(before, False, tools)
        with_new = self.render([*before, *new_messages], True, tools)
        head = self.render(context, False, tools) if context else ""
        ends = (without.rfind(PLACEHOLDER), with_new.rfind(PLACEHOLDER))
        role = new_messages[0].get("role") if new_messages else None
        if -1 in ends:
            raise TemplateError("the chat template drops the assistant message's content; the "
                                "turn cannot be appended by token concatenation")
        closed, tail = (without[ends[0] + len(PLACEHOLDER):],
                        with_new[ends[1] + len(PLACEHOLDER):])
        if not (without.startswith(head) and with_new.startswith(head)
                and tail.startswith(closed)):
            raise TemplateError("the chat template renders earlier turns differently once a "
                                f"{role!r} message follows; the turn cannot be appended by "
                                "token concatenation")
        after = tail[len(closed):]  # the new messages and the next assistant header
        if generated_end and closed.startswith(generated_end):
            closed = closed[len(generated_end):]
        return closed + after

    def inserted_ids(self, context: Sequence[Mapping[str, Any]],
                     new_messages: Sequence[Mapping[str, Any]], generated_end: str = "") -> list[int]:
        """`inserted_text` encoded on its own (special tokens of the template recognised)."""
        text = self.inserted_text(context, new_messages, generated_end)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @staticmethod
    def _assistant() -> dict[str, str]:
        return {"role": "assistant", "content": PLACEHOLDER}


def run_calculator(arguments: Mapping[str, Any]) -> tuple[str, bool]:
    """(observation text, ok). A refused expression is an observation, never an exception."""
    try:
        return format_result(evaluate(arguments.get("expression", ""))), True
    except CalculatorError as exc:
        return f"Error: {exc}", False


class ToolStats:
    """Per-tool calls, failures and latency of one trajectory (trajectory.extra['tools'])."""

    def __init__(self) -> None:
        self.by_tool: dict[str, dict[str, float]] = {}

    def record(self, tool: str, ok: bool, seconds: float, timeout: bool = False,
               retries: int = 0) -> None:
        """One call: `timeout` when it was answered by its tool's timeout (also a failure),
        `retries` the further attempts it took after transient failures."""
        entry = self.by_tool.setdefault(
            tool, {"calls": 0, "failures": 0, "timeouts": 0, "retries": 0, "seconds": 0.0})
        entry["calls"] += 1
        entry["failures"] += 0 if ok else 1
        entry["timeouts"] += 1 if timeout else 0
        entry["retries"] += retries
        entry["seconds"] = round(entry["seconds"] + seconds, 6)

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {name: dict(entry) for name, entry in self.by_tool.items()}


def timed_calculator(arguments: Mapping[str, Any]) -> tuple[str, bool, float]:
    started = time.perf_counter()
    text, ok = run_calculator(arguments)
    return text, ok, time.perf_counter() - started
