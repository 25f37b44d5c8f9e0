"""Test helpers for servers run inside the test process, and for waiting on another process."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import grpc

from control_plane.admission.door import Admission
from control_plane.fronts.api import GenerationServicer
from control_plane.replicas.client import GrpcModel
from control_plane.scheduler.scheduler import Scheduler
from gpu_service.engine.facade import Engine
from gpu_service.rpc.options import Access
from protos.met.v1 import generate_pb2_grpc as pb_grpc

# Builds and starts a server on the thread's event loop; -> (the server, its port).
Start = Callable[[], Awaitable[tuple[grpc.aio.Server, int]]]


async def _cancel_the_rest() -> None:
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


@contextmanager
def aio_server_in_thread(start: Start) -> Iterator[str]:
    """A grpc.aio server on an event loop of its own thread, for tests that call it through
    blocking stubs; yields its loopback address and stops it on the way out."""
    loop = asyncio.new_event_loop()
    ready, box = threading.Event(), {}

    async def main() -> None:
        server, box["port"] = await start()
        box["stop"] = asyncio.Event()
        ready.set()
        await box["stop"].wait()
        await server.stop(1)

    def run() -> None:
        loop.run_until_complete(main())
        # Streams the stop left open (a session's) end here, not when the loop is collected,
        # where asyncio would log them as destroyed while pending into a later test's log.
        loop.run_until_complete(_cancel_the_rest())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    try:
        yield f"127.0.0.1:{box['port']}"
    finally:
        loop.call_soon_threadsafe(box["stop"].set)
        thread.join(30)
        loop.close()


@contextmanager
def model_server(engine: Engine, access: Access | None = None) -> Iterator[str]:
    """The GPU service's server over `engine`, built as `serve` builds it, in this process;
    yields its loopback address."""
    from grpc_health.v1 import health

    from gpu_service.rpc.server import build_server
    from gpu_service.rpc.servicer import ModelServicer

    async def start() -> tuple[grpc.aio.Server, int]:
        servicer = ModelServicer(access or Access())
        servicer.engine = engine
        server = build_server(servicer, health.aio.HealthServicer())
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    with aio_server_in_thread(start) as target:
        yield target


@contextmanager
def serving(
    scheduler: Scheduler, run: bool = True, admission: Admission | None = None
) -> Iterator[str]:
    """The generation API over `scheduler` on a grpc.aio server in a thread, the scheduler
    running meanwhile unless not `run`; yields its address."""

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        servicer = GenerationServicer(scheduler, admission)
        pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    if run:
        scheduler.start()
    try:
        with aio_server_in_thread(start) as target:
            yield target
    finally:
        if run:
            scheduler.stop()


def free_slots_within(model: GrpcModel, want: int, seconds: float) -> float:
    """Seconds until the service reports `want` free slots; fails after `seconds`."""
    return capability_within(model, "free_slots", want, seconds)


def capability_within(model: GrpcModel, name: str, want: int, seconds: float) -> float:
    """Seconds until the service's capability `name` reads `want`; fails after `seconds`."""
    start = time.monotonic()
    while (got := getattr(model.capabilities(), name)) != want:
        assert time.monotonic() - start < seconds, f"{name} is {got}, not {want}"
        time.sleep(0.02)  # polling another process's cleanup
    return time.monotonic() - start
