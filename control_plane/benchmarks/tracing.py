"""What tracing costs: `met bench`'s tracing section, and alone as
`python -m control_plane.benchmarks.tracing`.

Both processes started twice on the default model, once with no exporter (the default: no
SDK installed) and once exporting every span over OTLP/gRPC to a local sink that drops them;
the same concurrent greedy requests through the API, alternating, in one run."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from control_plane.launch import start_control_plane, start_gpu_service, stop
from protos.defaults import DEFAULT_MODEL_DIR
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver that counts the spans it is sent and drops them."""

    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request, context):
        self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def local_sink(workers: int) -> Iterator[tuple[Sink, str]]:
    """A `Sink` served on a free loopback port for the block: (the sink, its endpoint)."""
    sink = Sink()
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
    }


def main() -> None:
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


if __name__ == "__main__":
    main()
