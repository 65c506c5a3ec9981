"""eval.json and eval.md from the per-question lines (pure but for writing the two files).

Rows are model x mode, columns the data sources in Search-R1's paper order (NQ, TriviaQA,
PopQA, HotpotQA, 2Wiki, Musique, Bamboogle; other sources after them by name), then the
average. As in the paper the average is the unweighted mean of the per-source EMs; eval.json
also keeps the pooled mean over all questions (`all`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.data_sources import SEARCH_R1_QA
from services.common.retrieval_health import TrajectoryHealth, pooled
from services.eval import errors, evidence, stats

INTERVALS = {
    "em": "Wilson score interval, 95%",
    "subem": "Wilson score interval, 95%",
    "f1": (f"percentile bootstrap of the mean, 95%, {stats.BOOTSTRAP_RESAMPLES} resamples, "
           f"seed {stats.BOOTSTRAP_SEED}"),
    "comparison": "exact McNemar (two-sided binomial sign test on the discordant questions)",
}
PAPER_NAMES = {"nq": "NQ", "triviaqa": "TriviaQA", "popqa": "PopQA", "hotpotqa": "HotpotQA",
               "2wikimultihopqa": "2wiki", "musique": "Musique", "bamboogle": "Bamboogle"}


def source_order(sources: Sequence[str]) -> list[str]:
    def key(source: str) -> tuple[int, str]:
        bare = source.removeprefix("searchR1_")
        return (SEARCH_R1_QA.index(bare) if bare in SEARCH_R1_QA else len(SEARCH_R1_QA), source)

    return sorted(set(sources), key=key)


def _r(value: float) -> float:
    return round(float(value), 6)


def _metric(lines: list[dict[str, Any]], name: str) -> tuple[float, list[float]]:
    values = [float(line[name]) for line in lines]
    if name == "f1":
        low, high = stats.bootstrap_interval(values)
    else:
        low, high = stats.wilson_interval(sum(1 for v in values if v >= 1), len(values))
    return _r(stats.mean(values)), [_r(low), _r(high)]


def summarise_row(label: str, model: str, mode: str, lines: list[dict[str, Any]],
                  sources: list[str]) -> dict[str, Any]:
    """One table row: EM, sub-EM, F1 (with intervals) per source, the macro average and the
    pooled value, and the behaviour figures."""
    out: dict[str, Any] = {"label": label, "model": model, "mode": mode, "n": {}}
    for name in ("em", "subem", "f1"):
        out[name], out[f"{name}_ci"] = {}, {}
    for field in ("searches", "turns", "response_tokens"):
        out[field] = {}
    groups = {source: [x for x in lines if x["data_source"] == source] for source in sources}
    groups = {source: members for source, members in groups.items() if members}
    for source, members in [*groups.items(), ("all", lines)]:
        out["n"][source] = len(members)
        for name in ("em", "subem", "f1"):
            out[name][source], out[f"{name}_ci"][source] = _metric(members, name)
        out["searches"][source] = _r(stats.mean([x["num_searches"] for x in members]))
        out["turns"][source] = _r(stats.mean([x["turns_count"] for x in members]))
        out["response_tokens"][source] = _r(stats.mean([x["response_tokens"] for x in members]))
    for name in ("em", "subem", "f1"):
        out[name]["average"] = _r(stats.mean([out[name][s] for s in groups]))
    reasons: dict[str, int] = {}
    for line in lines:
        reasons[line["finish_reason"]] = reasons.get(line["finish_reason"], 0) + 1
    out["finish_reasons"] = dict(sorted(reasons.items()))
    attributed = errors.summarise(lines)
    if attributed is not None:
        out["errors"] = attributed
    probe = evidence.summarise(lines)
    if probe is not None:
        out["evidence"] = probe
    health = retrieval_summary(lines)
    if health:
        out["retrieval"] = health
    return out


def retrieval_summary(lines: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Retrieval health of a row's agent lines, {metric: {source or "all": value}}; {} when no
    search returned a result. Only the reproducible rates: a replayed evaluation writes the
    same eval.json, so latency and cache hits (which differ between recording and replay by
    design) are left out; training's metrics carry them."""
    found = [TrajectoryHealth.from_counts(x["data_source"], x["retrieval"])
             for x in lines if x.get("retrieval")]
    out: dict[str, dict[str, float]] = {}
    for key, value in pooled(found, prefix="", timed=False).items():
        name, _, source = key.partition("/")
        out.setdefault(name, {})[source or "all"] = _r(value)
    return out


def compare(a: dict[str, Any], b: dict[str, Any], lines: dict[str, list[dict[str, Any]]],
            sources: list[str]) -> dict[str, Any]:
    """Paired EM comparison of rows a and b on the questions both answered."""
    left = {x["qid"]: x for x in lines[a["label"]]}
    right = {x["qid"]: x for x in lines[b["label"]]}
    shared = [qid for qid in left if qid in right]
    result: dict[str, Any] = {"a": a["label"], "b": b["label"]}
    for source in [*sources, "all"]:
        qids = [q for q in shared if source == "all" or left[q]["data_source"] == source]
        if qids:
            result[source] = stats.paired([left[q]["em"] for q in qids],
                                          [right[q]["em"] for q in qids])
            result[source]["difference"] = _r(result[source]["difference"])
    return result


def build(config: dict[str, Any], rows: list[tuple[str, str, str]],
          lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The eval.json document. `rows` = (label, model, mode) in table order."""
    sources = source_order([x["data_source"] for x in lines])
    by_row: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in rows}
    for line in lines:
        if line["row"] in by_row:
            by_row[line["row"]].append(line)
    for members in by_row.values():
        members.sort(key=lambda x: x["qid"])
    summaries = [summarise_row(label, model, mode, by_row[label], sources)
                 for label, model, mode in rows if by_row[label]]
    comparisons = [compare(summaries[i], summaries[j], by_row, sources)
                   for i in range(len(summaries)) for j in range(i + 1, len(summaries))]
    return {"config": config, "data_sources": sources, "intervals": INTERVALS,
            "rows": summaries, "comparisons": comparisons}


def _cell(row: dict[str, Any], source: str) -> str:
    return f"{row['em'][source]:.3f}" if source in row["em"] else "–"


def markdown(doc: dict[str, Any]) -> str:
    """Search-R1's table shape: methods as rows, datasets as columns, then the average."""
    sources = doc["data_sources"]
    names = [PAPER_NAMES.get(s.removeprefix("searchR1_"), s) for s in sources]
    lines = ["# forage eval", "",
             "Exact match (EM) per dataset; Avg. is the unweighted mean over datasets.", "",
             "| Method | " + " | ".join(names) + " | Avg. |",
             "|---|" + "---:|" * (len(sources) + 1)]
    for row in doc["rows"]:
        lines.append(f"| {row['label']} | " + " | ".join(_cell(row, s) for s in sources)
                     + f" | {row['em']['average']:.3f} |")
    lines += ["", "Per row, over all questions (95% intervals: EM and sub-EM Wilson, F1 "
              "bootstrap):", "",
              "| Method | n | EM | sub-EM | F1 | searches/q | turns/q | response tokens/q |",
              "|---|---:|---|---|---|---:|---:|---:|"]
    for row in doc["rows"]:
        def ci(name: str, row: dict[str, Any] = row) -> str:
            low, high = row[f"{name}_ci"]["all"]
            return f"{row[name]['all']:.3f} [{low:.3f}, {high:.3f}]"

        lines.append(f"| {row['label']} | {row['n']['all']} | {ci('em')} | {ci('subem')} | "
                     f"{ci('f1')} | {row['searches']['all']:.2f} | {row['turns']['all']:.2f} | "
                     f"{row['response_tokens']['all']:.1f} |")
    if doc["comparisons"]:
        lines += ["", "Paired comparisons on the same questions (EM; exact McNemar test):", "",
                  "| A | B | n | A right only | B right only | EM A − B | p |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for pair in doc["comparisons"]:
            every = pair.get("all")
            if every:
                lines.append(f"| {pair['a']} | {pair['b']} | {every['n']} | {every['a_only']} | "
                             f"{every['b_only']} | {every['difference']:+.3f} | "
                             f"{every['p_value']:.4g} |")
    lines += _retrieval_table(doc["rows"])
    lines += _errors_table(doc["rows"])
    lines += _evidence_table(doc["rows"], doc["config"].get("settings", {}))
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "–"
    return f"{value:+.3f}" if sign else f"{value:.3f}"


def _retrieval_table(rows: list[dict[str, Any]]) -> list[str]:
    """Retrieval health of the agent rows (services/common/retrieval_health.py), over all
    questions; eval.json keeps each data source's."""
    shown = [row for row in rows if "retrieval" in row]
    if not shown:
        return []
    out = ["", "Retrieval health (agent rows; per data source in eval.json): gold = a retrieved "
           "passage holds a gold answer (share of questions that searched), empty = search "
           "turns with no or only empty passages, repeated = passages and queries an earlier "
           "turn of the same question already had:", "",
           "| Method | search turns | gold in passages | empty results | repeated passages "
           "| repeated queries |", "|---|---:|---:|---:|---:|---:|"]
    for row in shown:
        r = row["retrieval"]

        def cell(name: str, r: dict[str, Any] = r) -> str:
            return _fmt(r.get(name, {}).get("all"))

        out.append(f"| {row['label']} | {int(r['search_turns']['all'])} | "
                   f"{cell('gold_hit_rate')} | {cell('empty_rate')} | "
                   f"{cell('repeated_passage_rate')} | {cell('repeated_query_rate')} |")
    return out


def _errors_table(rows: list[dict[str, Any]]) -> list[str]:
    """Why agent answers are wrong (services/eval/errors.py): count (fraction) per class."""
    shown = [row for row in rows if "errors" in row]
    if not shown:
        return []
    out = ["", "Wrong agent answers by cause (count, fraction of the wrong answers):", "",
           "| Method | wrong | " + " | ".join(errors.ERROR_CLASSES) + " |",
           "|---|---:|" + "---:|" * len(errors.ERROR_CLASSES)]
    for row in shown:
        e = row["errors"]
        cells = [f"{e['counts'][c]} ({e['fractions'][c]:.2f})" for c in errors.ERROR_CLASSES]
        out.append(f"| {row['label']} | {e['wrong']} | " + " | ".join(cells) + " |")
    return out


def _evidence_table(rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    """The evidence-reliance probe's table (agent rows probed with --evidence-probe)."""
    probed = [row for row in rows if "evidence" in row]
    if not probed:
        return []
    samples = settings.get("evidence_samples", "?")
    out = ["", f"Evidence reliance (Forage's probe): EM of the answer forced after the "
           f"trajectory's own reasoning with its information blocks real, empty or swapped "
           f"for another question's; {samples} sample(s) per variant at temperature 1:", "",
           "| Method | probed | skipped (no search) | real | none | swapped | real − none | "
           "real − swapped |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in probed:
        e = row["evidence"]
        acc, gap = e["accuracy"], e["gap"]
        out.append(f"| {row['label']} | {e['probed']} | {e['skipped_no_search']} | "
                   f"{_fmt(acc['real'])} | {_fmt(acc['none'])} | {_fmt(acc['swapped'])} | "
                   f"{_fmt(gap['real_minus_none'], True)} | "
                   f"{_fmt(gap['real_minus_swapped'], True)} |")
    return out


def write(out: Path, doc: dict[str, Any]) -> tuple[Path, Path]:
    paths = (out / "eval.json", out / "eval.md")
    for path, text in zip(paths, (json.dumps(doc, indent=1, sort_keys=True) + "\n",
                                  markdown(doc)), strict=True):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return paths
