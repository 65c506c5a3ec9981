"""Which data sources have a reward function: the built-in table, shared by every service.

The scorer scores a trajectory with the reward functions of its `data_source`; a source with
none is a dead letter there, and a run whose dataset holds one would only time out. The table
lives here (not in services.scorer) so that `forage data check` and the learner can reject such
a dataset before anything runs, without importing the scorer: services never import each other.

A run can add sources, or replace a built-in source's functions, with `scorer.rewards` in its
config; `known_data_sources(rewards)` is the union the scorer of that run will accept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Search-R1's evaluation sets (its parquet `data_source` values) and verl's prefixed names.
SEARCH_R1_QA: tuple[str, ...] = (
    "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle",
)
SYNTHETIC_QA: tuple[str, ...] = ("synth_single", "synth_multihop")
MATH_SOURCES: tuple[str, ...] = (
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
    "math", "math_dapo", "aime24", "aime25", "aime2024", "aime2025", "amc23", "synth_math",
)
GSM8K_SOURCES: tuple[str, ...] = ("openai/gsm8k", "gsm8k")


def _builtin_sources() -> dict[str, str]:
    table: dict[str, str] = {}
    for name in SEARCH_R1_QA:
        table[name] = "qa_em"
        table[f"searchR1_{name}"] = "qa_em"
    for name in SYNTHETIC_QA:
        table[name] = "qa_em"
    for name in MATH_SOURCES:
        table[name] = "math_verify"
    for name in GSM8K_SOURCES:
        table[name] = "gsm8k"
    table["countdown"] = "countdown"
    return table


# data_source -> the built-in reward function that scores it (services.scorer registry names).
BUILTIN_DATA_SOURCES: dict[str, str] = _builtin_sources()


class UnknownDataSourceError(ValueError):
    """Data sources no reward function handles; the message names them and the known ones."""


def known_data_sources(rewards: Mapping[str, Any] | None = None) -> list[str]:
    """The built-in sources plus those a run's `scorer.rewards` adds, sorted."""
    return sorted(set(BUILTIN_DATA_SOURCES) | set(rewards or {}))


def check_data_sources(
    sources: Iterable[str], rewards: Mapping[str, Any] | None = None, where: str = ""
) -> None:
    """Raise UnknownDataSourceError naming every source in `sources` that nothing scores."""
    known = set(known_data_sources(rewards))
    unknown = sorted({str(s) for s in sources} - known)
    if not unknown:
        return
    names = ", ".join(repr(s) for s in unknown)
    plural = "s" if len(unknown) > 1 else ""
    prefix = f"{where}: " if where else ""
    raise UnknownDataSourceError(
        f"{prefix}no reward function for data_source{plural} {names}; known: "
        f"{', '.join(sorted(known))} (add one under scorer.rewards in the run config)"
    )
