"""Prometheus metrics of the control plane, named as vLLM names them (`met:` for `vllm:`)
where vLLM has one: `spec_decode_num_drafts`, `spec_decode_num_draft_tokens`,
`spec_decode_num_accepted_tokens`, `spec_decode_num_accepted_tokens_per_pos`,
`num_requests_running`, `num_requests_waiting`, `time_to_first_token_seconds`,
`inter_token_latency_seconds`, `prompt_tokens`, `generation_tokens`, `request_success`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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
        self._add_request_counters(self.registry)
        self._add_draft_counters(self.registry)
        self._add_gauges(self.registry)
        self._add_latency_histograms(self.registry)

    def _add_request_counters(self, r: CollectorRegistry) -> None:
        self.requests = Counter("met:requests", "Requests received.", registry=r)
        self.request_success = Counter(
            "met:request_success", "Requests finished, by reason.", ["finished_reason"], registry=r
        )
        self.prompt_tokens = Counter("met:prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("met:generation_tokens", "Tokens generated.", registry=r)

    def _add_draft_counters(self, r: CollectorRegistry) -> None:
        self.steps = Counter("met:scheduler_steps", "step_mtp iterations.", registry=r)
        self.num_drafts = Counter(
            "met:spec_decode_num_drafts", "Verifies that carried drafts.", registry=r
        )
        self.draft_tokens = Counter(
            "met:spec_decode_num_draft_tokens", "Drafts verified.", registry=r
        )
        self.accepted_tokens = Counter(
            "met:spec_decode_num_accepted_tokens", "Drafts accepted.", registry=r
        )
        self.accepted_per_pos = Counter(
            "met:spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted, by draft position.",
            ["position"],
            registry=r,
        )
        self.copies = Counter(
            "met:prompt_lookup_copies", "Prompt-lookup copies verified.", registry=r
        )
        self.dcut_steps = Counter(
            "met:dcut_steps", "Steps whose batch depths D-Cut planned.", registry=r
        )
        self.grammar_truncations = Counter(
            "met:grammar_draft_truncations",
            "Verifies whose drafts a grammar cut short.",
            registry=r,
        )

    def _add_gauges(self, r: CollectorRegistry) -> None:
        self.step_width = Gauge(
            "met:spec_decode_step_width",
            "Draft width of the last step (ladder, rung or cost model).",
            registry=r,
        )
        self.mean_accepted_length = Gauge(
            "met:spec_decode_mean_accepted_length",
            "Tokens per verify, bonus included, over every finished request.",
            registry=r,
        )
        self.running = Gauge("met:num_requests_running", "Sequences holding a slot.", registry=r)
        self.waiting = Gauge("met:num_requests_waiting", "Requests waiting for a slot.", registry=r)
        self.free_slots = Gauge(
            "met:free_slots", "Slots of the GPU service not in use.", registry=r
        )

    def _add_latency_histograms(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "met:time_to_first_token_seconds",
            "Time to the first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "met:inter_token_latency_seconds",
            "Time per output token after the first.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve `/metrics` over HTTP on a thread; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

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
