"""`met up`: `--replicas` GPU services (child processes) and the control plane (this process),
serving the default model until SIGTERM or Ctrl-C, over gRPC and, on 8000 unless `--http-port`
says otherwise, OpenAI-compatible HTTP. The TLS and key flags secure the control plane's own
ports; the children listen on loopback, in plaintext, shaped by the service's flags `met up`
takes (`gpu_service.rpc.options.SHAPE_FLAGS`), with prefix snapshots by default.

A port in use, a model a child refuses, a child that dies: one sentence and an exit status,
checked before anything loads where it can be."""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from control_plane.cli.launch import ChildExited, set_admin_key, start_gpu_service, stop
from control_plane.cli.server import check_ports, read_security, serve
from gpu_service.rpc.options import shape_argv
from protos import tls

Child = tuple[subprocess.Popen, str]  # the process and the address it serves on
PROG = "met up"


def run(args: argparse.Namespace) -> int:
    security = read_security(args, PROG, gpu_service=False)
    check_ports(PROG, args)  # before any child loads a model
    logging.basicConfig(level=logging.INFO)
    extra = shape_argv(args)
    if args.otlp_endpoint:
        extra += ["--otlp-endpoint", args.otlp_endpoint]
    set_admin_key()  # before the threads, so that every child inherits the same key
    try:
        children = start_all(args.replicas, lambda: start_gpu_service(args.model, *extra), stop)
    except ChildExited as e:  # the child's own sentence is on stderr already
        return e.status if e.status > 0 else 1
    except TimeoutError as e:
        return _refuse(e, 1)
    for _, target in children:
        print(f"gpu-service ready on {target}", flush=True)
    code = 0
    try:
        args.gpu_service = ",".join(target for _, target in children)
        args.gpu_service_admin_key = None  # the key `set_admin_key` put in the environment
        asyncio.run(serve(args, security))
    except tls.FlagError as e:
        code = _refuse(e, 2)
    finally:
        code = stop_all(children, stop) or code
    return code


def _refuse(error: Exception, status: int) -> int:
    print(f"{PROG}: error: {error}", file=sys.stderr)
    return status


def start_all(
    count: int, start_one: Callable[[], Child], stop_one: Callable[[subprocess.Popen], int]
) -> list[Child]:
    """`count` children started at once (each loads its model for seconds), in start order. If
    any fails to start, those that did are stopped and the first failure is raised."""
    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(start_one) for _ in range(count)]
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
        print(f"gpu-service exited with status {code} ({target})", flush=True)
    return next((code for code in codes if code), 0)
