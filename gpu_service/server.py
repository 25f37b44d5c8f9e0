"""`met gpu-service serve`: the GPU service process (grpc.aio), with health and reflection."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gpu_service.checkpoint import DEFAULT_MODEL_DIR, ensure_weights
from gpu_service.config import ServiceConfig
from gpu_service.engine import Engine
from gpu_service.servicer import ErrorInterceptor, ModelServicer
from protos.met.v1 import model_pb2, model_pb2_grpc

log = logging.getLogger("gpu_service")
SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="checkpoint directory (default: the bundled model)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=50051, help="port (0 picks a free one)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="serving dtype (default: the checkpoint's)",
    )
    parser.add_argument(
        "--verify-tiers",
        default=ServiceConfig.verify_tiers,
        help="verify buffers by slot, SLOTS:DRAFTS,... (default %(default)s)",
    )
    parser.add_argument("--max-context", type=int, default=ServiceConfig.max_context)
    parser.add_argument("--max-rows", type=int, default=ServiceConfig.max_rows)
    parser.add_argument("--max-batch", type=int, default=ServiceConfig.max_batch)
    parser.add_argument("--max-prefill-tokens", type=int, default=ServiceConfig.max_prefill_tokens)
    parser.add_argument(
        "--grace", type=float, default=5.0, help="seconds in-flight calls get on SIGTERM"
    )


def service_config(args: argparse.Namespace) -> ServiceConfig:
    if args.max_context % 64:
        raise SystemExit(f"--max-context {args.max_context} is not a multiple of 64")
    return ServiceConfig(
        verify_tiers=args.verify_tiers,
        max_context=args.max_context,
        max_rows=args.max_rows,
        max_batch=args.max_batch,
        max_prefill_tokens=args.max_prefill_tokens,
    )


async def serve(args: argparse.Namespace) -> None:
    svc = service_config(args)
    servicer = ModelServicer()
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    model_pb2_grpc.add_ModelServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    print(f"gpu-service listening on {args.host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    if args.model.resolve() == DEFAULT_MODEL_DIR:
        ensure_weights(args.model)
    servicer.engine = await loop.run_in_executor(None, Engine, args.model, svc, args.dtype)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"gpu-service serving {servicer.engine.name} ({svc.num_slots} slots)", flush=True)

    await stop.wait()
    print("gpu-service shutting down", flush=True)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(args.grace)


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO)
    asyncio.run(serve(args))
