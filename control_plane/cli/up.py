"""`met up`: `--replicas` GPU services (child processes) and the control plane (this process),
serving the default model until SIGTERM or Ctrl-C, over gRPC and, on 8000 unless `--http-port`
says otherwise, OpenAI-compatible HTTP. The TLS and key flags secure the control plane's own
ports; the children listen on loopback, in plaintext, shaped by the service's flags `met up`
takes (`gpu_service.rpc.options.SHAPE_FLAGS`), with prefix snapshots by default.

A port in use, a model a child refuses, a child that dies: one sentence and an exit status,
checked before anything loads where it can be. SIGTERM or Ctrl-C at any moment, a child's
start included, ends every child started before `met up` exits (`launch.stop`); a child whose
`met up` is gone stops itself (`protos.stopping.watch_parent`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from types import FrameType

from control_plane.cli.launch import (
    ChildExited,
    set_admin_key,
    start_gpu_service,
    stop,
    stop_started,
)
from control_plane.cli.server import Security, check_ports, read_security, serve
from protos import stopping, tls

Child = tuple[subprocess.Popen, str]  # the process and the address it serves on
PROG = "met up"


def run(args: argparse.Namespace, shape_argv: list[str]) -> int:
    """`shape_argv`: the children's flags that shape their serving, as `met` read them."""
    security = read_security(args, PROG, gpu_service=False)
    check_ports(PROG, args)  # before any child loads a model
    logging.basicConfig(level=logging.INFO)
    extra = list(shape_argv)
    if args.otlp_endpoint:
        extra += ["--otlp-endpoint", args.otlp_endpoint]
    set_admin_key()  # before the threads, so that every child inherits the same key
    with signals_raise():
        return _serve(args, security, extra)


def _serve(args: argparse.Namespace, security: Security, extra: list[str]) -> int:
    """The children started, then the control plane served until a stop; every child stopped
    -> the exit status."""
    try:
        children = start_all(args.replicas, lambda: start_gpu_service(args.model, *extra), stop)
    except Stopped:
        return _stopped_starting()
    except ChildExited as e:  # the child's own sentence is on stderr already
        return e.status if e.status > 0 else 1
    except TimeoutError as e:
        return _refuse(e, 1)
    code = 0
    try:
        for _, target in children:
            stopping.say(f"gpu-service ready on {target}")
        args.gpu_service = ",".join(target for _, target in children)
        args.gpu_service_admin_key = None  # the key `set_admin_key` put in the environment
        asyncio.run(serve(args, security))
    except tls.FlagError as e:
        code = _refuse(e, 2)
    except Stopped:  # before `serve` took the signals over
        pass
    finally:
        _ignore_signals()
        code = stop_all(children, stop) or code
    return code


class Stopped(Exception):
    """SIGTERM or SIGINT before `serve` took them over."""


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM and SIGINT raise `Stopped` in the main thread (until `serve` takes them over);
    the handlers before are back at the end."""
    before = {sig: signal.getsignal(sig) for sig in stopping.SIGNALS}
    for sig in stopping.SIGNALS:
        signal.signal(sig, _stopped)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _stopped(signum: int, _frame: FrameType | None) -> None:
    _ignore_signals()  # one stop: a second signal is that stop
    raise Stopped(signal.Signals(signum).name)


def _ignore_signals() -> None:
    for sig in stopping.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _stopped_starting() -> int:
    """Every child started so far stopped, however far its start has got -> the first nonzero
    exit status, else 0."""
    codes = stop_started()
    for code in codes:
        stopping.say(f"gpu-service exited with status {code} (stopped while starting)")
    return next((code for code in codes if code), 0)


def _refuse(error: Exception, status: int) -> int:
    print(f"{PROG}: error: {error}", file=sys.stderr)
    return status


def start_all(
    count: int, start_one: Callable[[], Child], stop_one: Callable[[subprocess.Popen], int]
) -> list[Child]:
    """`count` children started at once (each loads its model for seconds), in start order. If
    any fails to start, those that did are stopped and the first failure is raised. A signal
    handler's exception interrupts the wait (the starts go on, to be stopped by the caller)."""
    pool = ThreadPoolExecutor(max_workers=count)
    futures = [pool.submit(start_one) for _ in range(count)]
    pool.shutdown(wait=False)
    wait(futures)
    errors = [e for f in futures if (e := f.exception()) is not None]
    children = [f.result() for f in futures if f.exception() is None]
    if errors:
        stop_all(children, stop_one)
        raise errors[0]
    return children


def stop_all(children: list[Child], stop_one: Callable[[subprocess.Popen], int]) -> int:
    """Every child stopped at once, each one's exit status printed; the first nonzero, else 0."""
    with ThreadPoolExecutor(max_workers=max(len(children), 1)) as pool:
        codes = list(pool.map(stop_one, [proc for proc, _ in children]))
    for (_, target), code in zip(children, codes, strict=True):
        stopping.say(f"gpu-service exited with status {code} ({target})")
    return next((code for code in codes if code), 0)
