"""Grafana dashboards against a scrape of /metrics: the metric and label names each query
reads (enough PromQL for the dashboards' queries), a scrape in either exposition format, and
what of a dashboard a scrape leaves empty."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families as text_families

# What Prometheus 3 sends by default (its scrape_protocols, names not escaped): OpenMetrics
# first. Asked for OpenMetrics without `escaping=allow-utf-8`, prometheus_client writes
# `met_...` for `met:...`, which the dashboards would not find.
PROMETHEUS_3_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)
FORMATS = {"text": None, "openmetrics": PROMETHEUS_3_ACCEPT}  # name -> Accept header

# PromQL, enough of it for the dashboards' queries: what names a label (matchers, grouping
# clauses), what is not a name (strings, ranges), and the words that are not metrics.
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_NAME = re.compile(r"(?<![\w.:])[A-Za-z_:][\w:]*(?![\w:])")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"and", "or", "unless", "bool", "offset"}
# A variable's `label_values(SELECTOR, LABEL)`, or `label_values(LABEL)`: any series.
_LABEL_VALUES = re.compile(r"^label_values\((?:(.+),\s*)?(\w+)\)$")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")

Scrape = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value)s


def parse(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names a PromQL expression mentions."""
    labels: set[str] = set()
    for matcher in _MATCHERS.findall(expr):
        labels |= set(_MATCHER_LABEL.findall(matcher))
    for grouping in _GROUPING.findall(expr):
        labels |= {x.strip() for x in grouping.split(",") if x.strip()}
    rest = _RANGES.sub(" ", _GROUPING.sub(" ", _MATCHERS.sub(" ", expr)))
    metrics = set()
    for m in _NAME.finditer(rest):
        is_call = rest[m.end() :].lstrip().startswith("(")
        if not is_call and m.group() not in _KEYWORDS:
            metrics.add(m.group())
    return metrics, labels


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(where, expression, legend) of every query: each panel's targets and each query
    variable's (a data source variable names no series)."""
    out = []
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            out.append((f"{panel['title']} {t['refId']}", t["expr"], t.get("legendFormat", "")))
    for var in dashboard["templating"]["list"]:
        if var.get("type", "query") != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        out.append((f"${var['name']}", query, ""))
    return out


def split_label_values(expr: str) -> tuple[str | None, set[str]]:
    """A variable's `label_values(...)`: its selector (None: any series) and its label; any
    other query as it is."""
    m = _LABEL_VALUES.match(expr.strip())
    return (m.group(1), {m.group(2)}) if m else (expr, set())


def scrape(url: str, accept: str | None) -> Scrape:
    """/metrics at `url` in the format `accept` asks (None: the Prometheus text format, as
    curl gets it), its content type checked."""
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read().decode()
        kind = response.headers["Content-Type"]
    if accept:
        assert kind.startswith("application/openmetrics-text; version=1.0.0"), kind
        assert "escaping=allow-utf-8" in kind, kind
    else:
        assert kind.startswith("text/plain; version=0.0.4"), kind
    families = openmetrics_families(body) if accept else text_families(body)
    out: Scrape = {}
    for family in families:
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def total(scrape: Scrape, name: str, **labels: str) -> float:
    return sum(v for got, v in scrape.get(name, []) if labels.items() <= got.items())


def unfilled(dashboard: dict, scraped: Scrape) -> tuple[list[str], set[str]]:
    """What of the dashboard's queries `scraped` leaves empty (a metric not served, a label on
    no series of the metrics it reads, a variable's label on no series), and the metrics its
    queries read."""
    problems: list[str] = []
    used: set[str] = set()
    for where, expr, legend in queries(dashboard):
        selector, labels = split_label_values(expr)
        if selector is None:
            carried = {label for series in scraped.values() for got, _ in series for label in got}
            problems += [f"{where}: label {label} on no series" for label in labels - carried]
            continue
        metrics, named = parse(selector)
        if not metrics:
            problems.append(f"{where}: no metric in {expr!r}")
            continue
        missing = sorted(m for m in metrics if m not in scraped)
        if missing:
            problems.append(f"{where}: {missing} not served")
            continue
        carried = {label for m in metrics for got, _ in scraped[m] for label in got}
        wanted = labels | named | set(_LEGEND.findall(legend))
        if not wanted <= carried:
            problems.append(f"{where}: labels {sorted(wanted - carried)} on no series")
        used |= metrics
    return problems, used
