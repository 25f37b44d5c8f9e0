"""vLLM's published Grafana dashboard, unmodified (tests/fixtures/vllm_grafana: its newest
version and the one before vLLM renamed TPOT and the cache usage), against `/metrics` on the
OpenAI port: after a few requests, every family and label its panels and its model picker
query is served, in both exposition formats, each series under the name `/v1/models` reports,
and the request-level families hold what the requests did."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from control_plane.cli.server import build_router
from control_plane.scheduler.metrics import MODEL, Metrics
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from met.main import build_parser
from tests.control_plane.fronts.test_openai_http import PROMPT, Fronts, serving
from tests.dashboards import FORMATS, Scrape, scrape, total, unfilled

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_grafana"
DASHBOARDS = sorted(FIXTURES.glob("grafana-*.json"))
# The request-level families vLLM's dashboard reads, each observed once per finished request.
PER_REQUEST = (
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_max_num_generation_tokens",
)


@pytest.fixture(scope="module")
def fronts(tiny_dir: Path) -> Iterator[Fronts]:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="2:3", max_context=512))
    with serving(engine, 4, Metrics()) as f:
        yield f


@pytest.fixture(scope="module")
def run(fronts: Fronts) -> tuple[int, int, int]:
    """A completion, one of two choices, a chat and a streamed completion: five requests to
    the scheduler. -> (requests, prompt tokens, generated tokens), as their usage counts them"""
    model, c = fronts.client.models.list().data[0].id, fronts.client
    more = {"ignore_eos": True}
    one = c.completions.create(model=model, prompt=PROMPT, max_tokens=6, extra_body=more)
    two = c.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=2, extra_body=more)
    chat = c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    streamed = c.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=more,
    )
    usages = [one.usage, two.usage, chat.usage, list(streamed)[-1].usage]
    choices = [1, 2, 1, 1]  # a reply's usage counts its prompt once, whatever its choices
    prompts, generated = 0, 0
    for usage, n in zip(usages, choices, strict=True):
        assert usage is not None
        prompts, generated = prompts + n * usage.prompt_tokens, generated + usage.completion_tokens
    return sum(choices), prompts, generated


@pytest.fixture(scope="module")
def scrapes(fronts: Fronts, run: tuple[int, int, int]) -> dict[str, Scrape]:
    url = f"{fronts.http.removesuffix('/v1')}/metrics"
    return {fmt: scrape(url, accept) for fmt, accept in FORMATS.items()}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_query_of_vllms_dashboard_is_served(
    scrapes: dict[str, Scrape], path: Path, fmt: str
) -> None:
    dashboard = json.loads(path.read_text())
    problems, used = unfilled(dashboard, scrapes[fmt])
    assert not problems, problems
    assert len({name.split(":")[1].removesuffix("_total") for name in used}) >= 15


def test_every_series_carries_the_served_models_name(
    fronts: Fronts, scrapes: dict[str, Scrape]
) -> None:
    name = fronts.client.models.list().data[0].id
    for scraped in scrapes.values():
        for sample, series in scraped.items():
            assert all(labels.get(MODEL) == name for labels, _ in series), sample


def test_the_request_families_hold_what_the_requests_did(
    scrapes: dict[str, Scrape], run: tuple[int, int, int]
) -> None:
    requests, prompt_tokens, generated = run
    for scraped in scrapes.values():
        for family in PER_REQUEST:
            assert total(scraped, f"vllm:{family}_count") == requests, family
        assert total(scraped, "vllm:request_prompt_tokens_sum") == prompt_tokens
        assert total(scraped, "vllm:request_generation_tokens_sum") == generated
        assert total(scraped, "vllm:request_prefill_time_seconds_sum") > 0
        assert total(scraped, "vllm:request_decode_time_seconds_sum") > 0
        e2e = total(scraped, "vllm:e2e_request_latency_seconds_sum")
        phases = ("queue", "prefill", "decode")
        assert e2e >= sum(total(scraped, f"vllm:request_{p}_time_seconds_sum") for p in phases)
        itl = total(scraped, "vllm:inter_token_latency_seconds_count")
        assert total(scraped, "vllm:time_per_output_token_seconds_count") == itl > 0
        ((_, usage),) = scraped["vllm:kv_cache_usage_perc"]
        assert scraped["vllm:gpu_cache_usage_perc"] == scraped["vllm:kv_cache_usage_perc"]
        assert 0 <= usage <= 1


def test_metrics_are_on_the_api_port_by_default() -> None:
    """`met control-plane serve` counts without `--metrics-port` (its HTTP front serves them),
    under the first `--served-model-name`."""
    serve = ["control-plane", "serve", "--gpu-service", "127.0.0.1:1"]
    plain = build_router(build_parser().parse_args(serve), None)
    named = build_router(build_parser().parse_args([*serve, "--served-model-name", "a", "b"]), None)
    assert plain.metrics is not None and plain.metrics.model_name is None
    assert named.metrics is not None and named.metrics.model_name == "a"
