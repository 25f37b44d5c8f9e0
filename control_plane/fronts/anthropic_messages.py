"""Anthropic's Messages API on the OpenAI port, as vLLM serves it: `POST /v1/messages`, whole
or streamed as Anthropic's events, and `POST /v1/messages/count_tokens`, through the same `Door`
and scheduler as the chat front (`anthropic_body` writes a body as a chat request;
`anthropic_reply` answers). A request is one `generate` span, as a chat completion's; a client
that leaves cancels its request. Errors come in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`), with the statuses of the OpenAI front's;
the key may come as `x-api-key` (the `RequireKey` of `http_app`)."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator

from opentelemetry.trace import Tracer
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from control_plane.admission.door import BadRequest, Door
from control_plane.fronts.anthropic_body import (
    THINKING_SWITCH,
    MessagesAsk,
    ThinkingSwitch,
    anthropic_named,
    count_request,
    messages_request,
)
from control_plane.fronts.anthropic_reply import PING, MessageReply, error_body, event, grpc_error
from control_plane.fronts.api import TRACER, failed, request_attributes
from control_plane.fronts.openai_http import AdmittedRequest, EventStream, _or_gone, request_span
from control_plane.fronts.openai_routes import read_body
from control_plane.scheduler.seq import Delta, Finish, Queued
from control_plane.text.chat import ChatTemplate
from control_plane.text.tokenizer import Tokenization
from control_plane.text.tools import ChatOutput
from protos.model import Capabilities

PATH = "/v1/messages"
# Every method reaches the handlers, which refuse all but POST in Anthropic's shape.
METHODS = ["POST", "GET", "PUT", "PATCH", "DELETE", "OPTIONS"]


def routes(door: Door, tracer: Tracer = TRACER) -> list[Route]:
    """The Messages routes over `door`."""
    front = Messages(door, tracer)
    return [
        Route(PATH, front.create, methods=METHODS),
        Route(f"{PATH}/count_tokens", front.count, methods=METHODS),
    ]


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    """JSON with every character outside ASCII escaped: a call's input may hold a lone
    surrogate, which UTF-8 cannot carry."""
    return Response(json.dumps(body), status, headers, media_type="application/json")


def refused(e: BadRequest) -> Response:
    """A refusal in Anthropic's error shape, its status from its code (or its own)."""
    named = anthropic_named(e)
    status, body = grpc_error(named.code, str(named), getattr(named, "status", None))
    return json_response(body, status)


def not_post(request: Request) -> Response:
    body = error_body(405, f"{request.method} {request.url.path}: Method Not Allowed; use POST")
    return json_response(body, 405, {"allow": "POST"})


class Messages:
    """The Messages routes' handlers over one `Door`."""

    def __init__(self, door: Door, tracer: Tracer = TRACER) -> None:
        self.door, self.tracer = door, tracer
        self._ids = itertools.count()
        self._switch: ThinkingSwitch | None = None
        self._switch_for: Tokenization | None = None

    async def create(self, request: Request) -> Response:
        if request.method != "POST":
            return not_post(request)
        rid, span = request_span(self.tracer, request)
        key = f"{rid}#{next(self._ids)}"
        try:
            body = await read_body(request)
            caps = await self.door.capabilities()
            asked = messages_request(body, self.thinking_switch())
            span.set_attributes(request_attributes(asked.ask.request, rid))
            span.set_attribute("gen_ai.operation.name", "chat")
            self.door.check_model(asked.model or None, caps)
            entered = await self.door.enter(asked.ask.request, key, span)
        except BadRequest as e:
            failed(span, e.code.name, str(e))
            span.end()
            return refused(e)
        flight = AdmittedRequest(self.door, key, entered, span)
        reply = self._reply(asked, caps, rid, flight)
        headers = {"x-request-id": rid, "request-id": rid}
        if asked.stream:
            stream = EventStream(_events(reply, flight), flight.end, rid)
            stream.headers["request-id"] = rid
            return stream
        try:
            message = await _or_gone(request, _whole(reply, flight))
        except BadRequest as e:
            return refused(e)
        finally:
            flight.end()
        return json_response(message or {}, headers=headers)

    async def count(self, request: Request) -> Response:
        """`{"input_tokens": N}`: the prompt a `/v1/messages` body of these fields renders."""
        if request.method != "POST":
            return not_post(request)
        try:
            body = await read_body(request)
            caps = await self.door.capabilities()
            params = count_request(body, self.thinking_switch())
            self.door.check_model(body.get("model") or None, caps)
            ids = await self.door.tokenize(params)
        except BadRequest as e:
            return refused(e)
        return json_response({"input_tokens": len(ids)})

    def thinking_switch(self) -> ThinkingSwitch | None:
        """What the served model's chat template does with reasoning, read once per model
        (None: no model yet, or no template, which the `Door` refuses with its sentence)."""
        tokenization = getattr(self.door.scheduler, "tokenization", None)
        if tokenization is None:
            return None
        if tokenization is not self._switch_for:
            try:
                chat = ChatTemplate.from_files(tokenization.files)
            except ValueError:
                chat = None
            self._switch = (
                None
                if chat is None
                else ThinkingSwitch(chat.thinks, THINKING_SWITCH in chat.source)
            )
            self._switch_for = tokenization
        return self._switch

    def _reply(
        self, asked: MessagesAsk, caps: Capabilities, rid: str, flight: AdmittedRequest
    ) -> MessageReply:
        shape = flight.entered.shape
        output = None
        if shape.tools is not None or shape.reasoning:
            output = ChatOutput(shape.tools, shape.reasoning, shape.opened, shape.parallel)
        lazy = asked.lazy_tools
        return MessageReply(
            f"msg_{rid}",
            caps.model_name,
            output,
            asked.stop_sequences,
            asked.show_thinking,
            (lambda name: name not in lazy) if asked.stream else None,
        )


async def _events(reply: MessageReply, flight: AdmittedRequest) -> AsyncIterator[str]:
    """The message's events; a `ping` for each notice of its place in the queue; a failure
    after the status line as an `error` event."""
    for body in reply.start(len(flight.entered.request.prompt_ids)):
        yield event(body)
    try:
        while True:
            ev = await flight.next()
            if isinstance(ev, Queued):
                yield event(PING)
                continue
            bodies = reply.delta(ev) if isinstance(ev, Delta) else reply.finish(ev)
            for body in bodies:
                yield event(body)
            if isinstance(ev, Finish):
                return
    except BadRequest as e:
        status, body = grpc_error(e.code, str(e))
        yield event(body)


async def _whole(reply: MessageReply, flight: AdmittedRequest) -> dict:
    text: list[str] = []
    while True:
        ev = await flight.next()
        if isinstance(ev, Delta):
            text.append(ev.text)
        elif isinstance(ev, Finish):
            return reply.whole("".join(text), ev)
