"""deploy/grafana: the dashboard queries only metrics and labels the code exports.

The exported metrics are read from the source (every prometheus_client Counter / Gauge /
Histogram / Summary constructed under services/, found with ``ast``), so a metric added or
renamed anywhere is seen without keeping a list here; one test cross-checks that reading against
the live prometheus_client registry. The README's prometheus-adapter rule is checked against the
rollout HPA it feeds.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "forage.json"
METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary"}
# Labels Prometheus attaches at scrape time, not the code.
TARGET_LABELS = {"job", "instance", "namespace", "pod"}
_METRIC_NAME = re.compile(r"\bforage_[a-z0-9_]+\b")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    labels: tuple[str, ...]
    source: str

    def series_names(self) -> set[str]:
        """The names prometheus_client exposes for this metric in the text format."""
        if self.kind == "Counter":
            base = self.name[: -len("_total")] if self.name.endswith("_total") else self.name
            return {f"{base}_total", f"{base}_created"}
        if self.kind == "Histogram":
            return {f"{self.name}_{s}" for s in ("bucket", "count", "sum", "created")}
        if self.kind == "Summary":
            return {self.name, *(f"{self.name}_{s}" for s in ("count", "sum", "created"))}
        return {self.name}

    def series_labels(self, series: str) -> set[str]:
        extra = {"le"} if series.endswith("_bucket") else set()
        return set(self.labels) | extra | ({"quantile"} if self.kind == "Summary" else set())


def _labelnames(call: ast.Call) -> tuple[str, ...]:
    node = next((kw.value for kw in call.keywords if kw.arg == "labelnames"), None)
    if node is None and len(call.args) >= 3:
        node = call.args[2]
    if isinstance(node, (ast.List, ast.Tuple)):
        return tuple(elt.value for elt in node.elts if isinstance(elt, ast.Constant))
    return ()


def exported_metrics() -> dict[str, Metric]:
    """Every forage_* metric constructed in services/, by exposed series name."""
    by_series: dict[str, Metric] = {}
    for path in sorted((REPO / "services").rglob("*.py")):
        text = path.read_text()
        if "prometheus_client" not in text or "proto_gen" in path.parts:
            continue  # collections.Counter and friends live in files without prometheus_client
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            kind = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            first = node.args[0]
            if kind in METRIC_TYPES and isinstance(first, ast.Constant) \
                    and isinstance(first.value, str) and first.value.startswith("forage_"):
                metric = Metric(first.value, kind, _labelnames(node),
                                str(path.relative_to(REPO)))
                for series in metric.series_names():
                    by_series[series] = metric
    return by_series


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _targets() -> list[tuple[str, dict]]:
    return [(panel["title"], target) for panel in _dashboard()["panels"]
            for target in panel.get("targets", [])]


def _labels_used(expr: str, legend: str) -> set[str]:
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {name.strip() for name in group.split(",") if name.strip()}
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    labels |= set(re.findall(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}", legend))
    return labels


def test_scanner_agrees_with_the_prometheus_registry() -> None:
    """The ast reading sees what prometheus_client registers (names, kinds, labels)."""
    from prometheus_client import REGISTRY

    import services.rollout.metrics
    import services.scorer.metrics  # noqa: F401

    exported = exported_metrics()
    families = [f for f in REGISTRY.collect()
                if f.name.startswith(("forage_rollout_", "forage_scorer_"))]
    assert len(families) >= 20
    for family in families:
        suffix = {"counter": "_total", "histogram": "_bucket"}.get(family.type, "")
        series = f"{family.name}{suffix}"
        assert series in exported, f"{series} ({family.type}) not found by the source scan"
        assert exported[series].kind.lower() == family.type


def test_dashboard_structure() -> None:
    dashboard = _dashboard()
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"], f"{panel['title']} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            expr = target["expr"]
            for open_, close in ("()", "[]", "{}"):
                assert expr.count(open_) == expr.count(close), f"{panel['title']}: {expr}"


def test_every_queried_metric_and_label_is_exported() -> None:
    exported = exported_metrics()
    problems = []
    for title, target in _targets():
        expr = target["expr"]
        names = set(_METRIC_NAME.findall(expr))
        assert names, f"{title}: {expr} queries no forage_ metric"
        missing = names - exported.keys()
        if missing:
            problems.append(f"{title}: {sorted(missing)} not exported by services/")
            continue
        known = set(TARGET_LABELS)
        for name in names:
            known |= exported[name].series_labels(name)
        unknown = _labels_used(expr, target.get("legendFormat", "")) - known
        if unknown:
            problems.append(f"{title}: labels {sorted(unknown)} not on {sorted(names)}")
    assert not problems, "\n".join(problems)


def test_dashboard_covers_each_service() -> None:
    used = {name for _, target in _targets() for name in _METRIC_NAME.findall(target["expr"])}
    for needed in ("forage_stream_lag", "forage_streams_dead_letters_total",
                   "forage_rollout_tokens_per_second", "forage_rollout_groups_total",
                   "forage_learner_policy_version", "forage_rollout_policy_version",
                   "forage_learner_reward_mean", "forage_learner_em_mean",
                   "forage_scorer_items_total", "forage_scorer_reward_mean",
                   "forage_retriever_requests_total", "forage_retriever_request_seconds_bucket",
                   "forage_rollout_weight_sync_seconds_bucket",
                   "forage_rollout_weight_sync_failures_total"):
        assert needed in used, f"no panel queries {needed}"


def test_retrieval_health_row_shows_every_retrieval_metric() -> None:
    """The "Retrieval health" row queries every forage_learner_retrieval_* gauge the learner
    exports (services/learner/loop_metrics.py), by data source: a gauge without a panel, or a
    panel removed, fails here."""
    panels = _dashboard()["panels"]
    start = next(i for i, p in enumerate(panels)
                 if p["type"] == "row" and p["title"] == "Retrieval health")
    rows_after = [i for i, p in enumerate(panels) if p["type"] == "row" and i > start]
    inside = panels[start + 1:rows_after[0] if rows_after else len(panels)]
    queried = {name for panel in inside for target in panel["targets"]
               for name in _METRIC_NAME.findall(target["expr"])}
    exported = {name for name in exported_metrics() if name.startswith("forage_learner_retrieval_")}
    assert len(exported) == 6, sorted(exported)  # five rates and the latency percentiles
    assert queried == exported, (sorted(exported - queried), sorted(queried - exported))
    for panel in inside:
        for target in panel["targets"]:
            assert "by (data_source)" in target["expr"], (panel["title"], target["expr"])
    latency = next(p for p in inside if "latency" in p["title"].lower())
    assert {re.search(r'quantile="([0-9.]+)"', t["expr"]).group(1)
            for t in latency["targets"]} == {"0.5", "0.99"}


def _adapter_rule() -> dict:
    text = (GRAFANA / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    rules = [yaml.safe_load(block) for block in blocks if "externalRules" in block]
    assert len(rules) == 1, "README.md should hold one externalRules block"
    (rule,) = rules[0]["externalRules"]
    return rule


def test_adapter_rule_serves_the_hpa_metric() -> None:
    hpa = yaml.safe_load((REPO / "deploy" / "k8s" / "rollout-hpa.yaml").read_text())
    (external,) = [m["external"] for m in hpa["spec"]["metrics"] if m["type"] == "External"]
    hpa_name = external["metric"]["name"]
    selector = external["metric"]["selector"]["matchLabels"]

    rule = _adapter_rule()
    assert rule["name"]["as"] == hpa_name
    assert re.fullmatch(rule["name"]["matches"], hpa_name)
    series = rule["seriesQuery"].split("{")[0]
    assert series == hpa_name
    assert "<<.LabelMatchers>>" in rule["metricsQuery"]
    grouped = re.search(r"by \(([^)]*)\)", rule["metricsQuery"]).group(1)
    for label in selector:
        assert label in rule["seriesQuery"] and label in grouped, label

    metric = exported_metrics().get(hpa_name)
    if metric is None:
        pytest.fail(f"{hpa_name} (the HPA's metric) is not exported by any service")
    assert set(selector) <= set(metric.labels), (metric.source, metric.labels)
