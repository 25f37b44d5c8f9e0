"""`met control-plane serve`: the control plane process (grpc.aio), with health and
reflection, driving a GPU service through the scheduler thread."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control_plane.api import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_PROMPT_BYTES,
    DEFAULT_METHOD,
    Admission,
    GenerationServicer,
)
from control_plane.client import GrpcModel
from control_plane.metrics import Metrics
from control_plane.scheduler.loop import Scheduler
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.seq import MTP, NONE
from control_plane.tokenizer import load_tokenizer
from protos.bodies import RejectUndecodable
from protos.defaults import DEFAULT_MODEL_DIR
from protos.met.v1 import generate_pb2, generate_pb2_grpc
from protos.telemetry import setup_tracing

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
DEFAULT_PORT = 50050


def add_serve_args(parser: argparse.ArgumentParser, gpu_service_required: bool = True) -> None:
    """The server's own arguments, then one per scheduler option (from its fields)."""
    if gpu_service_required:
        parser.add_argument(
            "--gpu-service", required=True, metavar="HOST:PORT", help="the GPU service to drive"
        )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: a free one)")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None if not gpu_service_required else DEFAULT_MODEL_DIR,
        help="directory with tokenizer.json (default: the served model's)",
    )
    parser.add_argument(
        "--method",
        choices=[MTP, NONE],
        default=DEFAULT_METHOD,
        help="speculative method of requests that leave it unspecified",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="default for requests that leave it unset",
    )
    parser.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=DEFAULT_MAX_PROMPT_BYTES,
        metavar="BYTES",
        help="refuse text prompts longer than this in UTF-8, before tokenizing them; gRPC's "
        "own 4 MiB message bound still applies (default: %(default)s)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help="export spans over OTLP here (shortcut for OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (0: a free one)",
    )
    parser.add_argument(
        "--grace", type=float, default=5.0, help="seconds in-flight streams get on SIGTERM"
    )
    SchedulerOptions.add_arguments(parser)


def admission(args: argparse.Namespace) -> Admission:
    return Admission(args.method, args.max_new_tokens, args.max_prompt_bytes)


def build_scheduler(args: argparse.Namespace) -> Scheduler:
    tokenizer = load_tokenizer(args.tokenizer)
    metrics = Metrics() if args.metrics_port is not None else None
    return Scheduler(
        lambda: GrpcModel(args.gpu_service),
        tokenizer,
        SchedulerOptions.from_args(args),
        metrics=metrics,
    )


async def serve(args: argparse.Namespace) -> None:
    flush_spans = setup_tracing("control-plane", args.otlp_endpoint)
    scheduler = build_scheduler(args)
    scheduler.start()
    if scheduler.metrics is not None:
        metrics_port = scheduler.metrics.serve(args.metrics_port, args.host)
        print(f"control-plane metrics on http://{args.host}:{metrics_port}/metrics", flush=True)
    servicer = GenerationServicer(scheduler, scheduler.tokenizer, admission(args))
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server(interceptors=[RejectUndecodable()])  # INVALID_ARGUMENT, not UNKNOWN
    generate_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(
        f"control-plane listening on {args.host}:{port} (GPU service {args.gpu_service})",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("control-plane shutting down", flush=True)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(args.grace)
    await loop.run_in_executor(None, scheduler.stop)
    flush_spans()


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO)
    asyncio.run(serve(args))
