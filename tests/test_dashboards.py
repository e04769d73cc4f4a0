"""Specification of the Grafana dashboards in dashboards/ (and their copies in the Helm chart).

Every metric a dashboard queries must be a documented name (docs/metrics.md) that the code really exports:
the names are read from `proxy.metrics.ProxyMetrics` and `pinned_backend.metrics.BackendMetrics` built on
fresh registries. Queries are parsed with a PromQL parser (promql-parser, installed by .ci/tools.sh), so a
query Prometheus would reject fails here too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import pytest
from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "dashboards"
CHART_DASHBOARDS = REPO / "helm" / "stackpin" / "dashboards"
METRICS_DOC = REPO / "docs" / "metrics.md"

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Labels Prometheus adds to every scraped series; a dashboard may group by them without the code exporting them.
TARGET_LABELS = {"instance", "job", "namespace", "pod", "service", "container", "endpoint"}

# --- PromQL --------------------------------------------------------------------------------------------------

# Grafana fills these in before the query reaches Prometheus; any duration parses the same.
_GRAFANA_INTERVALS = re.compile(
    r"\$(?:\{(?:__rate_interval|__interval|__range)\}|__rate_interval|__interval|__range)\b"
)
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<selector>.+?)\s*,\s*)?(?P<label>\w+)\s*\)\s*$")


def parse_query(expr: str) -> promql_parser.Expr:
    """A dashboard query as Prometheus parses it (raises ValueError on a syntax error)."""
    return promql_parser.parse(_GRAFANA_INTERVALS.sub("5m", expr))


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names its matchers use) for every series selector in the query."""
    found: list[tuple[str, set[str]]] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            labels = {matcher.name for matcher in node.matchers.matchers}
            assert node.name, f"select metrics by name, not through __name__ matchers: {expr}"
            found.append((node.name, labels))

    promql_parser.walk(parse_query(expr), visit)
    return found


def promql_metric_names(expr: str) -> set[str]:
    return {name for name, _ in selectors(expr)}


# --- the dashboards ------------------------------------------------------------------------------------------


def _dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, including those folded inside collapsed rows."""
    found: list[dict[str, Any]] = []
    for panel in board.get("panels", []):
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def _panel_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (panel.get("title", "?"), target["expr"])
        for panel in _panels(board)
        for target in panel.get("targets", [])
    ]


def _variable_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    queries = []
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        queries.append((variable["name"], query["query"] if isinstance(query, dict) else query))
    return queries


def queried_series(board: dict[str, Any]) -> list[tuple[str, str, set[str]]]:
    """(where, metric, labels its matchers use) for every metric any panel or variable of the board queries."""
    found = []
    for where, expr in _panel_queries(board):
        found += [(f"panel {where!r}", metric, labels) for metric, labels in selectors(expr)]
    for where, query in _variable_queries(board):
        match = _LABEL_VALUES.match(query)
        assert match is not None, f"variable {where!r}: expected label_values(...), got {query!r}"
        if match["selector"]:
            found += [
                (f"variable {where!r}", metric, labels | {match["label"]})
                for metric, labels in selectors(match["selector"])
            ]
    return found


# --- docs/metrics.md and the code ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DocumentedMetric:
    kind: str
    labels: frozenset[str]


def documented_metrics(markdown: str) -> dict[str, DocumentedMetric]:
    """The rows `| `name` | type | labels | meaning |` of docs/metrics.md's tables."""
    rows = re.findall(r"^\|\s*`([a-z_:][a-z0-9_:]*)`\s*\|\s*(\w+)\s*\|([^|]*)\|", markdown, flags=re.M)
    return {
        name: DocumentedMetric(kind, frozenset(label.strip() for label in labels.split(",") if label.strip()))
        for name, kind, labels in rows
    }


def exported_metric_names(registry: CollectorRegistry) -> set[str]:
    """The names a scrape shows, from the families on the registry (a labelled metric has no sample yet)."""
    names = set()
    for family in registry.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "info":
            names.add(f"{family.name}_info")
        else:
            names.add(family.name)
    return names


def base_name(metric: str, documented: dict[str, DocumentedMetric]) -> str:
    """A histogram's series `x_bucket`, `x_sum`, `x_count` belong to the documented histogram `x`."""
    for suffix in HISTOGRAM_SUFFIXES:
        stem = metric.removesuffix(suffix)
        if stem != metric and documented.get(stem, DocumentedMetric("", frozenset())).kind == "histogram":
            return stem
    return metric


# --- specifications --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("stackpin_replica_up", {"stackpin_replica_up"}),
        (
            'sum by (model, code) (rate(stackpin_requests_total{code=~"5..", model="$model"}[$__rate_interval]))',
            {"stackpin_requests_total"},
        ),
        ("histogram_quantile(0.95, sum(rate(x_bucket[5m])) by (le, instance))", {"x_bucket"}),
        ('a / on (instance) group_left (model) b{hardware!="cpu"} > bool 1e3', {"a", "b"}),
        ("count(max by (replica) (up offset 1h) == 0) or vector(0)", {"up"}),
        ('sum(increase(m{l="x and y"}[$__range])) unless ignoring (pod) n', {"m", "n"}),
        ('label_replace(vector(1), "a", "$1", "b", "(.*)")', set()),
    ],
)
def test_metric_names_are_read_from_the_parsed_query(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


def test_matcher_labels_are_read_per_selector() -> None:
    expr = (
        'sum by (le) (rate(h_bucket{model=~"$model", kernel_mode!="default"}[1m])) * on (instance) i{pod="p"}'
    )
    assert sorted(selectors(expr)) == [("h_bucket", {"model", "kernel_mode"}), ("i", {"pod"})]


@pytest.mark.parametrize("expr", ["sum(rate(x[$__rate_interval])", "rate(x)[5m]", 'x{a="b"', "sum by (le x)"])
def test_a_query_prometheus_would_reject_fails(expr: str) -> None:
    with pytest.raises(ValueError):
        parse_query(expr)


def test_metrics_doc_tables_are_read() -> None:
    documented = documented_metrics(METRICS_DOC.read_text())
    assert documented["stackpin_request_duration_seconds"] == DocumentedMetric(
        "histogram", frozenset({"endpoint", "fingerprint", "model", "kernel_mode", "hardware"})
    )
    assert documented["stackpin_audit_queue_depth"] == DocumentedMetric("gauge", frozenset())
    assert any(name.startswith("stackpin_backend_") for name in documented)


def test_there_are_dashboards_and_each_parses() -> None:
    files = _dashboard_files()
    assert len(files) >= 4, f"expected the four dashboards in {DASHBOARDS}, found {[f.name for f in files]}"
    uids = [_load(path)["uid"] for path in files]
    assert len(set(uids)) == len(uids), f"dashboard uids must be unique: {uids}"
    for path in files:
        board = _load(path)
        assert board["title"].startswith("stackpin / "), path.name
        assert _panel_queries(board), f"{path.name} has no queries"


@pytest.mark.parametrize("path", _dashboard_files(), ids=lambda p: p.name)
def test_datasource_is_a_template_variable_that_every_query_uses(path: Path) -> None:
    board = _load(path)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in _panels(board):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", f"{path.name}: panel {panel['title']!r}"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", f"{path.name}: panel {panel['title']!r}"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == "${datasource}", (
                f"{path.name}: variable {variable['name']!r}"
            )


@pytest.mark.parametrize("path", _dashboard_files(), ids=lambda p: p.name)
def test_panels_have_unique_ids_and_fit_the_grid_without_overlapping(path: Path) -> None:
    panels = _load(path)["panels"]  # rows are not collapsed: every panel has its own place on the grid
    ids = [panel["id"] for panel in panels]
    assert len(set(ids)) == len(ids), f"{path.name}: panel ids repeat"
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, (
            f"{path.name}: {panel['title']!r} leaves the grid"
        )
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{path.name}: {panel['title']!r} overlaps {taken[(x, y)]!r}"
                taken[(x, y)] = panel["title"]


@pytest.mark.parametrize("path", _dashboard_files(), ids=lambda p: p.name)
def test_every_query_parses_and_selects_a_metric(path: Path) -> None:
    for title, expr in _panel_queries(_load(path)):
        try:
            names = promql_metric_names(expr)
        except ValueError as e:
            pytest.fail(f"{path.name}: panel {title!r}: {e}: {expr}")
        assert names, f"{path.name}: panel {title!r} selects no metric: {expr}"


@pytest.mark.parametrize("path", _dashboard_files(), ids=lambda p: p.name)
def test_every_queried_metric_and_label_is_documented(path: Path) -> None:
    documented = documented_metrics(METRICS_DOC.read_text())
    for where, metric, labels in queried_series(_load(path)):
        name = base_name(metric, documented)
        assert name in documented, (
            f"{path.name}: {where} queries {metric}, which docs/metrics.md does not list"
        )
        allowed = documented[name].labels | TARGET_LABELS | ({"le"} if metric.endswith("_bucket") else set())
        assert labels <= allowed, (
            f"{path.name}: {where} matches {metric} on undocumented labels {labels - allowed}"
        )


def test_every_queried_metric_is_exported_by_the_code() -> None:
    # Imported here so that a missing module fails this test (and only this one) instead of skipping it.
    from pinned_backend.metrics import BackendMetrics
    from proxy.metrics import ProxyMetrics

    proxy_registry, backend_registry = CollectorRegistry(), CollectorRegistry()
    ProxyMetrics(proxy_registry)
    BackendMetrics(backend_registry)
    exported = exported_metric_names(proxy_registry) | exported_metric_names(backend_registry)
    documented = documented_metrics(METRICS_DOC.read_text())
    missing = {
        (path.name, base_name(metric, documented))
        for path in _dashboard_files()
        for _, metric, _ in queried_series(_load(path))
        if base_name(metric, documented) not in exported
    }
    assert not missing, f"dashboards query metrics the code does not export: {sorted(missing)}"


def test_exported_names_follow_the_scrape_format() -> None:
    from prometheus_client import Counter, Gauge, Histogram

    registry = CollectorRegistry()
    Counter("a_total", "counter", ["x"], registry=registry)
    Histogram("b_seconds", "histogram", registry=registry)
    Gauge("c", "gauge", registry=registry)
    assert exported_metric_names(registry) == {"a_total", "b_seconds", "c"}


@pytest.mark.parametrize(
    ("uid", "metrics"),
    [
        (
            "stackpin-fleet",
            {"stackpin_requests_total", "stackpin_request_duration_seconds", "stackpin_replica_up"},
        ),
        (
            "stackpin-reproducibility",
            {
                "stackpin_replays_total",
                "stackpin_quarantines_total",
                "stackpin_records_marked_total",
                "stackpin_replica_up",
            },
        ),
        (
            "stackpin-audit-store",
            {"stackpin_audit_commit_seconds", "stackpin_audit_batch_size", "stackpin_audit_queue_depth"},
        ),
        (
            "stackpin-backend",
            {
                "stackpin_backend_batch_size",
                "stackpin_backend_kv_cache_used_ratio",
                "stackpin_backend_tokens_total",
            },
        ),
    ],
)
def test_each_view_shows_what_it_is_for(uid: str, metrics: set[str]) -> None:
    documented = documented_metrics(METRICS_DOC.read_text())
    boards = {_load(path)["uid"]: _load(path) for path in _dashboard_files()}
    queried = {base_name(metric, documented) for _, metric, _ in queried_series(boards[uid])}
    assert metrics <= queried, f"{uid} does not show {sorted(metrics - queried)}"


def test_the_chart_ships_the_same_dashboards() -> None:
    top = {path.name: path.read_bytes() for path in _dashboard_files()}
    chart = {path.name: path.read_bytes() for path in sorted(CHART_DASHBOARDS.glob("*.json"))}
    assert sorted(chart) == sorted(top), (
        "helm/stackpin/dashboards/ must hold exactly the files of dashboards/"
    )
    differing = [name for name in top if top[name] != chart[name]]
    assert not differing, f"copy dashboards/*.json into helm/stackpin/dashboards/: {differing} differ"
