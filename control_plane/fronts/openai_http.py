"""The OpenAI-compatible HTTP front: `POST /v1/completions` and `POST /v1/chat/completions`,
streamed as server-sent events or whole, through the same `Door` (and so the same scheduler) as
the gRPC API; beside them `GET /v1/models` (and one by its id), vLLM's `/tokenize`,
`/detokenize`, `/version`, `/ping` and `/metrics`, and `/health`. `openai_body` says which
parameters it takes, `openai_reply` what it answers.

A request is one OpenTelemetry SERVER span under the caller's `traceparent`, like a `Generate`
call. `n` choices are n requests to the scheduler (a `choice` span each under it); the first
one's prefill gives the others its prompt through the prefix cache. A client that disconnects
before the end cancels its requests, which frees their slots. With
API keys configured, every route wants `Authorization: Bearer <key>`, as the gRPC API does."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import uvicorn
from opentelemetry import propagate
from opentelemetry.trace import Span, SpanKind, Tracer, set_span_in_context
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from control_plane.admission.door import BadRequest, Door, Entered
from control_plane.fronts.api import TRACER, failed, finished, request_attributes
from control_plane.fronts.http_limits import HttpLimits, protocol
from control_plane.fronts.openai_body import (
    Ask,
    chat_request,
    completion_request,
)
from control_plane.fronts.openai_prompts import check_batch, check_choices
from control_plane.fronts.openai_reply import (
    DONE,
    Reply,
    Stream,
    Whole,
    grpc_error,
    sse,
)
from control_plane.fronts.openai_routes import read_body, refused
from control_plane.replicas.router import Drives, Router
from control_plane.scheduler.seq import Delta, Failure, Finish, Queued
from protos import ports
from protos.model import Capabilities

T = TypeVar("T")


def request_span(tracer: Tracer, request: Request) -> tuple[str, Span]:
    """An HTTP request's id (its `x-request-id`, else a new one) and its `generate` SERVER
    span under the caller's `traceparent`."""
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    span = tracer.start_span(
        "generate",
        context=propagate.extract(request.headers),
        kind=SpanKind.SERVER,
        attributes={"met.request_id": rid, "url.path": request.url.path},
    )
    return rid, span


@dataclass
class AdmittedRequest:
    """One admitted request, from the Door's queue to the end of its response."""

    door: Door
    key: str
    entered: Entered
    span: Span
    done: bool = False
    started: float = field(default_factory=time.monotonic)
    first: bool = True  # no token yet

    async def next(self) -> Delta | Queued | Finish:
        """The next event; a `Failure` is raised as `BadRequest`."""
        ev = await self.entered.events.get()
        if isinstance(ev, Delta) and ev.token_ids and self.first:
            self.first = False
            self.span.set_attribute("met.time_to_first_token_s", time.monotonic() - self.started)
        elif isinstance(ev, Finish):
            self.done = True
            finished(self.span, ev)
        elif isinstance(ev, Failure):
            self.done = True
            failed(self.span, ev.code, ev.message)
            raise BadRequest(getattr(grpc.StatusCode, ev.code), ev.message)
        return ev

    def end(self) -> None:
        """However the response ended: a request its client left is cancelled (the span
        ends first, so that it is complete once the slot is free)."""
        if not self.done:
            self.span.set_attribute("gen_ai.response.finish_reasons", ["cancelled"])
        self.span.end()
        if not self.done:
            self.door.leave(self.key)


class EventStream(StreamingResponse):
    """Server-sent events that end their flights however the response ends, a client gone
    before the first chunk included (the body's generator then never runs)."""

    def __init__(self, content: AsyncIterator[str], end: Callable[[], None], rid: str) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"x-request-id": rid})
        self.end = end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.end()


class Front:
    """The routes' handlers over one `Door`."""

    def __init__(self, door: Door, tracer: Tracer = TRACER) -> None:
        self.door, self.tracer = door, tracer
        self._ids = itertools.count()

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        rid, span = request_span(self.tracer, request)
        try:
            ask, caps = await self._admit(request, chat, rid, span)
            flights = await self._enter(ask, rid, span)
        except BadRequest as e:
            failed(span, e.code.name, str(e))
            span.end()
            return refused(e)
        prefix = "chatcmpl-" if chat else "cmpl-"
        own = request.headers.get("x-request-id") or ask.request.request_id or rid
        tokenizer = self.door.scheduler.tokenizer
        reply = Reply(
            chat,
            prefix + own,
            caps.model_name,
            tokenizer,
            ask.n,
            ask.return_token_ids,
            ask.echo,
            ask.top,
            ask.prompt_logprobs,
        )

        def end() -> None:
            for f in flights:
                f.end()
            if ask.choices > 1:
                span.end()

        if ask.stream:
            stream = Stream(
                reply,
                [f.entered.shape for f in flights],
                [f.entered.request.prompt_ids for f in flights],
                ask.continuous_usage,
            )
            return EventStream(_events(stream, flights, ask.include_usage), end, rid)
        try:
            body = await _or_gone(request, _wholes(reply, flights))
        except BadRequest as e:
            return refused(e)
        finally:
            end()
        return JSONResponse(body, headers={"x-request-id": rid})

    def _choice_span(self, span: Span, rid: str, index: int) -> Span:
        return self.tracer.start_span(
            "choice",
            context=set_span_in_context(span),
            attributes={"met.request_id": rid, "met.choice_index": index},
        )

    async def _enter(self, ask: Ask, rid: str, span: Span) -> list[AdmittedRequest]:
        """Each choice's request submitted, under the request's span (one choice) or a span
        of its own beneath it; a refusal of any leaves those already in."""
        flights: list[AdmittedRequest] = []
        try:
            for i in range(ask.choices):
                # Clients may reuse ids; the scheduler must not.
                key = f"{rid}#{next(self._ids)}"
                own = span if ask.choices == 1 else self._choice_span(span, rid, i)
                try:
                    entered = await self.door.enter(ask.choice_request(i), key, own)
                except BadRequest as e:
                    if own is not span:
                        failed(own, e.code.name, str(e))
                        own.end()
                    raise
                flights.append(AdmittedRequest(self.door, key, entered, own))
        except BadRequest:
            for f in flights:
                f.end()
            raise
        return flights

    async def _admit(
        self, request: Request, chat: bool, rid: str, span: Span
    ) -> tuple[Ask, Capabilities]:
        """The request read and checked against the served model, or `BadRequest`. A batch
        is counted against what the wait queue holds before its prompts are read."""
        body = await read_body(request)
        most = queue_bound(self.door.scheduler)
        if not chat and most is not None:
            check_batch(body, most)
        ask = (chat_request if chat else completion_request)(body)
        if most is not None:
            check_choices(1 + len(ask.more), ask.n, most)
        span.set_attributes(request_attributes(ask.request, rid))
        if ask.choices > 1:
            span.set_attribute("gen_ai.request.choice.count", ask.choices)
        if chat:
            span.set_attribute("gen_ai.operation.name", "chat")
        caps = await self.door.capabilities()
        self.door.check_model(ask.model, caps)
        return ask, caps


def queue_bound(drives: Drives) -> int | None:
    """The most requests one call may submit: what a scheduler's wait queue holds
    (`--max-queue`; a router's replicas are each given the same options), so that a call
    within it is refused only while others wait, never for good. None: no replica yet."""
    if isinstance(drives, Router):
        return min((r.scheduler.opts.max_queue for r in drives.replicas), default=None)
    return drives.opts.max_queue


async def _whole(flight: AdmittedRequest, reply: Reply) -> Whole:
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    scores = None
    while True:
        ev = await flight.next()
        if isinstance(ev, Delta):
            text.append(ev.text)
            ids += ev.token_ids
            logprobs += ev.logprobs
            top_ids += ev.top_ids
            top_logprobs += ev.top_logprobs
            scores = scores or ev.prompt
        elif isinstance(ev, Finish):
            output = reply.output(flight.entered.shape)
            prompt = flight.entered.request.prompt_ids
            scores = scores or ev.prompt
            return Whole(
                "".join(text), ids, logprobs, ev, output, prompt, scores, top_ids, top_logprobs
            )


async def _wholes(reply: Reply, flights: list[AdmittedRequest]) -> dict:
    """Every choice gathered; the first refusal ends them all."""
    tasks = [asyncio.ensure_future(_whole(f, reply)) for f in flights]
    try:
        return reply.whole(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


async def _merged(
    flights: list[AdmittedRequest],
) -> AsyncIterator[tuple[int, Delta | Queued | Finish]]:
    """Every flight's events as they come, each with its choice's index, until each has
    finished; a refusal of any is raised."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, f: AdmittedRequest) -> None:
        try:
            while not isinstance(ev := await f.next(), Finish):
                queue.put_nowait((i, ev))
            queue.put_nowait((i, ev))
        except BadRequest as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, f)) for i, f in enumerate(flights)]
    try:
        left = len(flights)
        while left:
            i, ev = await queue.get()
            if isinstance(ev, BadRequest):
                raise ev
            left -= isinstance(ev, Finish)
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()


async def _events(
    stream: Stream, flights: list[AdmittedRequest], include_usage: bool
) -> AsyncIterator[str]:
    """The stream's chunks, then `[DONE]`; a request waiting for a slot hears its place as
    SSE comments, which clients skip."""
    done: dict[int, Finish] = {}
    try:
        async for i, ev in _merged(flights):
            if isinstance(ev, Queued):
                yield f": queued {ev.position} of {ev.queue_length}\n\n"
                continue
            if isinstance(ev, Finish):
                done[i] = ev
            for chunk in stream.chunks(i, ev):
                yield sse(chunk)
        if include_usage:
            yield sse(stream.reply.usage_chunk([done[i] for i in sorted(done)]))
    except BadRequest as e:  # the status line is gone: the error travels as an event
        yield sse(grpc_error(e.code, str(e))[1])
    yield DONE


async def _or_gone(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None once the client has disconnected (`work` cancelled)."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((job, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        job.cancel()
    return job.result() if job.done() and not job.cancelled() else None


async def _disconnect(request: Request) -> None:
    """Returns when the client is gone (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Uvicorn(uvicorn.Server):
    """uvicorn without signal handlers of its own: the control plane's loop owns SIGTERM and
    SIGINT and stops this server with the gRPC one."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class HttpServer:
    port: int
    server: uvicorn.Server
    task: asyncio.Task

    async def stop(self) -> None:
        """Stop accepting; streams in flight get the `grace` given to `serve`."""
        self.server.should_exit = True
        await self.task


def serve(
    app: Any,
    host: str,
    port: int,
    grace: float,
    sock: socket.socket | None = None,
    limits: HttpLimits | None = None,
    **tls: Any,
) -> HttpServer:
    """uvicorn serving `app` on this loop, its socket (`sock` if given, bound to `host:port`)
    listening on return (port 0: a free one), its connections held to `limits` (None: the
    defaults). OSError when the port cannot be bound, never uvicorn's exit. `tls`: uvicorn's
    `ssl_*` settings."""
    sock = sock or ports.bind(host, port)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol(limits or HttpLimits()),
        ws="none",  # no route is a WebSocket; an upgrade would leave the bounds
        log_config=None,
        timeout_graceful_shutdown=math.ceil(grace),  # whole seconds
        **tls,
    )
    sock.listen(config.backlog)  # connections wait in the backlog until uvicorn accepts
    server = _Uvicorn(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    return HttpServer(sock.getsockname()[1], server, task)
