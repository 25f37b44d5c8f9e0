"""The OpenAI-compatible HTTP front through the official `openai` client on a real socket,
beside the gRPC API on one scheduler: the same greedy text streamed and whole, JSON schemas,
errors in OpenAI's shape with their statuses, a full queue, a GPU service gone, and a client
that leaves freeing its slot."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Coroutine, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx2
import jsonschema
import openai
import pytest
from grpc_health.v1 import health
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from control_plane.admission import auth
from control_plane.admission.door import Door
from control_plane.cli.server import build_server
from control_plane.fronts import http_app, openai_http
from control_plane.fronts.api import GenerationServicer
from control_plane.fronts.http_limits import HttpLimits
from control_plane.replicas.client import GrpcModel
from control_plane.scheduler.metrics import Metrics
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.servers import free_slots_within

ONE_SLOT = ServiceConfig(verify_tiers="1:3", max_context=512)  # a second request waits
KEY = "sesame"
PROMPT = "def fib(n):"
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}},
    "required": ["color"],
    "additionalProperties": False,
}
LONG = {"max_tokens": 400, "ignore_eos": True}  # holds the slot until its client leaves


@dataclass
class Fronts:
    port: int  # HTTP
    http: str  # the OpenAI base URL
    client: openai.OpenAI
    stub: pb_grpc.GenerationServiceStub
    engine: Engine
    spans: InMemorySpanExporter


@contextmanager
def loop_in_thread() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def on(loop: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run_coroutine_threadsafe(work, loop).result(30)


def client(base_url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)


@contextmanager
def serving(
    engine: Engine,
    max_queue: int,
    metrics: Metrics | None = None,
    limits: HttpLimits | None = None,
) -> Iterator[Fronts]:
    """Both fronts, keys required, on one scheduler over `engine` (counting into `metrics`,
    which the HTTP front serves; its connections held to `limits`)."""
    scheduler = Scheduler(
        lambda: engine, opts=SchedulerOptions(max_queue=max_queue), metrics=metrics
    )
    scheduler.start()
    spans, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    keys = frozenset({KEY})

    async def stop(server: grpc.aio.Server, http: openai_http.HttpServer) -> None:
        await asyncio.gather(server.stop(1), http.stop())

    async def start() -> tuple[grpc.aio.Server, int, openai_http.HttpServer]:
        servicer = GenerationServicer(scheduler)
        server = build_server(servicer, health.aio.HealthServicer(), keys)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        app = http_app.build_app(servicer.door, keys, provider.get_tracer("test"), metrics)
        return server, port, openai_http.serve(app, "127.0.0.1", 0, 1, limits=limits)

    with loop_in_thread() as loop:
        server, port, http = on(loop, start())
        base = f"http://127.0.0.1:{http.port}/v1"
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationServiceStub(channel)
                yield Fronts(http.port, base, client(base), stub, engine, spans)
        finally:
            on(loop, stop(server, http))
            scheduler.stop()


@pytest.fixture(scope="module")
def fronts(tiny_dir: Path) -> Iterator[Fronts]:
    """Both fronts on an in-process one-slot engine, a queue of one."""
    with serving(Engine(tiny_dir, ONE_SLOT), 1) as f:
        yield f


def grpc_text(stub: pb_grpc.GenerationServiceStub, request: pb.GenerateRequest) -> str:
    return "".join(m.text for m in stub.Generate(request, metadata=auth.bearer(KEY), timeout=120))


def test_models_names_the_served_model(fronts: Fronts) -> None:
    (model,) = fronts.client.models.list().data
    assert model.id == fronts.engine.capabilities().model_name
    assert httpx2.get(f"{fronts.http[: -len('/v1')]}/health", timeout=30).status_code == 200


# Slow: three generations over both fronts.
@pytest.mark.slow
def test_greedy_text_is_the_grpc_apis_whole_and_streamed(fronts: Fronts) -> None:
    want = grpc_text(fronts.stub, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=16))
    whole = fronts.client.completions.create(
        model="", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0
    )
    (choice,) = whole.choices
    assert want and choice.text == want and choice.finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.completion_tokens == len(
        choice.logprobs.token_logprobs
    )
    assert whole.model_extra["speculative"]["verifies"] > 0
    chunks = list(
        fronts.client.completions.create(
            model="",
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"speculative": {"method": "none"}},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason
    assert chunks[-2].model_extra["speculative"]["drafted"] == 0
    assert chunks[-1].usage == whole.usage


# Slow: three chats.
@pytest.mark.slow
def test_chat_is_the_grpc_apis_whole_and_streamed(fronts: Fronts) -> None:
    turn = {"role": "user", "content": "hi"}
    want = grpc_text(
        fronts.stub, pb.GenerateRequest(messages=[pb.ChatMessage(**turn)], max_new_tokens=12)
    )
    whole = fronts.client.chat.completions.create(
        model="", messages=[turn], max_completion_tokens=12, temperature=0, logprobs=True
    )
    (choice,) = whole.choices
    assert want and (choice.message.role, choice.message.content) == ("assistant", want)
    assert whole.usage is not None and choice.logprobs is not None
    assert len(choice.logprobs.content) == whole.usage.completion_tokens
    chunks = list(
        fronts.client.chat.completions.create(
            model="", messages=[turn], max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


# Slow: builds the grammar engine.
@pytest.mark.slow
def test_json_schema_output_validates(fronts: Fronts) -> None:
    done = fronts.client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "pick"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": COLOR}},
    )
    jsonschema.validate(json.loads(done.choices[0].message.content or ""), COLOR)


def test_penalties_and_logit_bias_are_the_grpc_apis(fronts: Fronts) -> None:
    """OpenAI's presence and frequency penalties and logit bias (ids as strings), vLLM's
    repetition penalty: the gRPC API's text with the same fields, which differs from the text
    without them."""
    fields = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    bias = {ord("i"): -100.0, ord("e"): 5.0}
    want = grpc_text(
        fronts.stub,
        pb.GenerateRequest(prompt=PROMPT, max_new_tokens=16, logit_bias=bias, **fields),
    )
    assert want != grpc_text(fronts.stub, pb.GenerateRequest(prompt=PROMPT, max_new_tokens=16))
    done = fronts.client.completions.create(
        model="",
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"repetition_penalty": 1.3},
    )
    assert done.choices[0].text == want and "i" not in want
    (span,) = [sp for sp in fronts.spans.get_finished_spans() if sp.name == "generate"][-1:]
    assert span.attributes["gen_ai.request.presence_penalty"] == 1.5
    assert span.attributes["gen_ai.request.frequency_penalty"] == 0.5


def test_allowed_token_ids_are_the_grpc_apis_and_bind_sampling(fronts: Fronts) -> None:
    """vLLM's `allowed_token_ids` through the official client's `extra_body`: the gRPC API's
    text with the same field, greedy, and only those characters when sampled."""
    allowed = [ord(c) for c in "ab c"]
    want = grpc_text(
        fronts.stub,
        pb.GenerateRequest(prompt=PROMPT, max_new_tokens=12, allowed_token_ids=allowed),
    )
    assert set(want) <= set("ab c") and len(want) == 12
    for temperature in (0, 1):
        done = fronts.client.completions.create(
            model="",
            prompt=PROMPT,
            max_tokens=12,
            temperature=temperature,
            seed=4,
            extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
        )
        text = done.choices[0].text
        assert set(text) <= set("ab c") and len(text) == 12
        assert temperature or text == want


def finish_reasons(fronts: Fronts, rid: str) -> tuple[str, ...]:
    (span,) = [
        s for s in fronts.spans.get_finished_spans() if s.attributes["met.request_id"] == rid
    ]
    return span.attributes["gen_ai.response.finish_reasons"]


def test_full_queue_is_429_and_clients_that_leave_free_the_slot(fronts: Fronts) -> None:
    holder = fronts.client.completions.create(
        model="",
        prompt="a",
        stream=True,
        extra_body=LONG,
        extra_headers={"x-request-id": "holder"},
    )
    next(iter(holder))
    body = {"prompt": "b", "stream": True, "max_tokens": 4}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx2.stream("POST", f"{fronts.http}/completions", json=body, headers=headers) as waiter:
        lines = waiter.iter_lines()
        assert next(line for line in lines if line) == ": queued 1 of 1"
        with pytest.raises(openai.RateLimitError) as caught:
            fronts.client.completions.create(model="", prompt="c", max_tokens=4)
        assert caught.value.body["code"] == "resource_exhausted"
    holder.close()
    free_slots_within(fronts.engine, 1, 10)  # type: ignore[arg-type]
    assert finish_reasons(fronts, "holder") == ("cancelled",)


def test_a_client_gone_before_its_whole_reply_frees_the_slot(fronts: Fronts) -> None:
    body = json.dumps({"prompt": "a", **LONG}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {KEY}\r\nx-request-id: gone\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", fronts.port)) as raw:
        raw.sendall(head.encode() + body)
        free_slots_within(fronts.engine, 0, 10)  # type: ignore[arg-type]
    free_slots_within(fronts.engine, 1, 10)  # type: ignore[arg-type]
    assert finish_reasons(fronts, "gone") == ("cancelled",)


def test_the_span_continues_the_callers_trace(fronts: Fronts) -> None:
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    fronts.spans.clear()
    fronts.client.completions.create(
        model="",
        prompt="a",
        max_tokens=3,
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"},
    )
    (span,) = [s for s in fronts.spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert span.context.trace_id == int(trace_id, 16)
    assert span.parent is not None and span.parent.span_id == int(parent, 16)
    assert span.attributes["gen_ai.usage.output_tokens"] == 3


def test_gpu_service_gone_is_503() -> None:
    """A port bound and never listened on: every connection to it is refused."""
    with closing(socket.socket()) as hole, loop_in_thread() as loop:
        hole.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{hole.getsockname()[1]}"
        door = Door(Scheduler(lambda: GrpcModel(target)))

        async def start() -> openai_http.HttpServer:
            return openai_http.serve(http_app.build_app(door), "127.0.0.1", 0, grace=1)

        http = on(loop, start())
        try:
            with pytest.raises(openai.InternalServerError) as caught:
                client(f"http://127.0.0.1:{http.port}/v1").completions.create(
                    model="", prompt="a", max_tokens=1
                )
            health = httpx2.get(f"http://127.0.0.1:{http.port}/health", timeout=30)
        finally:
            on(loop, http.stop())
    assert caught.value.status_code == 503 and caught.value.body["code"] == "unavailable"
    assert caught.value.body["message"].startswith("the GPU service is not reachable")
    assert health.status_code == 503 and health.json()["error"]["code"] == "unavailable"


def test_the_role_chunk_waits_for_the_first_token(fronts: Fronts) -> None:
    """A chat stream queued behind a request holding the one slot hears only its place until
    the holder leaves; its first chunk with choices (the role) then comes with its first
    token, never before its prefill: clients stamp the time to first token on it."""
    holder = fronts.client.completions.create(model="", prompt="a", stream=True, extra_body=LONG)
    next(iter(holder))
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3}
    body["ignore_eos"] = True  # three tokens, whatever it draws
    headers = {"authorization": f"Bearer {KEY}"}
    url = f"{fronts.http}/chat/completions"
    with httpx2.stream("POST", url, json=body, headers=headers) as waiter:
        lines = (line for line in waiter.iter_lines() if line)
        assert next(lines) == ": queued 1 of 1"
        holder.close()
        after = [line for line in lines if not line.startswith(":")]
    chunks = [json.loads(line[len("data: ") :]) for line in after if line != "data: [DONE]"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert any(c["choices"][0]["delta"].get("content") for c in chunks[1:])
    free_slots_within(fronts.engine, 1, 10)  # type: ignore[arg-type]
