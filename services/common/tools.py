"""The tools a policy may call in `rollout.protocol: tool_calls` (docs/rollout.md, "Tool calls").

A tool is declared once here: its name, a description written for the model, and the JSON
schema of its arguments. The rollout renders the declarations through the model's own chat
template (`apply_chat_template(messages, tools=[...])`), parses and validates the calls
against the same schemas (services.common.tool_calls), and runs them (services.rollout.tools).
It lives in services/common so that a data builder, the scorer or the learner can read the
same declarations without importing the rollout service.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
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


# Names a tool may have: OpenAI's function-name rule, which chat templates and Hermes-trained
# models assume (no spaces or quotes that would break the rendered declarations).
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolRetry(Exception):
    """Raise from a user tool for a transient failure worth another attempt (as are OSError
    and its subclasses: ConnectionError, TimeoutError); any other exception is the tool's
    answer, reported to the model without a retry (docs/rollout.md, "Tool calls")."""


def check_tool_name(name: str) -> str | None:
    """Why `name` cannot be a tool name, or None."""
    if not TOOL_NAME.match(name):
        return f"tool name {name!r} must be 1-64 letters, digits, '_' or '-'"
    return None


def check_parameters(schema: Any) -> str | None:
    """Why `schema` cannot describe a call's arguments, or None. The arguments are a JSON
    object, so the schema must be one of an object; jsonschema (when installed) checks the
    rest of it against its metaschema, so a typo fails at config load, not on the first call."""
    if not isinstance(schema, Mapping):
        return "parameters must be a JSON schema (a mapping)"
    if schema.get("type") != "object":
        return 'parameters must be the JSON schema of an object ("type": "object")'
    try:
        import jsonschema
    except ImportError:  # the small validator takes any mapping
        return None
    try:
        jsonschema.Draft202012Validator.check_schema(dict(schema))
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path)
        return f"parameters are not a valid JSON schema ({where or 'top'}: {exc.message})"
    return None
