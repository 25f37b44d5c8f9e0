"""`met up`: the GPU service (a child process) and the control plane (this process), serving
the default model until SIGTERM or Ctrl-C, over gRPC and, on 8000 unless `--http-port` says
otherwise, OpenAI-compatible HTTP. The TLS and key flags secure the control plane's own
ports; the child listens on loopback, in plaintext."""

from __future__ import annotations

import argparse
import asyncio
import logging

from control_plane.launch import start_gpu_service, stop
from control_plane.server import read_security, serve


def run(args: argparse.Namespace) -> int:
    security = read_security(args, "met up", gpu_service=False)
    logging.basicConfig(level=logging.INFO)
    extra = ("--otlp-endpoint", args.otlp_endpoint) if args.otlp_endpoint else ()
    proc, target = start_gpu_service(args.model, *extra)
    print(f"gpu-service ready on {target}", flush=True)
    try:
        args.gpu_service = target
        args.gpu_service_admin_key = None  # the key `start_gpu_service` put in the environment
        asyncio.run(serve(args, security))
    finally:
        code = stop(proc)
        print(f"gpu-service exited with status {code}", flush=True)
    return code
