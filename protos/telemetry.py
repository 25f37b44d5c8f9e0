"""OpenTelemetry for both processes: setup from the standard variables, and the gRPC
interceptors that carry W3C trace context across the hop. Torch-free; both processes use it.

Exporters: `OTEL_TRACES_EXPORTER` (`otlp`, `console`, `none`, comma-separated); when it is
unset, `otlp` if an endpoint is given (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `--otlp-endpoint`), else nothing: no SDK is installed
and every span is the API's no-op. `OTEL_EXPORTER_OTLP_PROTOCOL` picks `grpc` (default) or
`http/protobuf`; `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER` and `OTEL_SDK_DISABLED` as the
specification says.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import context, propagate, trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

TRACED_SERVICES = ("/met.v1.ModelService/", "/met.v1.GenerationService/")


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def _exporters(endpoint: str | None) -> list[str]:
    chosen = os.environ.get("OTEL_TRACES_EXPORTER")
    if chosen is not None:
        return [e.strip() for e in chosen.split(",") if e.strip() and e.strip() != "none"]
    has_endpoint = (
        endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )
    return ["otlp"] if has_endpoint else []


def _otlp_exporter(endpoint: str | None) -> Any:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        if endpoint:
            return HttpExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
        return HttpExporter()
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} is not supported (grpc or http/protobuf)"
    )


def setup_tracing(default_service: str, endpoint: str | None = None) -> Callable[[], None]:
    """Install the SDK when something will be exported; returns the flush-and-stop call for
    graceful shutdown (a no-op when nothing was installed)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return lambda: None
    names = _exporters(endpoint)
    if not names:
        return lambda: None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", default_service)})
    provider = TracerProvider(resource=resource)
    for name in names:
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(endpoint)))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER {name!r} is not supported (otlp, console or none)"
            )
    trace.set_tracer_provider(provider)
    return provider.shutdown


def _traced(method: str) -> bool:
    return method.startswith(TRACED_SERVICES)


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.strip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


class _ClientCallDetails(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout = base.method, base.timeout
        self.credentials, self.wait_for_ready = base.credentials, base.wait_for_ready
        self.compression = base.compression
        self.metadata = metadata


class ClientTracing(grpc.UnaryUnaryClientInterceptor):
    """A CLIENT span per call, its context injected as `traceparent` metadata."""

    def __init__(self, name: str = "met.client") -> None:
        self.tracer = tracer(name)

    def intercept_unary_unary(self, continuation, details, request):
        if not _traced(details.method):
            return continuation(details, request)
        with self.tracer.start_as_current_span(
            details.method.strip("/"),
            kind=SpanKind.CLIENT,
            attributes=_rpc_attributes(details.method),
        ) as span:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            metadata = [*(details.metadata or ()), *carrier.items()]
            outcome = continuation(_ClientCallDetails(details, metadata), request)
            code = outcome.code()
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, outcome.details()))
            return outcome


def incoming_context(servicer_context: grpc.aio.ServicerContext) -> context.Context:
    """The caller's trace context from the call's metadata (empty when it sent none)."""
    carrier = {
        k: v for k, v in (servicer_context.invocation_metadata() or ()) if isinstance(v, str)
    }
    return propagate.extract(carrier)


class ServerTracing(grpc.aio.ServerInterceptor):
    """A SERVER span per unary call of a traced service, under the caller's context."""

    def __init__(self, name: str = "met.server") -> None:
        self.tracer = tracer(name)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None or not _traced(details.method):
            return handler
        inner, method = handler.unary_unary, details.method

        async def traced(request, servicer_context):
            parent = incoming_context(servicer_context)
            with self.tracer.start_as_current_span(
                method.strip("/"),
                context=parent,
                kind=SpanKind.SERVER,
                attributes=_rpc_attributes(method),
            ):
                return await inner(request, servicer_context)

        return grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def recording(t: trace.Tracer) -> bool:
    """Whether `t` records: not the API's no-op, which a tracer of the global provider is
    while no SDK is installed. Opening a no-op span still costs some microseconds (a context
    attached and detached), which a step's dozen spans add to every step of a service that
    exports nothing."""
    # The proxy's own delegate, as its spans ask it (the global provider's lookup reads the
    # environment each call while none is set).
    real = t._tracer if isinstance(t, trace.ProxyTracer) else t
    return not isinstance(real, trace.NoOpTracer)


@contextmanager
def span(
    t: trace.Tracer,
    name: str,
    links: list[Link] | None = None,
    /,
    **attributes: AttributeValue | None,
) -> Iterator[Span]:
    """A child of the current span; attributes with None values are left out. `links` is
    positional so that every keyword is an attribute. Where `t` does not record, the current
    span (what a no-op span would carry on: its context, for the trace context sent on)."""
    if not recording(t):
        yield trace.get_current_span()
        return
    with t.start_as_current_span(
        name, links=links, attributes={k: v for k, v in attributes.items() if v is not None}
    ) as s:
        yield s


def traced(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the method inside a span `name` of the engine's tracer."""
    t = tracer("met.engine")

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not recording(t):
                return fn(*args, **kwargs)
            with t.start_as_current_span(name):
                return fn(*args, **kwargs)

        return run

    return wrap
