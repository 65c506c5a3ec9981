"""What each evaluation mode asks the model (Search-R1's baselines and its agent).

- `direct`: the question alone, no retrieval (Search-R1's "Direct Inference" row).
- `rag`: the top-k passages retrieved for the question, then the question (its "RAG" row);
  the passages are written as the agent's observations are (`Doc i(Title: ...) ...`).
- `agent`: the dataset's own Search-R1 prompt, played through the multi-turn search loop; with
  `--protocol tool_calls`, `TOOL_AGENT_TEMPLATE` instead (the dataset's prompt teaches
  `<search>` tags), rendered through the model's chat template with the `search` tool declared.

`direct` and `rag` ask for the answer inside `<answer>...</answer>`, so all three modes are
scored by the same rule as training (the last answer tag, Search-R1's normalisation); a model
that ignores the tags scores 0, as in Search-R1's own evaluation of its baselines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from services.common.formats import passages_to_string

MODES: tuple[str, ...] = ("direct", "rag", "agent")

DIRECT_TEMPLATE = (
    "Answer the given question. Provide the answer inside <answer> and </answer>, without "
    "detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)

RAG_TEMPLATE = (
    "Answer the given question using the documents below. Provide the answer inside <answer> "
    "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>.\n"
    "Documents:\n{documents}Question: {question}\n"
)


# The agent's prompt in `--protocol tool_calls`: the call format is spelled out because many
# chat templates (the tiny policy's, SmolLM2's) do not show the `tools=` declarations.
TOOL_AGENT_TEMPLATE = (
    "Answer the given question. You can search a knowledge base as many times as you want by "
    "calling the search tool: <tool_call>\n{{\"name\": \"search\", \"arguments\": "
    "{{\"query\": \"...\"}}}}\n</tool_call>. Its results come back as the tool's message. "
    "When you know the answer, give it inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)


def tool_agent_prompt(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": TOOL_AGENT_TEMPLATE.format(question=question)}]


def direct_prompt(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": DIRECT_TEMPLATE.format(question=question)}]


def rag_prompt(question: str, results: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The passages as Search-R1's observations show them, then the question."""
    return [{"role": "user", "content": RAG_TEMPLATE.format(
        question=question, documents=passages_to_string(results))}]
