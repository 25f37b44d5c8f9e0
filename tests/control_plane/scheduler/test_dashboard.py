"""The Grafana dashboard (deploy/grafana/dashboards/met.json) against a running control plane:
every metric and label its queries name is in what the control plane's /metrics serves, in the
Prometheus text format (no Accept header: curl, a browser) and in OpenMetrics (what Prometheus
3 asks for), once requests of both methods, some sharing a cached prefix, have run."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families as text_families

from control_plane.replicas.router import Router, parse_targets
from control_plane.scheduler.env import Env
from control_plane.scheduler.metrics import Metrics
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Joins, Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.params import MTP, NONE
from tests.collect import Outcome
from tests.conftest import TRAINED

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "met.json"
# What Prometheus 3 sends by default (its scrape_protocols, names not escaped): OpenMetrics
# first. Asked for OpenMetrics without `escaping=allow-utf-8`, prometheus_client writes
# `met_...` for `met:...`, which the dashboard would not find.
PROMETHEUS_3_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)
# The series the dashboard is for: serving, speculation, replicas, the KV pool and the prefix
# cache.
REQUIRED = {
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "vllm:spec_decode_num_drafts_total",
    "met:spec_decode_mean_accepted_length",
    "met:spec_decode_step_width",
    "met:replica_up",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
}

# PromQL, enough of it for the dashboard's queries: what names a label (matchers, grouping
# clauses), what is not a name (strings, ranges), and the words that are not metrics.
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_NAME = re.compile(r"(?<![\w.:])[A-Za-z_:][\w:]*(?![\w:])")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"and", "or", "unless", "bool", "offset"}
_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


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


def test_the_parser_reads_the_dashboards_kinds_of_query() -> None:
    expr = (
        'sum by (position) (rate(a:x_total{replica=~"$replica"}[$__rate_interval])) / '
        "ignoring (position) group_left sum(rate(b_total[5m])) + 1e3 * 0.5"
    )
    assert parse(expr) == ({"a:x_total", "b_total"}, {"position", "replica"})
    expr = "histogram_quantile(0.99, sum by (le) (rate(h_bucket[1m])))"
    assert parse(expr) == ({"h_bucket"}, {"le"})
    assert parse("count(up) and on (job) g") == ({"up", "g"}, {"job"})


def _queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(where, expression, legend) of every query: each panel's targets and each variable's."""
    out = []
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            out.append((f"{panel['title']} {t['refId']}", t["expr"], t.get("legendFormat", "")))
    for var in dashboard["templating"]["list"]:
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        out.append((f"${var['name']}", query, ""))
    return out


def _split_label_values(expr: str) -> tuple[str, set[str]]:
    """A variable's `label_values(SELECTOR, LABEL)`: the selector and the label; any other
    query as it is."""
    m = _LABEL_VALUES.match(expr.strip())
    return (m.group(1), {m.group(2)}) if m else (expr, set())


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


Scrape = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value)s


@pytest.fixture(scope="module")
def scrapes() -> Iterator[dict[str, Scrape]]:
    """A control plane's router and metrics over an in-process engine on a trained checkpoint
    (its drafts are accepted, so acceptance by position has series), /metrics served as
    `met control-plane serve --metrics-port` serves it, scraped over HTTP in both formats
    after MTP and plain requests, the later MTP ones going on from the first's prefix."""
    engine = Engine(TRAINED, ServiceConfig(verify_tiers="4:3", max_context=256, prefix_snapshots=2))
    metrics = Metrics()

    def build(address: str, authority: str | None, joins: Joins) -> Scheduler:
        return Scheduler(
            lambda: engine,
            ByteTokenizer.default(),
            SchedulerOptions(),
            Env(),
            metrics=metrics,
            replica=address,
            joins=joins,
        )

    router = Router(parse_targets("gpu-service-0:50051"), build)
    router.metrics = metrics
    router.start()
    try:
        prefix = tuple(range(5, 135))  # past two 64-token blocks: a snapshot to go on from
        _run(router, [GenRequest("first", (*prefix, 1), 12, method=MTP, ignore_eos=True)])
        _run(
            router,
            [
                GenRequest(f"mtp{i}", (*prefix, 2 + i), 12, method=MTP, ignore_eos=True)
                for i in (0, 1)
            ]
            + [GenRequest("none", (1, 2, 3), 8, method=NONE, ignore_eos=True)],
        )
        url = f"http://127.0.0.1:{metrics.serve(0)}/metrics"
        yield {"text": _scrape(url, None), "openmetrics": _scrape(url, PROMETHEUS_3_ACCEPT)}
    finally:
        router.stop()


def _run(router: Router, reqs: list[GenRequest]) -> None:
    outs = [Outcome() for _ in reqs]
    for req, out in zip(reqs, outs, strict=True):
        router.submit(req, out, None, router.tokenizer)
    for out in outs:
        assert out.done.wait(60) and out.finish is not None, out.failure


def _scrape(url: str, accept: str | None) -> Scrape:
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


def _total(scrape: Scrape, name: str, **labels: str) -> float:
    return sum(v for got, v in scrape.get(name, []) if labels.items() <= got.items())


def test_the_run_gave_speculation_and_prefix_cache_series(scrapes: dict[str, Scrape]) -> None:
    """What the queries are checked against has data behind every panel: accepted drafts by
    position, prefix hits, finished requests by reason, the replica up."""
    for scrape in scrapes.values():
        accepted = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        assert _total(scrape, accepted, position="0") > 0
        assert _total(scrape, "vllm:prefix_cache_hits_total") > 0
        assert _total(scrape, "vllm:request_success_total", finished_reason="length") == 4
        assert _total(scrape, "vllm:time_to_first_token_seconds_count") == 4
        assert _total(scrape, "met:replica_up", replica="gpu-service-0:50051") == 1


@pytest.mark.parametrize("fmt", ["text", "openmetrics"])
def test_every_query_names_series_the_control_plane_exports(
    dashboard: dict, scrapes: dict[str, Scrape], fmt: str
) -> None:
    scrape = scrapes[fmt]
    used: set[str] = set()
    for where, expr, legend in _queries(dashboard):
        selector, labels = _split_label_values(expr)
        metrics, named = parse(selector)
        assert metrics, f"{where}: no metric in {expr!r}"
        missing = sorted(m for m in metrics if m not in scrape)
        assert not missing, f"{where}: {missing} not in the control plane's /metrics"
        carried = {label for m in metrics for got, _ in scrape[m] for label in got}
        wanted = labels | named | set(_LEGEND.findall(legend))
        assert wanted <= carried, f"{where}: labels {sorted(wanted - carried)} on no series"
        used |= metrics
    assert REQUIRED <= used, sorted(REQUIRED - used)


def test_panels_have_unique_ids_and_queries(dashboard: dict) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), panel["title"]
