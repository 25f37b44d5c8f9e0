"""The HTTP front's bounds on its connections, which uvicorn's h11 protocol does not hold by
itself: a request's headers and body arrive within `read_timeout` seconds of its first byte
(of the connection's opening, for its first request), else the connection is closed, with a
408 and a sentence when part of the request came; past `max_connections` open connections, a
new connection's request is answered 503 with a sentence and the connection closed. The bound
is on what the client sends, never on the answer: a response under way (a stream) is not cut.
Between requests uvicorn's keep-alive timeout closes an idle connection."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from dataclasses import dataclass
from http import HTTPStatus
from typing import ClassVar, cast

import h11
from starlette.responses import JSONResponse
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.h11_impl import H11Protocol

from control_plane.fronts.openai_reply import error

RECEIVING = (h11.IDLE, h11.SEND_BODY)  # the client's states while its request is arriving


@dataclass(frozen=True)
class HttpLimits:
    """`met control-plane serve`'s `--http-read-timeout` and `--http-max-connections`."""

    read_timeout: float = 30.0  # seconds for a request's headers and body to arrive
    max_connections: int = 1024  # open connections served at once

    def __post_init__(self) -> None:
        if not 0 < self.read_timeout < math.inf:
            raise ValueError(f"read_timeout must be above 0 seconds, not {self.read_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {self.max_connections}")

    @property
    def late(self) -> bytes:
        """The 408 a connection whose request did not all arrive in time hears, whole."""
        sentence = (
            f"the request's headers and body did not all arrive within {self.read_timeout:g} "
            "s, this server's bound (--http-read-timeout)"
        )
        return _raw(408, error(408, sentence, "request_timeout"))

    @property
    def full(self) -> JSONResponse:
        """The 503 a request on a connection past `max_connections` hears."""
        sentence = (
            f"this server serves at most {self.max_connections} open connections "
            "(--http-max-connections) and that many are open; retry later"
        )
        return JSONResponse(
            error(503, sentence, "unavailable"),
            503,
            headers={"connection": "close", "retry-after": "1"},
        )


def seconds(text: str) -> float:
    """A flag's parser: a finite number of seconds above 0, else a sentence saying so."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def count(text: str) -> int:
    """A flag's parser: a whole number of at least 1, else a sentence saying so."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _raw(status: int, body: dict) -> bytes:
    """A whole response that closes its connection, written past h11 (the connection ends)."""
    data = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + data


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol held to `limits` (a subclass per server: `protocol`)."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    reading: asyncio.TimerHandle | None = None  # armed while a request is arriving

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:  # this one counted
            self.app = cast(ASGI3Application, self.limits.full)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in RECEIVING and not self.transport.is_closing():
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        """The deadline from the request's first byte on: armed once per request."""
        if self.reading is None:
            self.reading = self.loop.call_later(self.limits.read_timeout, self._late)

    def _disarm(self) -> None:
        if self.reading is not None:
            self.reading.cancel()
            self.reading = None

    def _late(self) -> None:
        """The request did not arrive in time: the connection is closed, with a 408 when part
        of it came and no response is under way (a response already sent stands)."""
        self.reading = None
        if self.transport.is_closing() or self.conn.our_state is h11.SEND_BODY:
            return
        started = self.conn.their_state is h11.SEND_BODY or self.conn.trailing_data[0]
        if started and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.write(self.limits.late)
        self.transport.close()


def protocol(limits: HttpLimits) -> type[BoundedH11]:
    """The protocol class for uvicorn.Config's `http`, held to `limits`."""
    return type("BoundedH11", (BoundedH11,), {"limits": limits})
