"""The HTTP front's side of a stop (`protos.stopping.Drain`): a request arriving while the
control plane drains gets 503, and one the drain cuts ends with 503 and the drain's sentence
in OpenAI's error shape; a stream already under way (its 200 sent) gets the error as its last
event instead."""

from __future__ import annotations

import asyncio
import json

import grpc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from control_plane.fronts.openai_reply import grpc_error, sse
from protos.stopping import Drain

# What a probe asks while the process drains: its own answer, not the drain's refusal.
PROBES = frozenset({"/health", "/ping", "/version", "/metrics"})


class DrainHttp:
    """`app` with every request but the probes tracked by `drain`."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await self._refuse(send, None)
            return
        sent: list[Message] = []  # the response's start, then its last body message

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start" or not message.get("more_body"):
                sent.append(message)
            await send(message)

        with self.drain.track() as call:  # its sends are the app's awaits: always exposed
            try:
                await self.app(scope, receive, tracked)
            except asyncio.CancelledError:
                if not call.cut:
                    raise
                if len(sent) < 2:  # a response whole already (its client going) is left be
                    await self._refuse(send, sent[0] if sent else None)

    async def _refuse(self, send: Send, started: Message | None) -> None:
        status, body = grpc_error(grpc.StatusCode.UNAVAILABLE, self.drain.sentence)
        if started is None:
            data = json.dumps(body).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": data})
        elif _is_stream(started):
            await send(
                {"type": "http.response.body", "body": sse(body).encode(), "more_body": True}
            )
            await send({"type": "http.response.body", "body": b""})
        else:  # a whole body half sent: it ends short, as a broken connection would
            await send({"type": "http.response.body", "body": b""})


def _is_stream(started: Message) -> bool:
    headers = dict(started.get("headers", []))
    return headers.get(b"content-type", b"").startswith(b"text/event-stream")
