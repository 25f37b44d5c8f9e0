"""What tracing costs: `met bench`'s tracing section, and alone as
`python -m tools.bench.tracing`.

Both processes started twice on the default model, once with no exporter (the default: no
SDK installed) and once exporting every span over OTLP/gRPC to a local sink that keeps only
the steps' spans; the same concurrent greedy requests through the API, alternating, in one run.
From the steps' spans it tells how many of the service's steps ran while the control plane had
already opened a later one: the pipeline's overlap, as Jaeger shows it."""

from __future__ import annotations

import argparse
import bisect
import os
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from protos.defaults import DEFAULT_MODEL_DIR
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class StepSpan:
    """A step's span as it crossed the wire: the control plane's `step_mtp`, or the
    service's `engine.plan` under it."""

    service: str
    name: str
    span_id: bytes
    parent_id: bytes
    start_ns: int
    end_ns: int


STEP_SPANS = ("step_mtp", "engine.plan")


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that counts the spans it is sent, keeps those named in `names`
    (the steps', by default) and drops the rest."""

    def __init__(self, names: Sequence[str] = STEP_SPANS) -> None:
        self.names = frozenset(names)
        self.spans = 0
        self.steps: list[StepSpan] = []
        self._lock = threading.Lock()  # the server's workers export at once

    def Export(self, request, context):
        for rs in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            service = attrs.get("service.name", "")
            for ss in rs.scope_spans:
                kept = [
                    StepSpan(
                        service,
                        s.name,
                        s.span_id,
                        s.parent_span_id,
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                    )
                    for s in ss.spans
                    if s.name in self.names
                ]
                with self._lock:
                    self.spans += len(ss.spans)
                    self.steps += kept
        return trace_service_pb2.ExportTraceServiceResponse()

    def take(self) -> list[StepSpan]:
        """The spans kept so far, and none from now on."""
        with self._lock:
            out, self.steps = self.steps, []
        return out


def overlaps(steps: Sequence[StepSpan]) -> dict:
    """The service's steps (`engine.plan` spans, one a step) during which the control plane
    opened the span of a step other than the step's own: how many, out of how many, and the
    first such, in ms from the step's start (None when none overlapped)."""
    plans = sorted(
        (s for s in steps if s.name == "engine.plan" and s.service == "gpu-service"),
        key=lambda s: s.start_ns,
    )
    opened = sorted(
        (s.start_ns, s.span_id)
        for s in steps
        if s.name == "step_mtp" and s.service == "control-plane"
    )
    starts = [t for t, _ in opened]
    hits, first = 0, None
    for p in plans:
        i = bisect.bisect_right(starts, p.start_ns)
        later = [sid for t, sid in opened[i:] if t < p.end_ns and sid != p.parent_id]
        if later:
            hits += 1
            if first is None:
                t = next(t for t, sid in opened[i:] if sid == later[0])
                first = {
                    "step_ms": (p.end_ns - p.start_ns) / 1e6,
                    "next_step_opened_at_ms": (t - p.start_ns) / 1e6,
                }
    return {"steps": len(plans), "overlapping": hits, "first": first}


@contextmanager
def local_sink(workers: int, names: Sequence[str] = STEP_SPANS) -> Iterator[tuple[Sink, str]]:
    """A `Sink` of `names` served on a free loopback port for the block: (the sink, its
    endpoint)."""
    sink = Sink(names)
    server = grpc.server(futures.ThreadPoolExecutor(workers))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield sink, f"http://127.0.0.1:{port}"
    finally:
        server.stop(None)


def _throughput(target: str, concurrency: int, tokens: int) -> float:
    def one(i: int) -> int:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            request = pb.GenerateRequest(
                prompt_token_ids=list(range(i, i + 16)), max_new_tokens=tokens, ignore_eos=True
            )
            return sum(len(m.token_ids) for m in stub.Generate(request, timeout=600))

    t0 = time.perf_counter()
    with futures.ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(one, range(concurrency)))
    return total / (time.perf_counter() - t0)


def _both_processes(endpoint: str | None, concurrency: int, tokens: int) -> float:
    """Tokens per second through a fresh GPU service and control plane, both exporting spans
    to `endpoint` (None: no exporter)."""
    saved = dict(os.environ)
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    os.environ.pop("OTEL_TRACES_EXPORTER", None)
    if endpoint:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    try:
        gpu, target = start_gpu_service(DEFAULT_MODEL_DIR)
        cp, cp_target = start_control_plane(target)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        _throughput(cp_target, concurrency, 8)  # warm-up
        return _throughput(cp_target, concurrency, tokens)
    finally:
        stop(cp)
        stop(gpu)


def tracing(concurrency: int, tokens: int) -> dict:
    """Both processes with tracing off, then exporting to a local OTLP sink."""
    with local_sink(2) as (sink, endpoint):
        off = _both_processes(None, concurrency, tokens)
        on = _both_processes(endpoint, concurrency, tokens)
    return {
        "concurrency": concurrency,
        "disabled_tok_s": off,
        "exported_tok_s": on,
        "spans": sink.spans,
        "overlap": overlaps(sink.steps),
    }


def main() -> None:
    from tools.bench.report import overlap_line

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"disabled": [], "exported": []}
    with local_sink(4) as (sink, endpoint):
        for _ in range(args.repeats):
            rates["disabled"].append(_both_processes(None, args.concurrency, args.tokens))
            rates["exported"].append(_both_processes(endpoint, args.concurrency, args.tokens))
    off, on = (statistics.median(rates[k]) for k in ("disabled", "exported"))
    print(
        f"{args.concurrency} concurrent requests x {args.tokens} tokens, median of {args.repeats}"
    )
    print(f"tracing disabled: {off:8.1f} tok/s   {rates['disabled']}")
    print(f"tracing exported: {on:8.1f} tok/s   {rates['exported']}   ({sink.spans} spans)")
    print(f"cost: {(1 - on / off) * 100:.1f}%")
    print(overlap_line(overlaps(sink.steps)))


if __name__ == "__main__":
    main()
