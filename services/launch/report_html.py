"""`report/index.html`: one page with the summary, the plots, a few samples and the config.

The page is static and self-contained but for the PNGs beside it (relative links): no script,
no web font, no remote resource, so it reads the same offline, from a file:// URL, from an
artifact store or a copied directory. Every value from the run (question text, model output,
config) is HTML-escaped: generations are untrusted text.
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

from services.common.redact import redact
from services.launch.report import Row, eval_ci

SAMPLES_FILE = "samples.jsonl"
MAX_SAMPLES = 6  # "a handful": the newest evaluation's and the newest training step's
_CAPTIONS = {
    "reward_em.png": "Training reward and EM (faint: per step, bold: moving average) and "
                     "held-out EM with 95% Wilson intervals.",
    "per_source.png": "The same per data source, so a gain on one kind of question is not "
                      "hidden by the average.",
    "rl_health.png": "KL, entropy, clip fractions, gradient norm, staleness and throughput.",
    "probe_heatmap.png": "Probe accuracy by fraction of reasoning seen over training; the "
                         "number above each column is the trajectories probed at that step.",
    "probe_curve.png": "Probe curve at the start (dashed) and end (solid) of RL: faithful "
                       "reasoning starts low and rises.",
    "searches.png": "Searches and turns per trajectory.",
    "response_length.png": "Response length in tokens.",
    "retrieval.png": "Retrieval health: how often a passage held the gold answer, empty "
                     "results, repeated passages and queries, cache hits, and the latency of "
                     "the retrieval behind a search turn.",
}
_ORDER = ("reward_em.png", "probe_curve.png", "per_source.png", "rl_health.png",
          "retrieval.png", "probe_heatmap.png", "searches.png", "response_length.png")
# multi-panel: full width
_WIDE = ("per_source.png", "rl_health.png", "retrieval.png", "probe_heatmap.png")
# Retrieval health's rows: (name, label, what it counts); docs/learner.md defines each.
_RETRIEVAL_ROWS = (
    ("gold_hit_rate", "gold answer in a passage", "of the trajectories that searched"),
    ("empty_rate", "empty results", "of the search turns"),
    ("repeated_passage_rate", "repeated passages", "of the passages, seen earlier in the "
                                                   "trajectory"),
    ("repeated_query_rate", "repeated queries", "of the search turns"),
    ("latency_p50_ms", "latency p50 (ms)", "per search turn"),
    ("latency_p99_ms", "latency p99 (ms)", "per search turn"),
    ("cache_hit_rate", "cache hits", "of the search turns"),
    ("search_turns", "search turns", "with a result, per step or evaluation"),
)
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;
background:#fafafa;color:#222}
main{max-width:1180px;margin:0 auto;padding:18px 24px 40px}
h1{font-size:22px;margin:4px 0}h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ddd}
.sub{color:#666}.note{background:#fff4d6;border:1px solid #e8c96a;padding:8px 12px;margin:12px 0}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #ddd;padding:4px 10px;
text-align:left}th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:14px}
figure{margin:0;background:#fff;border:1px solid #ddd;padding:8px}
figure.wide{grid-column:1/-1}figure.wide img{max-width:1100px;margin:0 auto}
figure img{width:100%;height:auto;display:block}figcaption{color:#555;font-size:12.5px}
details{background:#fff;border:1px solid #ddd;margin:6px 0;padding:6px 10px}
summary{cursor:pointer}.ok{color:#1a7f37}.bad{color:#c62828}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f6f6;padding:8px;margin:4px 0;
font-size:12.5px}.turn{margin:6px 0 6px 12px}.docs{color:#555;font-size:12.5px}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _evidence_ems(summary: dict[str, Any], edge: str) -> str:
    """`0.80 / 0.20 / 0.30`: the evidence probe's EM per variant at the start or end."""
    values = [summary.get(f"evidence_{v}_em_{edge}") for v in ("real", "none", "swapped")]
    if all(v is None for v in values):
        return "n/a"
    return " / ".join(_num(v, 2) for v in values)


def _em_cell(row: Row | None, source: str | None = None) -> str:
    """`44.3% [36.3, 52.6] n=140`: EM with its 95% Wilson interval and n."""
    if row is None:
        return "n/a"
    found = eval_ci(row, source)
    if found is None:
        key = "eval/em" if source is None else f"eval/em/{source}"
        value = row.get(key)
        return _pct(value) if isinstance(value, (int, float)) else "n/a"
    em, low, high, n = found
    return f"{_pct(em)} <span class=sub>[{100 * low:.1f}, {100 * high:.1f}] n={n}</span>"


def _wall(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    minutes, rest = divmod(seconds, 60.0)
    return f"{int(minutes)}m {rest:04.1f}s"


def summary_table(summary: dict[str, Any], evals: list[Row]) -> str:
    first = evals[0] if evals else None
    last = evals[-1] if evals else None
    delta = summary.get("em_delta")
    rows = [
        (f"held-out EM ({_e(summary.get('eval_mode') or 'greedy')}), 95% CI",
         _em_cell(first), _em_cell(last)),
        ("EM change", "", "n/a" if delta is None else f"{100 * delta:+.1f} points"),
        ("searches per question (held-out)", _num(summary.get("searches_before"), 2),
         _num(summary.get("searches_after"), 2)),
        ("train reward (first / last 5 steps)", _num(summary.get("reward_first")),
         _num(summary.get("reward_last"))),
        ("train EM (first / last 5 steps)", _num(summary.get("train_em_first")),
         _num(summary.get("train_em_last"))),
        ("probe overconfidence", _num(summary.get("probe_overconf_start")),
         _num(summary.get("probe_overconf_end"))),
        ("RL steps / policy version", "", f"{summary.get('steps')} / "
                                          f"{summary.get('policy_version')}"),
        ("wall time", "", _wall(summary.get("wall_seconds"))),
    ]
    if "played_reward_first" in summary:  # the group filter ran: its batches hide the rest
        rows.insert(5, ("played reward / EM, dropped groups included (first / last 5 steps)",
                        f"{_num(summary.get('played_reward_first'))} / "
                        f"{_num(summary.get('played_em_first'))}",
                        f"{_num(summary.get('played_reward_last'))} / "
                        f"{_num(summary.get('played_em_last'))}"))
    if "evidence_real_em_end" in summary:  # probe.evidence ran (docs/probe.md)
        rows.insert(-2, ("evidence probe EM real / none / swapped",
                         _evidence_ems(summary, "start"), _evidence_ems(summary, "end")))
        rows.insert(-2, ("evidence gap (real - swapped EM)",
                         _num(summary.get("evidence_gap_start")),
                         _num(summary.get("evidence_gap_end"))))
    if summary.get("pass_after") is not None:  # sampled evaluation: some sample right
        rows.insert(1, (f"held-out pass@{_e(summary.get('eval_samples'))}",
                        _num(summary.get("pass_before")),
                        _num(summary.get("pass_after"))))
    if summary.get("malformed_lines"):
        rows.append(("skipped metrics lines", "", str(summary["malformed_lines"])))
    head = (f"<tr><th></th><th>before RL (step {_e(summary.get('em_before_step'))})</th>"
            f"<th>after RL (step {_e(summary.get('em_after_step'))})</th></tr>")
    body = "".join(f"<tr><td>{_e(name)}</td><td class=num>{before}</td>"
                   f"<td class=num>{after}</td></tr>" for name, before, after in rows)
    return f"<table id=summary>{head}{body}</table>"


def source_table(evals: list[Row], sources: list[str]) -> str:
    if not evals or not sources:
        return "<p class=sub>No per-data-source evaluation logged.</p>"
    body = "".join(f"<tr><td>{_e(s)}</td><td class=num>{_em_cell(evals[0], s)}</td>"
                   f"<td class=num>{_em_cell(evals[-1], s)}</td></tr>" for s in sources)
    return ("<table id=sources><tr><th>data source</th><th>held-out EM before</th>"
            f"<th>after</th></tr>{body}</table>")


def _retrieval_cell(name: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    if name.endswith("_rate"):
        return _pct(value)
    return f"{value:.1f}"


def retrieval_table(found: dict[str, Any] | None) -> str:
    """Retrieval health: first and last 5 train steps, the held-out evaluations before and
    after RL, and the last 5 steps per data source."""
    if not found:
        return ("<p class=sub>No retrieval health logged: no search returned a result (a "
                "single-turn task, or a run from before these metrics).</p>")
    sources = sorted(found.get("by_source") or {})
    head = ("<tr><th>metric</th><th>first 5 steps</th><th>last 5 steps</th>"
            "<th>held-out before</th><th>held-out after</th>"
            + "".join(f"<th>last 5 steps &middot; {_e(s)}</th>" for s in sources) + "</tr>")
    body = []
    for name, label, counted in _RETRIEVAL_ROWS:
        cells = [found["first"].get(name), found["last"].get(name),
                 (found.get("eval_before") or {}).get(name),
                 (found.get("eval_after") or {}).get(name),
                 *(found["by_source"][s]["last"].get(name) for s in sources)]
        body.append(f"<tr><td>{_e(label)} <span class=sub>{_e(counted)}</span></td>"
                    + "".join(f"<td class=num>{_retrieval_cell(name, v)}</td>" for v in cells)
                    + "</tr>")
    return f"<table id=retrieval>{head}{''.join(body)}</table>"


def read_samples(run_dir: Path, limit: int = MAX_SAMPLES) -> list[dict[str, Any]]:
    """The newest evaluation's and the newest training step's samples, up to `limit`."""
    path = run_dir / SAMPLES_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    picked: list[dict[str, Any]] = []
    for kind in ("eval", "train"):
        of_kind = [r for r in rows if r.get("kind") == kind]
        if of_kind:
            newest = max(r["step"] for r in of_kind)
            picked += [r for r in of_kind if r["step"] == newest][: limit // 2 or 1]
    return picked[:limit]


def sample_html(row: dict[str, Any], open_: bool = False) -> str:
    verdict = ("<span class=ok>correct</span>" if row.get("correct")
               else "<span class=bad>wrong</span>")
    truth = row.get("ground_truth")
    if isinstance(truth, dict) and "target" in truth:
        truth = truth["target"]
    turns = []
    for index, turn in enumerate(row.get("turns") or [], start=1):
        docs = "; ".join(f"{_e(d.get('id'))} &ldquo;{_e(d.get('title'))}&rdquo;"
                         for d in turn.get("docs") or [])
        query = f" &ldquo;{_e(turn['query'])}&rdquo;" if turn.get("query") else ""
        turns.append(f"<div class=turn><b>[{index}] {_e(turn.get('action'))}</b>{query}"
                     f"<pre>{_e(turn.get('text'))}</pre>"
                     + (f"<div class=docs>retrieved: {docs}</div>" if docs else "") + "</div>")
    probe = ""
    if row.get("probe_scores") and row.get("probe_fractions"):
        probe = "<div class=docs>probe: " + ", ".join(
            f"{f:.2f}&rarr;{s:.2f}" for f, s in zip(row["probe_fractions"], row["probe_scores"],
                                                     strict=False)) + "</div>"
    return (f"<details{' open' if open_ else ''}><summary>{_e(row.get('kind'))} step "
            f"{_e(row.get('step'))} &middot; {_e(row.get('data_source'))} &middot; "
            f"{_e(row.get('question'))} &rarr; <b>{_e(row.get('answer'))}</b> "
            f"(truth {_e(json.dumps(truth, ensure_ascii=False))}, reward "
            f"{float(row.get('reward', 0)):.2f}, {verdict})</summary>"
            f"<div class=sub>policy v{_e(row.get('policy_version'))}, finish "
            f"{_e(row.get('finish_reason'))}, reward components "
            f"{_e(json.dumps(row.get('reward_components')))}</div>{''.join(turns)}{probe}"
            "</details>")


def render(run_dir: Path, summary: dict[str, Any], plots: list[str],
           config: dict[str, Any] | None, evals: list[Row]) -> str:
    """The whole page as a string (pure but for reading samples.jsonl)."""
    from services.launch.report import data_sources

    title = summary.get("title") or run_dir.name
    note = ""
    if summary.get("quick"):
        note = ("<div class=note id=quick-note>This is <code>forage demo --quick</code>: it "
                "checks the plumbing at toy size (every service, stream, weight sync and this "
                "report) and does not learn &mdash; flat curves and an unchanged EM are "
                "expected. <code>forage demo</code> is the run that learns.</div>")
    ordered = [p for p in _ORDER if p in plots] + [p for p in plots if p not in _ORDER]
    figures = "".join(f"<figure{' class=wide' if name in _WIDE else ''}>"
                      f"<img src=\"{_e(name)}\" alt=\"{_e(name)}\">"
                      f"<figcaption>{_e(_CAPTIONS.get(name, name))}</figcaption></figure>"
                      for name in ordered)
    samples = read_samples(run_dir)
    samples_html = ("".join(sample_html(row, open_=index == 0)
                            for index, row in enumerate(samples))
                    or "<p class=sub>No samples.jsonl in the run directory (learner."
                       "log_samples_every writes it).</p>")
    config_text = ("(no config.yaml in the run directory)" if config is None else
                   _yaml(redact(config)))
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        "<meta name=viewport content=\"width=device-width,initial-scale=1\">"
        f"<title>{_e(title)} - forage report</title><style>{_CSS}</style></head><body><main>"
        f"<h1>{_e(title)}</h1><div class=sub>{_e(run_dir.resolve())} &middot; report written "
        f"{_e(generated)} by <code>forage report</code></div>{note}"
        f"<h2>Summary</h2>{summary_table(summary, evals)}"
        f"<h2>Per data source</h2>{source_table(evals, data_sources([], evals))}"
        f"<h2>Retrieval health</h2>{retrieval_table(summary.get('retrieval'))}"
        f"<h2>Plots</h2><div class=plots>{figures}</div>"
        f"<h2>Samples</h2>{samples_html}"
        f"<h2>Config</h2><details><summary>config.yaml</summary><pre id=config>"
        f"{_e(config_text)}</pre></details>"
        "</main></body></html>\n"
    )


def _yaml(config: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False)


def write_html(path: Path, run_dir: str | Path, summary: dict[str, Any], plots: list[str],
               config: dict[str, Any] | None, evals: list[Row]) -> Path:
    path.write_text(render(Path(run_dir), summary, plots, config, evals), encoding="utf-8")
    return path
