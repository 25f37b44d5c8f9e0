"""The HTTP front's bounds on a real socket: a batch past what the wait queue holds is 400 at
once, never a 429 no retry can pass; a request whose headers or body arrive too slowly is
closed after the read timeout while a canary beside it answers; a stream outlives the read
timeout; connections past the cap hear 503 while those admitted are served."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import httpx2
import openai
import pytest

from control_plane.admission.door import Door
from control_plane.fronts import http_app, openai_http
from control_plane.fronts.http_limits import HttpLimits
from control_plane.replicas.client import GrpcModel
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from gpu_service.engine.facade import Engine
from tests.control_plane.fronts.test_openai_http import (
    KEY,
    LONG,
    ONE_SLOT,
    Fronts,
    loop_in_thread,
    on,
    serving,
)

BOUND = 0.5  # the read timeout, seconds
QUEUE = SchedulerOptions().max_queue  # the server's own default
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fronts(tiny_dir: Path) -> Iterator[Fronts]:
    """Both fronts on an in-process one-slot engine, the default queue, a short read bound."""
    with serving(Engine(tiny_dir, ONE_SLOT), QUEUE, limits=HttpLimits(BOUND, 64)) as f:
        yield f


def canary(fronts: Fronts) -> float:
    """Seconds a two-token completion takes."""
    start = time.monotonic()
    fronts.client.completions.create(model="", prompt="a", max_tokens=2)
    return time.monotonic() - start


def reply_and_close(sock: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when it closed (monotonic)."""
    sock.settimeout(5 * BOUND)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data, time.monotonic()


def test_a_batch_past_the_queue_is_400_at_once(fronts: Fronts) -> None:
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        fronts.client.completions.create(model="", prompt=["a"] * 1000, max_tokens=1)
    assert time.monotonic() - start < 1
    assert caught.value.body["param"] == "prompt"
    assert caught.value.body["message"] == (
        f"prompt holds 1000 prompts; this server takes at most {QUEUE} at once, what its "
        "queue holds (--max-queue)"
    )
    with pytest.raises(openai.BadRequestError) as caught:
        fronts.client.completions.create(model="", prompt=["a"] * 200, max_tokens=1, n=2)
    assert caught.value.body["param"] == "n"
    assert caught.value.body["message"] == (
        f"n is 2 for 200 prompts: 400 requests; this server takes at most {QUEUE} at once, "
        "what its queue holds (--max-queue)"
    )
    within = fronts.client.completions.create(model="", prompt=["a", "b"], max_tokens=1, n=2)
    assert len(within.choices) == 4


def test_headers_a_byte_at_a_time_are_closed_after_the_bound(fronts: Fronts) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nhost: test\r\nx-slow: " + b"a" * 200
    with socket.create_connection(("127.0.0.1", fronts.port)) as slow:
        opened = time.monotonic()

        def drip() -> None:
            for byte in head:
                try:
                    slow.send(bytes([byte]))
                except OSError:  # closed by the server
                    return
                time.sleep(0.02)

        dripping = threading.Thread(target=drip)
        dripping.start()
        took = canary(fronts)
        data, closed = reply_and_close(slow)
        dripping.join()
    assert took < 1
    assert BOUND <= closed - opened < BOUND + 0.5
    assert data.startswith(b"HTTP/1.1 408 ") and b"(--http-read-timeout)" in data


def test_a_body_too_slow_is_closed_after_the_bound(fronts: Fronts) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {KEY}\r\ncontent-length: 100\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", fronts.port)) as slow:
        opened = time.monotonic()
        slow.sendall(head.encode() + b'{"prompt": ')
        took = canary(fronts)
        data, closed = reply_and_close(slow)
    assert took < 1
    assert BOUND <= closed - opened < BOUND + 0.5
    assert data.startswith(b"HTTP/1.1 408 ") and b"did not all arrive within 0.5 s" in data


def test_a_silent_connection_is_closed_without_a_reply(fronts: Fronts) -> None:
    with socket.create_connection(("127.0.0.1", fronts.port)) as silent:
        opened = time.monotonic()
        data, closed = reply_and_close(silent)
    assert data == b"" and BOUND <= closed - opened < BOUND + 0.5


def test_a_stream_outlives_the_read_bound(fronts: Fronts) -> None:
    """A stream queued behind the one slot's holder for longer than the bound gets its
    tokens and its end once the holder leaves."""
    holder = fronts.client.completions.create(model="", prompt="a", stream=True, extra_body=LONG)
    next(iter(holder))
    body = {"prompt": "b", "stream": True, "max_tokens": 4}
    with httpx2.stream("POST", f"{fronts.http}/completions", json=body, headers=AUTH) as waiter:
        lines = waiter.iter_lines()
        assert next(line for line in lines if line) == ": queued 1 of 1"
        time.sleep(BOUND + 0.3)
        holder.close()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and any(line.startswith("data: {") for line in rest)


def test_connections_past_the_cap_hear_503() -> None:
    """Two connections served; a third hears 503 with the sentence and is closed, while the
    two go on; once one closes, a new one is served. (No GPU service: `/version` needs none.)"""
    with closing(socket.socket()) as hole, loop_in_thread() as loop:
        hole.bind(("127.0.0.1", 0))
        door = Door(Scheduler(lambda: GrpcModel(f"127.0.0.1:{hole.getsockname()[1]}")))

        async def start() -> openai_http.HttpServer:
            app = http_app.build_app(door)
            return openai_http.serve(app, "127.0.0.1", 0, 1, limits=HttpLimits(5, 2))

        server = on(loop, start())
        try:
            first, second, third = (
                http.client.HTTPConnection("127.0.0.1", server.port, timeout=5) for _ in range(3)
            )
            first.connect()
            second.request("GET", "/version")
            assert second.getresponse().read() and second.sock is not None
            start = time.monotonic()
            third.request("GET", "/version")
            refused = third.getresponse()
            assert time.monotonic() - start < 1
            assert refused.status == 503 and refused.getheader("connection") == "close"
            assert refused.read() == (
                b'{"error":{"message":"this server serves at most 2 open connections '
                b'(--http-max-connections) and that many are open; retry later",'
                b'"type":"server_error","param":null,"code":"unavailable"}}'
            )
            second.request("GET", "/version")
            assert second.getresponse().status == 200
            first.close()
            time.sleep(0.1)  # the server hears the close
            fourth = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            fourth.request("GET", "/version")
            assert fourth.getresponse().status == 200
            for c in (second, third, fourth):
                c.close()
        finally:
            on(loop, server.stop())
