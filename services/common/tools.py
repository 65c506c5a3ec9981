"""The tools a policy may call in `rollout.protocol: tool_calls` (docs/rollout.md, "Tool calls").

A tool is declared once here: its name, a description written for the model, and the JSON
schema of its arguments. The rollout renders the declarations through the model's own chat
template (`apply_chat_template(messages, tools=[...])`), parses and validates the calls
against the same schemas (services.common.tool_calls), and runs them (services.rollout.tools).
It lives in services/common so that a data builder, the scorer or the learner can read the
same declarations without importing the rollout service.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolSpec:
    """One tool: `parameters` is a JSON schema of an object (the call's `arguments`)."""

    name: str
    description: str
    parameters: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function declaration chat templates expect in `tools=`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


SEARCH = ToolSpec(
    name="search",
    description=(
        "Search the knowledge base for passages about a query. Returns the top passages, "
        "each as `Doc i(Title: ...) text`."
    ),
    parameters={
        "type": "object",
        "properties": {"query": {"type": "string", "description": "What to search for."}},
        "required": ["query"],
        "additionalProperties": False,
    },
)

CALCULATOR = ToolSpec(
    name="calculator",
    description=(
        "Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses, "
        "e.g. \"(1907 - 1900) * 2\". Returns the value."
    ),
    parameters={
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "The arithmetic expression."}
        },
        "required": ["expression"],
        "additionalProperties": False,
    },
)

TOOL_REGISTRY: dict[str, ToolSpec] = {spec.name: spec for spec in (SEARCH, CALCULATOR)}

PROTOCOLS: tuple[str, ...] = ("tags", "tool_calls")


def tool_specs(names: Sequence[str]) -> list[ToolSpec]:
    """The declared tools of `names`, in that order; KeyError naming the unknown ones."""
    unknown = [name for name in names if name not in TOOL_REGISTRY]
    if unknown:
        raise KeyError(f"unknown tools {unknown}; known: {sorted(TOOL_REGISTRY)}")
    if len(set(names)) != len(names):
        raise KeyError(f"tools listed twice: {list(names)}")
    return [TOOL_REGISTRY[name] for name in names]
