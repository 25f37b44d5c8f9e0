"""`POST /v1/responses`, OpenAI's Responses API as vLLM serves it, through the same `Door` as the
chat route: the body read as the chat it asks (`openai_responses_body`), one request to the
scheduler, answered whole or as the Responses API's typed events (`openai_responses_reply`):
`response.created`, `response.in_progress`, each item's `added`, its deltas and `done`, then
`response.completed` (or `response.incomplete` when the budget ran out). No response is
stored, so `previous_response_id` and `store: true` are refused."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry.trace import INVALID_SPAN, Span, Tracer
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from control_plane.admission.door import BadRequest, Door
from control_plane.fronts.api import TRACER, failed, request_attributes
from control_plane.fronts.openai_fields import InvalidParam
from control_plane.fronts.openai_http import AdmittedRequest, EventStream, _or_gone, request_span
from control_plane.fronts.openai_reply import grpc_error
from control_plane.fronts.openai_responses_body import Responses, renamed, responses_request
from control_plane.fronts.openai_responses_reply import (
    EventWriter,
    Items,
    ResponseHead,
    chat_output,
    status_of,
)
from control_plane.fronts.openai_routes import read_body, refused
from control_plane.scheduler.seq import Delta, Finish, Queued


class ResponsesRoute:
    """The route's handler over one `Door`."""

    def __init__(self, door: Door, tracer: Tracer = TRACER) -> None:
        self.door, self.tracer = door, tracer
        self._ids = itertools.count()

    async def create(self, request: Request) -> Response:
        rid, span = request_span(self.tracer, request)
        try:
            asked, model = await self._admit(request, rid, span)
            # Clients may reuse ids; the scheduler must not.
            key = f"{rid}#responses{next(self._ids)}"
            entered = await self.door.enter(asked.ask.request, key, span)
        except BadRequest as e:
            failed(span, e.code.name, str(e))
            span.end()
            return refused(_renamed(e))
        flight = AdmittedRequest(self.door, key, entered, span)
        own = request.headers.get("x-request-id") or asked.ask.request.request_id or rid
        head = ResponseHead(f"resp_{own}", model, asked.echo)
        items = Items(chat_output(entered.shape))
        if asked.ask.stream:
            return EventStream(_events(head, items, flight), flight.end, rid)
        try:
            body = await _or_gone(request, _whole(head, items, flight))
        except BadRequest as e:
            return refused(e)
        finally:
            flight.end()
        return JSONResponse(body, headers={"x-request-id": rid})

    async def input_tokens(self, request: Request) -> Response:
        """OpenAI's count of a request's input tokens (`responses.input_tokens.count`): the
        prompt as a generation of it would see it."""
        try:
            asked, _ = await self._admit(request, uuid.uuid4().hex, INVALID_SPAN)
            ids = await self.door.tokenize(asked.ask.request)
        except BadRequest as e:
            return refused(_renamed(e))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})

    async def stored(self, request: Request) -> Response:
        """A stored response's routes (retrieve, delete, cancel, its input items): none is
        stored here."""
        name = request.path_params["id"].split("/")[0]
        sentence = (
            f"response {name!r} is not stored here; this server keeps no responses (it answers "
            "store: false), so there is none to retrieve, cancel or delete"
        )
        return refused(InvalidParam(None, sentence, grpc.StatusCode.NOT_FOUND))

    async def _admit(self, request: Request, rid: str, span: Span) -> tuple[Responses, str]:
        """The request read and its model checked; -> (it, the served model's name)."""
        asked = responses_request(await read_body(request))
        span.set_attributes(request_attributes(asked.ask.request, rid))
        span.set_attribute("gen_ai.operation.name", "chat")
        caps = await self.door.capabilities()
        self.door.check_model(asked.ask.model, caps)
        return asked, caps.model_name


def _renamed(e: BadRequest) -> BadRequest:
    """A refusal, its field in this endpoint's names."""
    if isinstance(e, InvalidParam):
        return renamed(e)
    return e if e.param is None else renamed(InvalidParam(e.param, str(e), e.code))


async def _whole(head: ResponseHead, items: Items, flight: AdmittedRequest) -> dict:
    while True:
        ev = await flight.next()
        if isinstance(ev, Delta):
            items.push(ev.text, len(ev.token_ids))
        elif isinstance(ev, Finish):
            status = status_of(ev)
            items.close(status)
            return head.body(status, items.items, ev, items.reasoning_tokens)


async def _events(head: ResponseHead, items: Items, flight: AdmittedRequest) -> AsyncIterator[str]:
    """The response's events; a request waiting for a slot hears its place as SSE comments,
    which clients skip. A failure after the status line travels as an `error` event."""
    write = EventWriter()
    opening = head.body("in_progress", [])
    yield write({"type": "response.created", "response": opening})
    yield write({"type": "response.in_progress", "response": opening})
    try:
        while True:
            ev = await flight.next()
            if isinstance(ev, Queued):
                yield f": queued {ev.position} of {ev.queue_length}\n\n"
            elif isinstance(ev, Delta):
                for event in items.push(ev.text, len(ev.token_ids)):
                    yield write(event)
            else:
                status = status_of(ev)
                for event in items.close(status):
                    yield write(event)
                body = head.body(status, items.items, ev, items.reasoning_tokens)
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield write({"type": kind, "response": body})
                return
    except BadRequest as e:
        error = grpc_error(e.code, str(e), e.param)[1]["error"]
        yield write({"type": "error", **{k: error[k] for k in ("code", "message", "param")}})
