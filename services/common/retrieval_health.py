"""Retrieval health: is the search the policy learns from any good? (docs/learner.md).

Two halves, both pure:

- per search turn, where the passages are at hand (the rollout's agent loop and `forage eval`,
  which plays the same loop): `turn_retrieval` counts the passages, the empty ones and whether
  any contains a gold answer, and keeps the call's latency and whether the retrieval cache
  answered; the result travels on the turn (`Turn.retrieval`, a few numbers, not the text);
- per step and data source, from finished trajectories (the learner; `forage eval`'s table):
  `trajectory_health` adds what needs the whole trajectory (a passage or a query repeated from
  an earlier turn) and `health_metrics` pools trajectories into rates.

Definitions (the denominators matter):
- gold hit rate: trajectories with a gold answer in some passage of some search turn, over the
  trajectories that got passages from at least one search and have gold answers;
- empty rate: search turns whose result has no passage or only empty ones, over search turns;
- repeated passage rate: passages whose id an earlier turn of the same trajectory already
  returned, over passages returned;
- repeated query rate: search turns whose normalised query equals an earlier search turn's in
  the same trajectory, over search turns;
- latency p50 / p99 (ms): of the retrieval call behind each search turn of the step;
- cache hit rate: search turns answered by the retrieval cache, over search turns.
"Search turn" here is a turn whose search returned a result (a query the retriever refused
has no passages to judge; `forage_rollout_rejected_queries_total` counts those).

Why the rollout judges gold: the ground truth reaches it with the prompt group, and there the
passages' text is in memory; anywhere later only their ids are.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.common.formats import gold_answers, normalize_answer
from services.common.trajectory import Trajectory, TurnRetrieval

PREFIX = "retrieval/"
# Metric names (after PREFIX), each also per data source as `<name>/<source>`.
RATES = ("gold_hit_rate", "empty_rate", "repeated_passage_rate", "repeated_query_rate",
         "cache_hit_rate")
LATENCIES = ("latency_p50_ms", "latency_p99_ms")
COUNTS = ("search_turns",)
NAMES = RATES + LATENCIES + COUNTS


def golds_of(ground_truth: Any) -> list[str] | None:
    """The normalised gold answers a passage is searched for; None when the ground truth has
    none the QA rewards can read (countdown's numbers, a custom reward's shape)."""
    try:
        golds = [normalize_answer(g) for g in gold_answers(ground_truth)]
    except ValueError:
        return None
    golds = [g for g in golds if g]
    return golds or None


def _contents(item: Mapping[str, Any]) -> str:
    """A /retrieve result item's passage text (either response shape)."""
    doc = item["document"] if "document" in item else item
    return str(doc.get("contents", "")) if isinstance(doc, Mapping) else ""


def is_empty(contents: str) -> bool:
    """A passage with nothing in it: whitespace and quotes only (a corpus row whose title and
    text are both empty becomes `""` plus a newline)."""
    return not contents.replace('"', "").strip()


def turn_retrieval(results: Sequence[Mapping[str, Any]], golds: Sequence[str] | None,
                   ms: float, cached: bool) -> TurnRetrieval:
    """One search's health from its /retrieve result. `golds` come from `golds_of` (already
    normalised): each passage is normalised once, whatever the number of golds."""
    texts = [_contents(item) for item in results]
    gold: bool | None = None
    if golds is not None:
        padded = [f" {normalize_answer(text)} " for text in texts]
        gold = any(f" {g} " in text for text in padded for g in golds)
    return TurnRetrieval(ms=float(ms), cached=bool(cached), passages=len(texts),
                         empty=sum(is_empty(text) for text in texts), gold=gold)


def merge(first: TurnRetrieval | None, second: TurnRetrieval) -> TurnRetrieval:
    """One turn with several search calls (tool_calls protocol): passages add up, the slowest
    call is the turn's latency, cached only if every call was, gold if any call found it."""
    if first is None:
        return second
    golds = [g for g in (first.gold, second.gold) if g is not None]
    return TurnRetrieval(ms=max(first.ms, second.ms), cached=first.cached and second.cached,
                         passages=first.passages + second.passages,
                         empty=first.empty + second.empty,
                         gold=any(golds) if golds else None)


@dataclass
class TrajectoryHealth:
    """One trajectory's retrieval counts: what `health_metrics` pools."""

    data_source: str
    searches: int = 0  # search turns with a result
    gold: bool | None = None  # None: no search with gold answers to look for
    empty_turns: int = 0
    passages: int = 0
    repeated_passages: int = 0
    repeated_queries: int = 0
    cached_turns: int = 0
    latencies_ms: list[float] = field(default_factory=list)

    def counts(self) -> dict[str, Any]:
        """The counts that do not depend on the clock or the cache (`forage eval`'s lines must
        be identical when a recorded evaluation is replayed)."""
        return {"searches": self.searches, "gold_hit": self.gold, "empty_turns": self.empty_turns,
                "passages": self.passages, "repeated_passages": self.repeated_passages,
                "repeated_queries": self.repeated_queries}

    @classmethod
    def from_counts(cls, data_source: str, counts: Mapping[str, Any]) -> TrajectoryHealth:
        return cls(data_source, searches=int(counts["searches"]), gold=counts["gold_hit"],
                   empty_turns=int(counts["empty_turns"]), passages=int(counts["passages"]),
                   repeated_passages=int(counts["repeated_passages"]),
                   repeated_queries=int(counts["repeated_queries"]))


def trajectory_health(trajectory: Trajectory) -> TrajectoryHealth:
    """The counts of one trajectory, from its search turns' `retrieval`, `docs` and `query`."""
    out = TrajectoryHealth(trajectory.data_source)
    seen_ids: set[str] = set()
    seen_queries: set[str] = set()
    golds: list[bool] = []
    for turn in trajectory.turns:
        found = turn.retrieval
        if turn.action != "search" or found is None:
            continue
        out.searches += 1
        out.passages += found.passages
        out.empty_turns += found.passages == 0 or found.empty == found.passages
        out.cached_turns += found.cached
        out.latencies_ms.append(found.ms)
        if found.gold is not None:
            golds.append(found.gold)
        ids = {doc["id"] for doc in turn.docs or []}
        out.repeated_passages += len(ids & seen_ids)
        seen_ids |= ids
        query = normalize_answer(turn.query or "")
        out.repeated_queries += query in seen_queries
        seen_queries.add(query)
    if golds:
        out.gold = any(golds)
    return out


def _rates(items: Sequence[TrajectoryHealth], timed: bool) -> dict[str, float]:
    """The rates of some trajectories' counts ({} when none searched); `timed` adds latency
    percentiles and the cache hit rate (not for `forage eval`'s reproducible table)."""
    searched = [h for h in items if h.searches]
    turns = sum(h.searches for h in searched)
    if not turns:
        return {}
    passages = sum(h.passages for h in searched)
    judged = [h.gold for h in searched if h.gold is not None]
    out: dict[str, float] = {
        "empty_rate": sum(h.empty_turns for h in searched) / turns,
        "repeated_query_rate": sum(h.repeated_queries for h in searched) / turns,
        "search_turns": float(turns),
    }
    if passages:
        out["repeated_passage_rate"] = sum(h.repeated_passages for h in searched) / passages
    if judged:
        out["gold_hit_rate"] = sum(judged) / len(judged)
    if timed:
        latencies = np.fromiter((ms for h in searched for ms in h.latencies_ms), dtype=np.float64)
        p50, p99 = np.percentile(latencies, (50, 99))
        out.update({"latency_p50_ms": float(p50), "latency_p99_ms": float(p99),
                    "cache_hit_rate": sum(h.cached_turns for h in searched) / turns})
    return out


def pooled(items: Iterable[TrajectoryHealth], prefix: str = PREFIX, timed: bool = True
           ) -> dict[str, float]:
    """`<prefix><name>` over all items and `<prefix><name>/<source>` per data source, pooled
    (a source with more search turns weighs more in the overall rate, as in `em/mean`)."""
    items = list(items)
    out = {f"{prefix}{name}": value for name, value in _rates(items, timed).items()}
    by_source: dict[str, list[TrajectoryHealth]] = defaultdict(list)
    for item in items:
        by_source[item.data_source].append(item)
    for source, group in sorted(by_source.items()):
        out.update({f"{prefix}{name}/{source}": value
                    for name, value in _rates(group, timed).items()})
    return out


def health_metrics(trajectories: Iterable[Trajectory], prefix: str = PREFIX
                   ) -> dict[str, float]:
    """The step's retrieval-health metrics (module docstring), overall and per data source;
    {} when no trajectory got a search result (single-turn tasks, records that predate it)."""
    return pooled((trajectory_health(t) for t in trajectories), prefix)
