"""Error attribution of `forage eval`: why an agent answer is wrong, from what it retrieved.

Each wrong agent answer (EM 0) gets the first class that explains it:

- `never_searched`: the trajectory retrieved nothing (no search, or only rejected queries);
- `evidence_misread`: some retrieved passage contains a gold answer, yet the answer is wrong;
- `bridge_missed`: a multi-hop question whose bridge entity some passage names (the first hop
  worked), but no passage contains the answer;
- `first_hop_missed`: no passage contains the answer, nor (multi-hop) a bridge entity;
- `other`: none of these can be told, e.g. no passage holds the answer and the dataset says
  nothing about the question's hops (or it is a comparison question, which has no bridge).

The two hop classes need to know the question's hops: the synthetic world's rows record them
(`extra_info.hops`, `extra_info.bridge`), and FlashRAG-style rows of MuSiQue, 2Wiki and HotpotQA
carry them in `metadata` (`support_of`). Without that, only `never_searched`, `evidence_misread`
and `other` are used.

This generalises bench/demo_errors.py, which classifies the demo's questions by their queries
(the synthetic world's subject and bridge names); here the evidence is what was retrieved, so
any dataset with gold answers can be attributed. "Contains" is whole-word containment after
Search-R1's answer normalisation (lower case, no punctuation, no articles), as sub-EM uses.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.formats import contains_answer

ERROR_CLASSES: tuple[str, ...] = ("never_searched", "first_hop_missed", "bridge_missed",
                                  "evidence_misread", "other")
_DOC = re.compile(r"Doc \d+\(Title: ")


@dataclass(frozen=True)
class Support:
    """What a dataset row says about a question's reasoning: its number of hops and the
    entities that bridge them (empty for single-hop and comparison questions)."""

    hops: int
    bridges: tuple[str, ...] = ()


# Whole-word containment after answer normalisation: the rule the rollout's retrieval-health
# "gold hit" uses too (services/common/formats.py), so the two agree on what a passage holds.
contains = contains_answer


def split_passages(observation: str) -> list[str]:
    """The passages of one information block (`Doc i(Title: ...) ...` lines); the whole text
    when it has no such lines."""
    parts = [p for p in _DOC.split(observation) if p.strip()]
    return parts or ([observation] if observation.strip() else [])


def attribute_error(searched: bool, passages: Sequence[str], golds: Sequence[str],
                    support: Support | None) -> str:
    """The class (ERROR_CLASSES) of one wrong answer; see the module docstring for the order."""
    if not searched:
        return "never_searched"
    if any(contains(p, g) for p in passages for g in golds):
        return "evidence_misread"
    if support is None:
        return "other"
    if support.hops >= 2:
        if not support.bridges:
            return "other"
        if any(contains(p, b) for p in passages for b in support.bridges):
            return "bridge_missed"
        return "first_hop_missed"
    return "first_hop_missed" if support.hops == 1 else "other"


def _texts(values: Any) -> list[str]:
    if isinstance(values, str):
        return [values]
    if isinstance(values, Sequence):
        return [str(v) for v in values if isinstance(v, str) and v.strip()]
    return []


def _hotpot(meta: Mapping[str, Any], question: str, golds: Sequence[str]) -> Support | None:
    """HotpotQA: bridge questions name their first entity; the supporting page the question
    does not name (and that is not the answer) is the bridge. Comparisons have no bridge."""
    facts = meta.get("supporting_facts")
    titles = _texts(facts.get("title") if isinstance(facts, Mapping) else
                    [f[0] for f in facts or [] if isinstance(f, Sequence) and f])
    titles = list(dict.fromkeys(titles))
    if not titles:
        return None
    if meta.get("type") != "bridge":
        return Support(hops=len(titles))
    bridges = tuple(t for t in titles if not contains(question, t)
                    and not any(contains(t, g) and contains(g, t) for g in golds))
    return Support(hops=max(2, len(titles)), bridges=bridges)


def _two_wiki(meta: Mapping[str, Any], golds: Sequence[str]) -> Support | None:
    """2WikiMultihopQA: `evidences` are (subject, relation, object) triples in hop order; in
    compositional and inference questions each object but the last is a bridge."""
    evidences = meta.get("evidences")
    if isinstance(evidences, Mapping):  # columnar {"fact": [...], "relation": [...], "entity": [...]}
        evidences = list(zip(evidences.get("fact") or [], evidences.get("relation") or [],
                             evidences.get("entity") or [], strict=False))
    triples = [t for t in evidences or [] if isinstance(t, Sequence) and len(t) == 3]
    if not triples:
        return None
    if meta.get("type") not in ("compositional", "inference"):
        return Support(hops=len(triples))
    bridges = tuple(str(t[2]) for t in triples[:-1]
                    if not any(contains(str(t[2]), g) and contains(g, str(t[2])) for g in golds))
    return Support(hops=len(triples), bridges=bridges)


def _plain(value: Any) -> Any:
    """Arrays (parquet columns come back as numpy arrays) as lists, recursively."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def support_of(row: Mapping[str, Any], question: str, golds: Sequence[str]) -> Support | None:
    """What a dataset row records about its hops, or None: the synthetic world's `extra_info`
    (hops, bridge), else FlashRAG's `metadata` (MuSiQue's decomposition, 2Wiki's evidences,
    HotpotQA's supporting facts). Metadata of another shape gives None: attribution then uses
    only the classes that need no hops, rather than failing the evaluation."""
    try:
        return _support(_plain(dict(row)), question, golds)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError):
        return None


def _support(row: Mapping[str, Any], question: str, golds: Sequence[str]) -> Support | None:
    extra = row.get("extra_info")
    if isinstance(extra, Mapping) and isinstance(extra.get("hops"), numbers.Integral):
        bridge = extra.get("bridge")
        return Support(int(extra["hops"]), (str(bridge),) if bridge else ())
    meta = row.get("metadata")
    if not isinstance(meta, Mapping):
        return None
    steps = meta.get("question_decomposition")
    if isinstance(steps, Sequence) and steps and all(isinstance(s, Mapping) for s in steps):
        answers = [str(s.get("answer") or "") for s in steps]
        return Support(len(steps), tuple(a for a in answers[:-1] if a.strip()))
    if meta.get("evidences") is not None:
        return _two_wiki(meta, golds)
    if meta.get("supporting_facts") is not None:
        return _hotpot(meta, question, golds)
    return None


def summarise(lines: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Counts and fractions (of the wrong answers) per class, from the lines' `error` field;
    None for a row whose lines carry none (direct and rag rows)."""
    marked = [line for line in lines if "error" in line]
    if not marked:
        return None
    wrong = [line["error"] for line in marked if line["error"] is not None]
    counts = {name: sum(1 for e in wrong if e == name) for name in ERROR_CLASSES}
    return {"wrong": len(wrong), "counts": counts,
            "fractions": {name: round(c / len(wrong), 6) if wrong else 0.0
                          for name, c in counts.items()},
            # wrong answers whose dataset row told the hops (the hop classes need it)
            "with_support": sum(1 for line in marked
                                if line["error"] is not None and line.get("support"))}
