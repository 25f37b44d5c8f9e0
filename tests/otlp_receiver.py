"""A small OTLP/gRPC trace receiver for tests: what the exporters put on the wire."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class WireSpan:
    service: str
    name: str
    kind: int
    trace_id: bytes
    span_id: bytes
    parent_id: bytes
    attributes: dict
    links: list[bytes]  # span ids
    start_ns: int = 0
    end_ns: int = 0


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[WireSpan] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            WireSpan(
                                attrs.get("service.name", ""),
                                s.name,
                                s.kind,
                                s.trace_id,
                                s.span_id,
                                s.parent_span_id,
                                {a.key: _value(a.value) for a in s.attributes},
                                [link.span_id for link in s.links],
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def stop(self) -> None:
        self.server.stop(grace=None)
