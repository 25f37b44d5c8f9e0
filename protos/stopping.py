"""How a process of the pair stops: on SIGTERM or Ctrl-C, at any moment (loading, compiling,
serving a call), within `STOP_S` and with status 0. Torch-free; both servers use it.

- `Drain`: the calls in flight on a server, given the grace, then cut: each ends with
  UNAVAILABLE (HTTP 503) and a sentence, where grpc would end it CANCELLED with none.
  `DrainInterceptor` tracks a gRPC server's calls with it.
- `in_thread`: blocking work (a load, a compile, a call to a service that compiles) on a daemon
  thread the stop does not wait for; `asyncio.run` joins its loop's executor at its end.
- `leave`: the exit once the drain is done. It waits for no thread (the engine's compiles hold
  theirs for minutes, and a thread cannot be interrupted), and skips the C++ teardown that
  aborts on a thread still inside native code (`terminate called without an active exception`).
- `watch_parent`: a child stops itself (SIGTERM to itself, the usual stop) once the parent that
  started it (`PARENT_ENV`) is gone.
- `say`: a line on stdout that never raises once stdout's reader is gone."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc

from protos.bodies import HANDLER_BUILDERS

T = TypeVar("T")

# What either process promises: from SIGTERM or SIGINT to its exit, with the default grace.
STOP_S = 10.0
# The pid of the process that started this one (`control_plane.cli.launch.start` sets it): the
# child stops when that process is gone.
PARENT_ENV = "MET_PARENT_PID"
# How often a child looks for its parent: a stop costs a second at most, the look nothing.
PARENT_POLL_S = 0.5
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def say(line: str) -> None:
    """`line` on stdout, flushed. Once stdout's reader is gone (a parent that died) stdout goes
    to /dev/null for good, so that neither this line nor a later one nor the exit's flush
    raises `BrokenPipeError`."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def leave(status: int) -> NoReturn:
    """The process ended with `status` now, its output flushed; no thread is waited for and no
    native destructor runs (see the module's docstring). Only once every server has drained."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


def stop_event(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An event SIGTERM and SIGINT set on `loop` (installed before a port is announced, so that
    a signal right after the announcement is a clean stop)."""
    stop = asyncio.Event()
    for sig in SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    return stop


def ignore_signals(loop: asyncio.AbstractEventLoop) -> None:
    """A second SIGTERM or SIGINT while the first one's stop drains (a Ctrl-C that reached the
    whole process group, then its parent's SIGTERM) is that stop, not a death by signal."""
    for sig in SIGNALS:
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)


def in_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """`fn` on a daemon thread of its own -> its result on the running loop. A stop may leave
    the thread blocked (a load, a compile, a call to a service that compiles for minutes):
    nothing joins it, where `asyncio.run` joins its loop's default executor."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        try:
            result = fn()
        except BaseException as e:  # the caller's to raise
            deliver = functools.partial(future.set_exception, e)
        else:
            deliver = functools.partial(future.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: no one waits
            loop.call_soon_threadsafe(settle, deliver)

    threading.Thread(target=run, name=getattr(fn, "__name__", "work"), daemon=True).start()
    return future


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> tuple[bool, T | None]:
    """-> (True, `work`'s result) when it ends first (its error raised), (False, None) once
    `stop` is set first; `work` is then left to finish on its own."""
    job = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait((job, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if job.done():
        return True, job.result()
    job.add_done_callback(lambda f: f.cancelled() or f.exception())  # its error is no one's
    return False, None


def watch_parent() -> None:
    """When `PARENT_ENV` names this process's parent: a thread that sends SIGTERM to this
    process once that parent is gone (the child is given another parent then), so that a
    child never outlives the `met up` or the test that started it. The variable is removed, so
    that this process's own children do not inherit it.

    A poll of `os.getppid()` and not Linux's `PR_SET_PDEATHSIG`: that signal comes when the
    *thread* that started the child ends, and `met up` and the tests start their children
    from pool threads that end as soon as the children serve."""
    named = os.environ.pop(PARENT_ENV, None)
    if named is None:
        return
    parent = int(named)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class Call:
    """One call a `Drain` tracks. A cut cancels its task only while `exposed` (the handler
    awaits its own work); a stream's handler suspended at a reply, the cancellation would land
    in the server's send instead, so the stream sees `cut` when it resumes."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.cut = False
        self.exposed = True

    def end(self) -> None:
        self.cut = True
        if self.exposed:
            self.task.cancel()


class Drain:
    """The calls in flight on one server's loop. `drain` refuses new calls, gives those in
    flight `grace` seconds, then cuts the rest (`Call`): each ends with UNAVAILABLE and
    `sentence` (a front's own status for it)."""

    def __init__(self, process: str) -> None:
        self.sentence = (
            f"the {process} is shutting down; retry the request once it is back, or on another "
            "replica"
        )
        self.draining = False
        self._calls: set[Call] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def track(self) -> Iterator[Call]:
        """Around one call, in its own task; its tracker ends it with the drain's status where
        `CancelledError` arrives and `cut` is set."""
        task = asyncio.current_task()
        assert task is not None
        call = Call(task)
        self._calls.add(call)
        self._idle.clear()
        try:
            yield call
        finally:
            self._calls.discard(call)
            if not self._calls:
                self._idle.set()

    async def drain(self, grace: float) -> None:
        """Until every call has ended: after `grace` seconds, those left are cut."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace)
        for call in list(self._calls):
            call.end()
        with contextlib.suppress(TimeoutError):  # a cut call ends at its next await or reply
            await asyncio.wait_for(self._idle.wait(), 1.0)


class DrainInterceptor(grpc.aio.ServerInterceptor):
    """Every call of `services` (full names) tracked by `drain`: refused with UNAVAILABLE once
    it drains, ended with UNAVAILABLE when it is cut. Other services (health, reflection) are
    left to the server's own stop."""

    def __init__(self, drain: Drain, services: list[str]) -> None:
        self.drain = drain
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefixes):
            return handler
        kind, build = HANDLER_BUILDERS[(handler.request_streaming, handler.response_streaming)]
        return build(
            self._tracked(getattr(handler, kind)),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _tracked(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        drain = self.drain
        unavailable = grpc.StatusCode.UNAVAILABLE
        if inspect.isasyncgenfunction(behavior):

            async def replies(arg: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if drain.draining:
                    await context.abort(unavailable, drain.sentence)
                with drain.track() as call:
                    try:
                        async for reply in _exposing(behavior(arg, context), call):
                            yield reply
                    except asyncio.CancelledError:
                        if not call.cut:
                            raise
                    if call.cut:
                        await context.abort(unavailable, drain.sentence)

            return replies

        async def reply(arg: Any, context: grpc.aio.ServicerContext) -> Any:
            if drain.draining:
                await context.abort(unavailable, drain.sentence)
            with drain.track() as call:
                try:
                    return await behavior(arg, context)
                except asyncio.CancelledError:
                    if not call.cut:
                        raise
                    await context.abort(unavailable, drain.sentence)

        return reply


async def _exposing(replies: AsyncGenerator[T, None], call: Call) -> AsyncIterator[T]:
    """`replies` until they end, or until `call` is cut (then it returns early: the caller
    ends the call with the drain's status); `call` is exposed while a reply is awaited."""
    async with contextlib.aclosing(replies):
        while not call.cut:
            call.exposed = True
            try:
                reply = await anext(replies)
            except StopAsyncIteration:
                return
            finally:
                call.exposed = False
            if call.cut:
                return
            yield reply
