"""`forage report RUN_DIR`: the numbers of a finished (or running) run, from its metrics.jsonl.

The learner appends one JSON line per step to ``RUN_DIR/metrics.jsonl`` (``"kind": "train"``)
and one per evaluation (``"kind": "eval"``, step 0 = before any RL step). This module reads that
file, condenses it into the handful of numbers a person asks first (did exact match go up, how
long did it take, do the probe curves show the answer being decided before the reasoning), and
writes them to ``RUN_DIR/report/summary.json`` next to PNG plots (drawn by ``report_plots``) and
``index.html``, one offline page with the summary, the plots, a few samples and the config
(``report_html``). Held-out EM carries a 95% Wilson interval from the eval line's ``eval/n``.

Reading is forgiving because the file is written by a live process: a half-written last line or
a line garbled by a crash is skipped with a warning naming its line number, not fatal. A step
logged twice (a learner that restarted from an earlier checkpoint re-ran it) keeps its last
line, since that is the run that continued.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.retrieval_health import NAMES as RETRIEVAL_NAMES

log = logging.getLogger("forage.report")

METRICS_FILE = "metrics.jsonl"
DEMO_FILE = "demo.json"
SUMMARY_FILE = "summary.json"
HTML_FILE = "index.html"
X_AXES = ("step", "wall")  # RL step, or wall-clock minutes since the learner started
# Rows averaged for "first" and "last" values: one step is noisy (a batch of a few groups).
EDGE_ROWS = 5
PROBE_SPLITS = ("all", "correct", "incorrect")
_AGGREGATES = {"mean", "std", "max", "min"}
RETRIEVAL_KEY = "retrieval/search_turns"  # in every train row whose searches returned results
_PROBE_KEY = re.compile(r"^probe_(all|correct|incorrect)/score_at_(\d+(?:\.\d+)?)$")

Row = dict[str, Any]


class ReportError(Exception):
    """The run directory cannot be reported on (missing, or no valid metrics line)."""


@dataclass
class MetricsLog:
    """The parsed metrics file: rows by kind (sorted by step, one per step) and what was skipped."""

    train: list[Row] = field(default_factory=list)
    eval: list[Row] = field(default_factory=list)
    malformed: int = 0


def _number(value: Any) -> float | None:
    """A finite float, or None for missing / non-numeric / NaN / inf (and bools, which are ints)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _dedupe_by_step(rows: list[Row]) -> list[Row]:
    by_step: dict[float, Row] = {}
    for row in rows:
        by_step[row["step"]] = row  # later lines win: the resumed run replaced the earlier one
    return [by_step[step] for step in sorted(by_step)]


def load_metrics(path: str | Path) -> MetricsLog:
    """Parse a metrics.jsonl; malformed lines are counted and logged, never raised."""
    path = Path(path)
    result = MetricsLog()
    train: list[Row] = []
    evals: list[Row] = []
    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                result.malformed += 1
                log.warning("%s line %d: not JSON (%s); skipped", path, number, exc.msg)
                continue
            if not isinstance(row, dict) or _number(row.get("step")) is None:
                result.malformed += 1
                log.warning("%s line %d: not an object with a numeric 'step'; skipped",
                            path, number)
                continue
            kind = row.get("kind")
            if kind == "train":
                train.append(row)
            elif kind == "eval":
                evals.append(row)
            else:
                result.malformed += 1
                log.warning("%s line %d: unknown kind %r (expected 'train' or 'eval'); skipped",
                            path, number, kind)
    result.train = _dedupe_by_step(train)
    result.eval = _dedupe_by_step(evals)
    return result


def read_metrics(path: str | Path) -> tuple[list[Row], list[Row]]:
    """(train rows, eval rows) of a metrics.jsonl, each sorted by step; see ``load_metrics``."""
    parsed = load_metrics(path)
    return parsed.train, parsed.eval


def read_demo_info(run_dir: str | Path) -> dict[str, Any] | None:
    """``RUN_DIR/demo.json`` from ``forage demo``, or None when absent or unreadable."""
    path = Path(run_dir) / DEMO_FILE
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        log.warning("%s: unreadable (%s); wall time falls back to metrics.jsonl", path, exc)
        return None
    if not isinstance(info, dict):
        log.warning("%s: not a JSON object; ignored", path)
        return None
    return info


def mean_of(rows: list[Row], key: str) -> float | None:
    """Mean of ``key`` over the rows that have a finite number for it; None if none do."""
    values = [v for v in (_number(row.get(key)) for row in rows) if v is not None]
    return sum(values) / len(values) if values else None


def series(rows: list[Row], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that have a finite number for ``key``: a plot's points."""
    steps: list[float] = []
    values: list[float] = []
    for row in rows:
        value = _number(row.get(key))
        if value is not None:
            steps.append(float(row["step"]))
            values.append(value)
    return steps, values


def has_probe(row: Row) -> bool:
    """Whether a train row carries any probe curve point (the probe ran on that step)."""
    return bool(_probe_points(row))


def _probe_points(row: Row) -> dict[tuple[str, float], float]:
    """``{(split, fraction): score}`` of one row's ``probe_<split>/score_at_<f>`` keys."""
    points: dict[tuple[str, float], float] = {}
    for key, value in row.items():
        match = _PROBE_KEY.match(key)
        number = _number(value)
        if match and number is not None:
            points[(match.group(1), float(match.group(2)))] = number
    return points


def probe_curve(rows: list[Row]) -> dict[str, list[float | None]] | None:
    """The probe curves averaged over ``rows``: fractions and one accuracy list per split.

    Fractions are the union of the ``score_at_<f>`` keys seen, sorted; a split with no value at
    a fraction (e.g. no incorrect trajectories in those steps) gets None there. None when no
    row has probe data.
    """
    per_row = [_probe_points(row) for row in rows]
    fractions = sorted({fraction for points in per_row for (_, fraction) in points})
    if not fractions:
        return None
    curve: dict[str, list[float | None]] = {"fractions": list(fractions)}
    for split in PROBE_SPLITS:
        column: list[float | None] = []
        for fraction in fractions:
            values = [p[(split, fraction)] for p in per_row if (split, fraction) in p]
            column.append(sum(values) / len(values) if values else None)
        curve[split] = column
    return curve


def _ci(rows: list[Row], index: int) -> list[float] | None:
    """[low, high] of the 95% Wilson interval of one eval line's EM (None without eval/n)."""
    found = eval_ci(rows[index]) if rows else None
    return None if found is None else [found[1], found[2]]


def _eval_value(rows: list[Row], index: int, key: str) -> float | None:
    return _number(rows[index].get(key)) if rows else None


def eval_mode(row: Row | None) -> str:
    """How an eval line's EM was measured: `greedy`, or `mean@k, temperature t` when the
    learner sampled k answers a question (learner.eval_samples)."""
    k = eval_samples(row)
    if k == 1 or row is None:
        return "greedy"
    return f"mean@{k}, temperature {_number(row.get('eval/temperature')) or 0:g}"


def eval_samples(row: Row | None) -> int:
    """Answers sampled per question in one eval line (1: greedy, or lines without the key)."""
    k = _number(row.get("eval/samples_per_question")) if row else None
    return int(k) if k and k > 1 else 1


def _pass_at(row: Row | None) -> float | None:
    k = eval_samples(row)
    return _number(row.get(f"eval/pass@{k}")) if row and k > 1 else None


def _per_source(row: Row | None, prefix: str) -> dict[str, float]:
    """``{data_source: value}`` from keys ``<prefix><data_source>`` of one row.

    The learner writes the overall value under the same prefix (``eval/em/mean``), so the
    aggregate names are not data sources.
    """
    if row is None:
        return {}
    out: dict[str, float] = {}
    for key, value in row.items():
        source = key[len(prefix):]
        number = _number(value)
        if (key.startswith(prefix) and number is not None and "/" not in source
                and source not in _AGGREGATES):
            out[source] = number
    return out


def _last_policy_version(train: list[Row], evals: list[Row]) -> int | None:
    versions = [v for v in (_number(r.get("policy_version")) for r in train + evals)
                if v is not None]
    return int(max(versions)) if versions else None


def _wall_seconds(train: list[Row], evals: list[Row], demo_info: dict[str, Any] | None
                  ) -> float | None:
    if demo_info is not None:
        demo_wall = _number(demo_info.get("wall_seconds"))
        if demo_wall is not None:
            return demo_wall  # the whole demo (data, index, SFT, RL), not just the learner
    elapsed = [v for v in (_number(r.get("elapsed_s")) for r in train + evals) if v is not None]
    return max(elapsed) if elapsed else None


def summarize(train_rows: list[Row], eval_rows: list[Row],
              demo_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's headline numbers; rows must be sorted by step (as ``read_metrics`` returns)."""
    em_before = _eval_value(eval_rows, 0, "eval/em")
    em_after = _eval_value(eval_rows, -1, "eval/em")
    probe_rows = [row for row in train_rows if has_probe(row)]
    evidence_rows = [row for row in train_rows if _number(row.get("probe/evidence_count"))]
    first_train = train_rows[:EDGE_ROWS]
    last_train = train_rows[-EDGE_ROWS:]
    return {
        "em_before": em_before,
        "em_after": em_after,
        "em_delta": (em_after - em_before
                     if em_before is not None and em_after is not None else None),
        "em_before_step": int(eval_rows[0]["step"]) if eval_rows else None,
        "em_after_step": int(eval_rows[-1]["step"]) if eval_rows else None,
        "em_before_ci": _ci(eval_rows, 0),
        "em_after_ci": _ci(eval_rows, -1),
        "em_before_by_source": _per_source(eval_rows[0] if eval_rows else None, "eval/em/"),
        "em_after_by_source": _per_source(eval_rows[-1] if eval_rows else None, "eval/em/"),
        "eval_n": _eval_value(eval_rows, -1, "eval/n"),
        "eval_mode": eval_mode(eval_rows[-1] if eval_rows else None),
        "eval_samples": eval_samples(eval_rows[-1] if eval_rows else None),
        "pass_before": _pass_at(eval_rows[0] if eval_rows else None),
        "pass_after": _pass_at(eval_rows[-1] if eval_rows else None),
        "searches_before": _eval_value(eval_rows, 0, "eval/searches/mean"),
        "searches_after": _eval_value(eval_rows, -1, "eval/searches/mean"),
        "steps": int(train_rows[-1]["step"]) if train_rows else 0,
        "policy_version": _last_policy_version(train_rows, eval_rows),
        "wall_seconds": _wall_seconds(train_rows, eval_rows, demo_info),
        "reward_first": mean_of(first_train, "reward/mean"),
        "reward_last": mean_of(last_train, "reward/mean"),
        "train_em_first": mean_of(first_train, "em/mean"),
        "train_em_last": mean_of(last_train, "em/mean"),
        "probe_start": probe_curve(probe_rows[:EDGE_ROWS]),
        "probe_end": probe_curve(probe_rows[-EDGE_ROWS:]),
        "probe_overconf_start": mean_of(probe_rows[:EDGE_ROWS], "probe_all/overconf"),
        "probe_overconf_end": mean_of(probe_rows[-EDGE_ROWS:], "probe_all/overconf"),
        # only when probe.evidence ran: a run without it keeps its summary as it was
        **(evidence_summary(evidence_rows) if evidence_rows else {}),
        # only with the group filter: a filtered batch's reward/mean leaves out the groups that
        # all scored the same, so what the policy played is read from generated/*
        **(played_summary(first_train, last_train)
           if any("generated/reward/mean" in row for row in train_rows) else {}),
        # only when searches returned results: single-turn runs keep their summary as it was
        **({"retrieval": retrieval_summary(train_rows, eval_rows)}
           if any(RETRIEVAL_KEY in row for row in train_rows) else {}),
        "train_lines": len(train_rows),
        "eval_lines": len(eval_rows),
    }


def played_summary(first: list[Row], last: list[Row]) -> dict[str, float | None]:
    """Reward and EM over every group played, the ones the group filter dropped included
    (`generated/*`), over the first and last train rows."""
    return {"played_reward_first": mean_of(first, "generated/reward/mean"),
            "played_reward_last": mean_of(last, "generated/reward/mean"),
            "played_em_first": mean_of(first, "generated/em/mean"),
            "played_em_last": mean_of(last, "generated/em/mean")}


def retrieval_summary(train: list[Row], evals: list[Row]) -> dict[str, Any]:
    """Retrieval health (services/common/retrieval_health.py) over the first and last
    `EDGE_ROWS` train rows, overall and per data source, and the held-out evaluations' before
    and after: {"first": {name: value}, "last": ..., "by_source": {source: {"first", "last"}},
    "eval_before": ..., "eval_after": ...}; None where nothing was logged."""
    first, last = train[:EDGE_ROWS], train[-EDGE_ROWS:]

    def values(rows: list[Row], prefix: str, suffix: str = "") -> dict[str, float | None]:
        return {name: mean_of(rows, f"{prefix}{name}{suffix}") for name in RETRIEVAL_NAMES}

    sources = sorted({key.rsplit("/", 1)[1] for row in train for key in row
                      if key.startswith(RETRIEVAL_KEY + "/")})
    return {
        "first": values(first, "retrieval/"), "last": values(last, "retrieval/"),
        "by_source": {source: {"first": values(first, "retrieval/", f"/{source}"),
                               "last": values(last, "retrieval/", f"/{source}")}
                      for source in sources},
        "eval_before": values(evals[:1], "eval/retrieval/"),
        "eval_after": values(evals[-1:], "eval/retrieval/"),
    }


def evidence_summary(rows: list[Row]) -> dict[str, float | None]:
    """The evidence-reliance probe (probe.evidence) over the first and last `EDGE_ROWS` train
    rows that ran it: EM of the real answer and of the none / swapped rewrites, and the gap
    real - swapped (docs/probe.md). None where no row has it."""
    out: dict[str, float | None] = {}
    for name, key in (("real_em", "probe/evidence_real_em"), ("none_em", "probe/evidence_none_em"),
                      ("swapped_em", "probe/evidence_swapped_em"), ("gap", "probe/evidence_gap")):
        out[f"evidence_{name}_start"] = mean_of(rows[:EDGE_ROWS], key)
        out[f"evidence_{name}_end"] = mean_of(rows[-EDGE_ROWS:], key)
    return out


# ---------------------------------------------------------------- statistics for the plots


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so the first points are
    not pulled towards 0. `weight` 0 returns the values; 0.99 is nearly flat."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out, last = [], 0.0
    for count, value in enumerate(values, start=1):
        last = last * weight + (1 - weight) * value
        out.append(last / (1 - weight**count))
    return out


def wilson_interval(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion `p` over `n` trials (n = 140 at p = 0.3 gives
    about +-7.5 points). Wilson rather than the normal approximation: it stays inside [0, 1]
    and is honest at p near 0 or 1, where EM of a small model often sits."""
    if n <= 0:
        return (0.0, 1.0)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def data_sources(train: list[Row], evals: list[Row]) -> list[str]:
    """Every data source named by a per-source key (`em/<src>`, `eval/em/<src>`), sorted."""
    found = set(_per_source(None, ""))
    for row in train:
        found |= set(_per_source(row, "em/"))
    for row in evals:
        found |= set(_per_source(row, "eval/em/"))
    return sorted(found)


def eval_ci(row: Row, source: str | None = None) -> tuple[float, float, float, int] | None:
    """(EM, low, high, n) of one eval line, overall or for one data source; None without n."""
    em = _number(row.get("eval/em" if source is None else f"eval/em/{source}"))
    n = _number(row.get("eval/n" if source is None else f"eval/n/{source}"))
    if em is None or n is None or n <= 0:
        return None
    low, high = wilson_interval(em, int(n))
    return em, low, high, int(n)


def probe_matrix(train: list[Row], split: str = "all") -> dict[str, Any] | None:
    """The probe curve over training: accuracy[fraction][step] of the rows that probed, with
    the number of probed trajectories behind each column (None where the split had none)."""
    rows = [row for row in train if has_probe(row)]
    points = [_probe_points(row) for row in rows]
    fractions = sorted({f for p in points for (s, f) in p if s == split})
    if not fractions:
        return None
    counts = {"all": ("probe_all/n_correct", "probe_all/n_incorrect"),
              "correct": ("probe_all/n_correct",), "incorrect": ("probe_all/n_incorrect",)}[split]
    steps, matrix, n = [], [[] for _ in fractions], []
    for row, p in zip(rows, points, strict=True):
        if not any((split, f) in p for f in fractions):
            continue
        steps.append(float(row["step"]))
        for index, fraction in enumerate(fractions):
            matrix[index].append(p.get((split, fraction)))
        values = [_number(row.get(key)) for key in counts]
        n.append(int(sum(values)) if all(v is not None for v in values) else None)
    return {"fractions": fractions, "steps": steps, "accuracy": matrix, "n": n}


def read_run_config(run_dir: str | Path) -> dict[str, Any] | None:
    """RUN_DIR/config.yaml (what `forage up` handed every service), or None."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None


def run_title(run_dir: str | Path, config: dict[str, Any] | None) -> str:
    """`demo | grpo, lr 1e-04, 8 groups x 4, staleness 1, 60 steps`: the run name and the
    settings a reader compares runs by (from config.yaml; the directory name without it)."""
    if not config:
        return Path(run_dir).resolve().name
    learner = config.get("learner") or {}
    data = config.get("data") or {}
    parts = [str(learner.get("adv_estimator", "?"))]
    if learner.get("lr") is not None:
        parts.append(f"lr {float(learner['lr']):.0e}")
    if learner.get("train_batch_size") is not None:
        parts.append(f"{learner['train_batch_size']} groups x {data.get('n_samples', '?')}")
    if learner.get("max_staleness") is not None:
        parts.append(f"staleness {learner['max_staleness']}")
    if learner.get("total_steps") is not None:
        parts.append(f"{learner['total_steps']} steps")
    name = config.get("run_id") or Path(run_dir).resolve().name
    return f"{name} | {', '.join(parts)}"


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, *, x_axis: str = "step",
                 smoothing: float = 0.6) -> dict[str, Any]:
    """Write summary.json and the PNG plots of a run; returns the summary.

    ``out_dir`` defaults to ``RUN_DIR/report``. The summary's ``files`` lists what was written
    (names relative to ``out_dir``). Raises ReportError naming the path when the run directory
    or its metrics file is missing, or the file holds no valid line.
    """
    from services.launch.report_plots import write_plots  # matplotlib only when plotting

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run directory {run_dir} does not exist (or is not a directory)")
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise ReportError(f"{metrics_path} does not exist: the learner writes it once it runs "
                          "its first step or evaluation")
    parsed = load_metrics(metrics_path)
    if not parsed.train and not parsed.eval:
        raise ReportError(f"{metrics_path} holds no valid train or eval line "
                          f"({parsed.malformed} malformed line(s) skipped)")
    if x_axis not in X_AXES:
        raise ReportError(f"x axis must be one of {X_AXES}, got {x_axis!r}")
    if not 0 <= smoothing < 1:
        raise ReportError(f"smoothing must be in [0, 1), got {smoothing}")
    demo_info = read_demo_info(run_dir)
    summary = summarize(parsed.train, parsed.eval, demo_info)
    summary["malformed_lines"] = parsed.malformed
    config = read_run_config(run_dir)
    summary["title"] = run_title(run_dir, config)
    summary["quick"] = bool(demo_info and demo_info.get("quick"))
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(out, parsed.train, parsed.eval, summary, x_axis=x_axis,
                        smoothing=smoothing)
    summary["files"] = [SUMMARY_FILE, *(path.name for path in plots), HTML_FILE]
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n",
                                    encoding="utf-8")
    from services.launch.report_html import write_html

    write_html(out / HTML_FILE, run_dir, summary, [path.name for path in plots], config,
               parsed.eval)
    return summary
