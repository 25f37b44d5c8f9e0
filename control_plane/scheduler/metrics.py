"""Prometheus metrics of the control plane, named as vLLM names them (`met:` for `vllm:`)
where vLLM has one (`VLLM_FAMILIES`), and served under vLLM's own prefix beside ours, so that
dashboards and load tools made for vLLM (its Grafana dashboard, aiperf's server metrics) read
them unchanged.

Every series carries a `replica` label, the GPU service (its address) whose scheduler counted
it, as vLLM's carry `engine`; and, as served, vLLM's `model_name`: the model that replica
serves, as `/v1/models` names it. A scheduler writes through its replica's view
(`Metrics.replica`), so one registry serves every replica the control plane drives.

Each family is measured where vLLM measures it: time to first token and between tokens as
tokens reach a request's sink; a request's latencies (end to end, queued, prefill, decode) and
token counts when it retires; the KV pool's usage when it is scraped, from the GPU service that
owns the pool. The families served for vLLM's dashboard take vLLM's buckets; the older ones
keep their finer ones, for the few milliseconds between a speculative step's tokens."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

REPLICA, MODEL, METHOD = "replica", "model_name", "method"  # the labels
MET, VLLM = "met:", "vllm:"
# The families vLLM exports under the same name, served as `vllm:` too.
VLLM_FAMILIES = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_max_num_generation_tokens",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
)
# A family's former vLLM names, served too: dashboards made before vLLM renamed it query them.
VLLM_FORMER = {"kv_cache_usage_perc": ("gpu_cache_usage_perc",)}
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
# vLLM's, for its time per output token.
_TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# vLLM's, for a request's latencies: end to end, queued, prefill, decode, inference.
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def buckets_1_2_5(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `most`: vLLM's buckets for a request's token counts,
    `most` the served model's context."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass(frozen=True)
class Retired:
    """A request as it retired, for the request-level families (vLLM's
    `FinishedRequestStats`). Times are `time.monotonic()`'s; a phase the request never
    reached is None."""

    prompt_tokens: int
    generation_tokens: int
    queued: float  # taken by the scheduler
    scheduled: float | None  # first given a slot (a preemption's return does not count)
    first_token: float | None  # its first token reached its sink
    last_token: float | None  # its last one did
    retired: float


class Metrics:
    """`registry` holds what the schedulers count, labelled by replica (what tests read with
    `get_sample_value`); `exported` is what `/metrics` serves: the same with `model_name`,
    and under vLLM's names too."""

    # Sized by the served model's context at the first connection (`connected`).
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    request_max_num_generation_tokens: Histogram

    def __init__(self, model_name: str | None = None) -> None:
        """`model_name`: the name the model is served under (`--served-model-name`'s first),
        on every series; None: the name each replica's GPU service gives its checkpoint."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.models: dict[str, str] = {}  # replica -> its GPU service's name for the model
        self.sized_for: int | None = None  # the context the token counts' buckets reach
        self._sizing = threading.Lock()  # replicas connect on their own threads
        self._add_request_counters()
        self._add_draft_counters()
        self._add_gauges()
        self._add_latency_histograms()
        self._add_request_histograms()
        self.exported = CollectorRegistry()
        self.exported.register(_Exported(self.registry, self.model_of))

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, [REPLICA, *labels], registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, [REPLICA], registry=self.registry)

    def _histogram(
        self, name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS
    ) -> Histogram:
        return Histogram(name, doc, [REPLICA], buckets=buckets, registry=self.registry)

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
        # By the method that drafted (the server's choice counts what it chose).
        self.num_drafts = self._counter(
            "met:spec_decode_num_drafts", "Verifies that carried drafts.", METHOD
        )
        self.draft_tokens = self._counter(
            "met:spec_decode_num_draft_tokens", "Drafts verified.", METHOD
        )
        self.accepted_tokens = self._counter(
            "met:spec_decode_num_accepted_tokens", "Drafts accepted.", METHOD
        )
        self.accepted_per_pos = self._counter(
            "met:spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted, by draft position.",
            METHOD,
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
        self.kv_cache_usage = self._gauge(
            "met:kv_cache_usage_perc",
            "Fraction of the GPU service's KV pool blocks in use (0 to 1), asked when scraped.",
        )

    def _add_latency_histograms(self) -> None:
        self.ttft = self._histogram("met:time_to_first_token_seconds", "Time to the first token.")
        self.itl = self._histogram(
            "met:inter_token_latency_seconds", "Time per output token after the first."
        )
        self.tpot = self._histogram(
            "met:time_per_output_token_seconds",
            "Time per output token after the first (vLLM's former name of the inter-token "
            "latency, with its buckets).",
            _TPOT_BUCKETS,
        )

    def _add_request_histograms(self) -> None:
        def latency(name: str, doc: str) -> Histogram:
            return self._histogram(name, doc, _REQUEST_BUCKETS)

        self.e2e = latency(
            "met:e2e_request_latency_seconds", "From the scheduler taking a request to its end."
        )
        self.queue_time = latency(
            "met:request_queue_time_seconds", "From the scheduler taking a request to its slot."
        )
        self.prefill_time = latency(
            "met:request_prefill_time_seconds", "From a request's slot to its first token."
        )
        self.decode_time = latency(
            "met:request_decode_time_seconds", "From a request's first token to its last."
        )
        self.inference_time = latency(
            "met:request_inference_time_seconds", "From a request's slot to its last token."
        )

    def connected(self, replica: str, model_name: str, max_context: int) -> None:
        """A replica's scheduler connected to a GPU service serving `model_name`: its series
        are labelled with it; the first connection sizes the token counts' buckets."""
        self.models[replica] = model_name
        with self._sizing:
            if self.sized_for is None:
                self._add_token_counts(max_context)
        for family in self._token_counts():
            family.labels(**{REPLICA: replica})  # shown, at 0, from the connection

    def _add_token_counts(self, max_context: int) -> None:
        self.sized_for = max_context
        buckets = buckets_1_2_5(max_context)
        self.request_prompt_tokens = self._histogram(
            "met:request_prompt_tokens", "Prompt tokens of a finished request.", buckets
        )
        self.request_generation_tokens = self._histogram(
            "met:request_generation_tokens", "Tokens a finished request generated.", buckets
        )
        self.request_max_num_generation_tokens = self._histogram(
            "met:request_max_num_generation_tokens",
            "The most tokens a request's choices generated; each choice is a request of its "
            "own here, so each choice's count is observed.",
            buckets,
        )

    def model_of(self, replica: str) -> str:
        """The `model_name` of a replica's series ("" before it connected, unless named)."""
        return self.model_name or self.models.get(replica, "")

    def _token_counts(self) -> tuple[Histogram, ...]:
        return (
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.request_max_num_generation_tokens,
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve `/metrics` over HTTP on a thread; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.exported)
        return server.server_port

    def replica(self, name: str) -> ReplicaMetrics:
        """The series of one replica, under the same attribute names."""
        return ReplicaMetrics(self, name)


class _Exported:
    """Every family of `source` with each series' `model_name` (`model_of` its replica), and
    again under vLLM's names (`VLLM_FAMILIES`, `VLLM_FORMER`)."""

    def __init__(self, source: CollectorRegistry, model_of: Callable[[str], str]) -> None:
        self.source, self.model_of = source, model_of

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            yield self._named(family, family.name)
            name = family.name.removeprefix(MET)
            if name in VLLM_FAMILIES:
                for vllm_name in (name, *VLLM_FORMER.get(name, ())):
                    yield self._named(family, VLLM + vllm_name)

    def _named(self, family: Metric, name: str) -> Metric:
        out = Metric(name, family.documentation, family.type, family.unit)
        out.samples = [
            s._replace(
                name=name + s.name.removeprefix(family.name),
                labels={**s.labels, MODEL: self.model_of(s.labels.get(REPLICA, ""))},
            )
            for s in family.samples
        ]
        return out


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

    def connected(self, model_name: str, max_context: int) -> None:
        self.root.connected(self.name, model_name, max_context)

    def record_verify(self, drafted: int, accepted: int, method: str) -> None:
        if drafted:
            self.num_drafts.labels(method=method).inc()
            self.draft_tokens.labels(method=method).inc(drafted)
            self.accepted_tokens.labels(method=method).inc(accepted)
            for j in range(accepted):
                self.accepted_per_pos.labels(method=method, position=str(j)).inc()

    def record_tokens(self, count: int, first: bool, seconds: float) -> None:
        """`count` tokens reached a client `seconds` after the request (first) or after its
        previous tokens."""
        self.generation_tokens.inc(count)
        if first:
            self.ttft.observe(seconds)
            count -= 1
        for _ in range(count):
            self.itl.observe(seconds / max(count, 1))
            self.tpot.observe(seconds / max(count, 1))

    def record_retired(self, r: Retired) -> None:
        """vLLM's intervals of a finished request: queued (taken to slot), prefill (slot to
        first token), decode (first token to last), inference (slot to last token), each
        observed once the request reached its end; preemptions fall inside them."""
        self.e2e.observe(r.retired - r.queued)
        self.request_prompt_tokens.observe(r.prompt_tokens)
        self.request_generation_tokens.observe(r.generation_tokens)
        self.request_max_num_generation_tokens.observe(r.generation_tokens)
        if r.scheduled is None:
            return
        self.queue_time.observe(r.scheduled - r.queued)
        if r.first_token is not None and r.last_token is not None:
            self.prefill_time.observe(r.first_token - r.scheduled)
            self.decode_time.observe(r.last_token - r.first_token)
            self.inference_time.observe(r.last_token - r.scheduled)


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
