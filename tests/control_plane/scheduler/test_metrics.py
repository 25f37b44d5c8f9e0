"""The metrics vLLM's dashboard reads, without a service: token counts in vLLM's 1-2-5
buckets up to the served context, a finished request's intervals, every series under its
model's name and vLLM's names (former ones too), and the KV pool's usage as the service counts
it."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from control_plane.scheduler.metrics import MODEL, Metrics, Retired, buckets_1_2_5
from control_plane.scheduler.scheduler import Scheduler
from protos.model import Capabilities
from tests.fake_model import FakeModel


def served(metrics: Metrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """What /metrics serves: sample name -> (labels, value)s."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.exported).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(metrics: Metrics, name: str) -> float:
    ((_, v),) = served(metrics)[name]
    return v


def test_token_count_buckets_are_vllms() -> None:
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(262144)[-3:] == (50000, 100000, 200000)


@pytest.mark.parametrize(
    ("times", "phases"),
    [
        ((10.0, 11.0, 11.5, 13.5, 14.0), {"queue": 1.0, "prefill": 0.5, "decode": 2.0}),
        ((10.0, 11.0, None, None, 11.25), {"queue": 1.0, "prefill": None, "decode": None}),
    ],
    ids=["served", "cancelled-before-its-first-token"],
)
def test_a_finished_requests_intervals(
    times: tuple[float, float, float | None, float | None, float], phases: dict[str, float | None]
) -> None:
    metrics = Metrics()
    series = metrics.replica("r")
    series.connected("m", 512)
    series.record_retired(Retired(30, 7, *times))
    assert value(metrics, "vllm:e2e_request_latency_seconds_sum") == times[4] - times[0]
    assert value(metrics, "vllm:request_prompt_tokens_sum") == 30
    assert value(metrics, "vllm:request_generation_tokens_sum") == 7
    assert value(metrics, "vllm:request_max_num_generation_tokens_count") == 1
    for phase, seconds in phases.items():
        count = value(metrics, f"vllm:request_{phase}_time_seconds_count")
        assert count == (seconds is not None), phase
        if seconds is not None:
            assert value(metrics, f"vllm:request_{phase}_time_seconds_sum") == seconds


@pytest.mark.parametrize("served_as", [None, "served-name"])
def test_every_series_carries_its_models_name(served_as: str | None) -> None:
    metrics = Metrics(served_as)
    series = metrics.replica("r")
    before = {labels[MODEL] for samples in served(metrics).values() for labels, _ in samples}
    assert before == {served_as or ""}
    series.connected("checkpoint", 512)
    series.record_tokens(3, True, 0.25)
    scraped = served(metrics)
    names = {labels[MODEL] for samples in scraped.values() for labels, _ in samples}
    assert names == {served_as or "checkpoint"}
    assert scraped["vllm:generation_tokens_total"] == scraped["met:generation_tokens_total"]
    buckets = [labels["le"] for labels, _ in scraped["vllm:request_prompt_tokens_bucket"]]
    assert buckets == [f"{b}.0" for b in (1, 2, 5, 10, 20, 50, 100, 200, 500)] + ["+Inf"]


class PooledModel(FakeModel):
    """A service whose KV pool has 7 of its 10 blocks in use."""

    def capabilities(self) -> Capabilities:
        caps = super().capabilities()
        return dataclasses.replace(caps, kv_blocks=10, kv_block_size=16, kv_blocks_free=3)


def test_kv_cache_usage_is_the_services_count_when_scraped() -> None:
    metrics = Metrics()
    scheduler = Scheduler(PooledModel, metrics=metrics)
    assert value(metrics, "vllm:kv_cache_usage_perc") == 0  # not connected yet
    scheduler.capabilities()  # connects
    scraped = served(metrics)
    assert scraped["vllm:kv_cache_usage_perc"] == [({"replica": "local", MODEL: "fake"}, 0.7)]
    assert scraped["vllm:gpu_cache_usage_perc"] == scraped["vllm:kv_cache_usage_perc"]
