"""The Grafana dashboard (deploy/grafana/dashboards/met.json) against a running control plane:
every metric and label its queries name is in what the control plane's /metrics serves, in the
Prometheus text format (no Accept header: curl, a browser) and in OpenMetrics (what Prometheus
3 asks for), once requests of both methods, some sharing a cached prefix, have run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

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
from tests.dashboards import FORMATS, Scrape, parse, scrape, total, unfilled

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "met.json"
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
    "vllm:kv_cache_usage_perc",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
}


def test_the_parser_reads_the_dashboards_kinds_of_query() -> None:
    expr = (
        'sum by (position) (rate(a:x_total{replica=~"$replica"}[$__rate_interval])) / '
        "ignoring (position) group_left sum(rate(b_total[5m])) + 1e3 * 0.5"
    )
    assert parse(expr) == ({"a:x_total", "b_total"}, {"position", "replica"})
    expr = "histogram_quantile(0.99, sum by (le) (rate(h_bucket[1m])))"
    assert parse(expr) == ({"h_bucket"}, {"le"})
    assert parse("count(up) and on (job) g") == ({"up", "g"}, {"job"})


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


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
        yield {fmt: scrape(url, accept) for fmt, accept in FORMATS.items()}
    finally:
        router.stop()


def _run(router: Router, reqs: list[GenRequest]) -> None:
    outs = [Outcome() for _ in reqs]
    for req, out in zip(reqs, outs, strict=True):
        router.submit(req, out, None, router.tokenizer)
    for out in outs:
        assert out.done.wait(60) and out.finish is not None, out.failure


def test_the_run_gave_speculation_and_prefix_cache_series(scrapes: dict[str, Scrape]) -> None:
    """What the queries are checked against has data behind every panel: accepted drafts by
    position, prefix hits, finished requests by reason, the replica up."""
    for scraped in scrapes.values():
        accepted = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        assert total(scraped, accepted, position="0") > 0
        assert total(scraped, "vllm:prefix_cache_hits_total") > 0
        assert total(scraped, "vllm:request_success_total", finished_reason="length") == 4
        assert total(scraped, "vllm:time_to_first_token_seconds_count") == 4
        assert total(scraped, "met:replica_up", replica="gpu-service-0:50051") == 1


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_query_names_series_the_control_plane_exports(
    dashboard: dict, scrapes: dict[str, Scrape], fmt: str
) -> None:
    problems, used = unfilled(dashboard, scrapes[fmt])
    assert not problems, problems
    assert REQUIRED <= used, sorted(REQUIRED - used)


def test_panels_have_unique_ids_and_queries(dashboard: dict) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), panel["title"]
