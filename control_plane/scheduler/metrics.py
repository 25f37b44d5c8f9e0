"""Prometheus metrics of the control plane, named as vLLM names them (`met:` for `vllm:`)
where vLLM has one (`VLLM_FAMILIES`), and served under vLLM's own prefix beside ours, so that
dashboards and load tools made for vLLM (aiperf's server metrics) read them unchanged.

Every series carries a `replica` label: the GPU service (its address) whose scheduler counted
it, as vLLM's carry `engine`. A scheduler writes through its replica's view
(`Metrics.replica`), so one registry serves every replica the control plane drives."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

REPLICA = "replica"  # the label
MET, VLLM = "met:", "vllm:"
# The families vLLM exports under the same name, served as `vllm:` too.
VLLM_FAMILIES = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
    "num_requests_running",
    "num_requests_waiting",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
)
REPLICA_ATTRIBUTE = "met.replica"  # the span attribute, on a request's span and each step's
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._add_request_counters()
        self._add_draft_counters()
        self._add_gauges()
        self._add_latency_histograms()
        self.registry.register(_VllmNames(self._families()))

    def _families(self) -> list[Counter | Gauge | Histogram]:
        named = {MET + name for name in VLLM_FAMILIES}
        out = [m for m in vars(self).values() if isinstance(m, Counter | Gauge | Histogram)]
        return [m for m in out if m._name in named]

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, [REPLICA, *labels], registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, [REPLICA], registry=self.registry)

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, [REPLICA], buckets=_LATENCY_BUCKETS, registry=self.registry)

    def _add_request_counters(self) -> None:
        self.requests = self._counter("met:requests", "Requests received.")
        self.request_success = self._counter(
            "met:request_success", "Requests finished, by reason.", "finished_reason"
        )
        self.prompt_tokens = self._counter("met:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = self._counter("met:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = self._counter(
            "met:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.preemptions = self._counter(
            "met:num_preemptions", "Requests preempted: their sequence freed for the KV pool."
        )
        self.prefix_cache_hits = self._counter(
            "met:prefix_cache_hits", "Prompt tokens a cached prefix gave (not prefilled)."
        )

    def _add_draft_counters(self) -> None:
        self.steps = self._counter("met:scheduler_steps", "step_mtp iterations.")
        self.num_drafts = self._counter(
            "met:spec_decode_num_drafts", "Verifies that carried drafts."
        )
        self.draft_tokens = self._counter("met:spec_decode_num_draft_tokens", "Drafts verified.")
        self.accepted_tokens = self._counter(
            "met:spec_decode_num_accepted_tokens", "Drafts accepted."
        )
        self.accepted_per_pos = self._counter(
            "met:spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted, by draft position.",
            "position",
        )
        self.copies = self._counter("met:prompt_lookup_copies", "Prompt-lookup copies verified.")
        self.dcut_steps = self._counter("met:dcut_steps", "Steps whose batch depths D-Cut planned.")
        self.grammar_truncations = self._counter(
            "met:grammar_draft_truncations", "Verifies whose drafts a grammar cut short."
        )

    def _add_gauges(self) -> None:
        self.step_width = self._gauge(
            "met:spec_decode_step_width",
            "Draft width of the last step (ladder, rung or cost model).",
        )
        self.mean_accepted_length = self._gauge(
            "met:spec_decode_mean_accepted_length",
            "Tokens per verify, bonus included, over every finished request.",
        )
        self.running = self._gauge("met:num_requests_running", "Sequences holding a slot.")
        self.waiting = self._gauge("met:num_requests_waiting", "Requests waiting for a slot.")
        self.free_slots = self._gauge("met:free_slots", "Slots of the GPU service not in use.")
        self.up = self._gauge(
            "met:replica_up", "1 while the GPU service is up: connected, serving the model."
        )

    def _add_latency_histograms(self) -> None:
        self.ttft = self._histogram("met:time_to_first_token_seconds", "Time to the first token.")
        self.itl = self._histogram(
            "met:inter_token_latency_seconds", "Time per output token after the first."
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve `/metrics` over HTTP on a thread; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    def replica(self, name: str) -> ReplicaMetrics:
        """The series of one replica, under the same attribute names."""
        return ReplicaMetrics(self, name)


class _VllmNames:
    """Each of `families` again under vLLM's prefix, sample for sample."""

    def __init__(self, families: list[Counter | Gauge | Histogram]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            for m in family.collect():
                copy = Metric(VLLM + m.name.removeprefix(MET), m.documentation, m.type, m.unit)
                copy.samples = [s._replace(name=VLLM + s.name.removeprefix(MET)) for s in m.samples]
                yield copy


class ReplicaMetrics:
    """`Metrics` seen from one replica's scheduler: each family's `replica` label given."""

    def __init__(self, root: Metrics, name: str) -> None:
        self.root, self.name = root, name
        for metric in vars(root).values():  # each series shows, at 0, from the start
            if isinstance(metric, (Counter, Gauge, Histogram)):
                try:
                    metric.labels(**{REPLICA: name})
                except ValueError:  # a family with labels of its own: series come with them
                    pass

    def __getattr__(self, family: str) -> Any:
        series = _Series(getattr(self.root, family), self.name)
        setattr(self, family, series)  # built once per family
        return series

    def record_verify(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.num_drafts.inc()
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(accepted)
            for j in range(accepted):
                self.accepted_per_pos.labels(position=str(j)).inc()

    def record_tokens(self, count: int, first: bool, seconds: float) -> None:
        """`count` tokens reached a client `seconds` after the request (first) or after its
        previous tokens."""
        self.generation_tokens.inc(count)
        if first:
            self.ttft.observe(seconds)
            count -= 1
        for _ in range(count):
            self.itl.observe(seconds / max(count, 1))


class _Series:
    """A family's series for one replica; a family with labels of its own takes them in
    `labels`, one without is written directly (`inc`, `set`, `observe`)."""

    def __init__(self, family: Any, replica: str) -> None:
        self.family, self.replica = family, replica

    def labels(self, **labels: str) -> Any:
        return self.family.labels(**{REPLICA: self.replica}, **labels)

    @functools.cached_property
    def _child(self) -> Any:
        return self.family.labels(**{REPLICA: self.replica})

    def __getattr__(self, method: str) -> Any:
        return getattr(self._child, method)
