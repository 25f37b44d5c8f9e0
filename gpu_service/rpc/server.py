"""`met gpu-service serve`: the GPU service process (grpc.aio), with health and reflection."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import replace
from typing import NoReturn

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gpu_service.dflash.weights import check_drafter
from gpu_service.engine import compiled, graphs, ranks
from gpu_service.engine.device import DeviceError, choose_device, default_forward
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.rpc.options import access, use_threads
from gpu_service.rpc.servicer import ErrorInterceptor, ModelServicer
from gpu_service.sizing import plan, plan_report
from protos import ports, stopping, tls
from protos.bodies import RejectUndecodable
from protos.met.v1 import model_pb2, model_pb2_grpc
from protos.telemetry import ServerTracing, setup_tracing

log = logging.getLogger("gpu_service")
PROG = "met gpu-service serve"
SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name
MAX_MESSAGE_BYTES = 2**31 - 1  # protobuf's bound on one message


def build_server(
    servicer: ModelServicer,
    health_servicer: health.aio.HealthServicer,
    drain: stopping.Drain | None = None,
) -> grpc.aio.Server:
    """The server with its services and interceptors, no port yet: `serve` and the tests
    build it the same way. It pings every connection twice per session timeout, so that a
    session whose client went silent ends within the timeout. `drain` tracks its model calls
    for the stop (default: one of its own)."""
    half_timeout_ms = max(1, int(servicer.access.session_timeout * 500))
    drain = drain or stopping.Drain("GPU service")
    server = grpc.aio.server(
        interceptors=[
            stopping.DrainInterceptor(drain, [SERVICE_NAME]),
            RejectUndecodable(),
            ServerTracing(),
            ErrorInterceptor(),
        ],
        options=[
            ("grpc.keepalive_time_ms", half_timeout_ms),
            ("grpc.keepalive_timeout_ms", half_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # a session stream carries no data
            ("grpc.http2.ping_timeout_ms", half_timeout_ms),  # gRPC core's keepalive bound
            # A prefill carries its images' patch rows (402 MB of float32 for one image of
            # 4096 x 4096 pixels): up to protobuf's bound, not gRPC's default 4 MB.
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *ports.EXCLUSIVE,
        ],
    )
    model_pb2_grpc.add_ModelServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return server


def _load(args: argparse.Namespace, svc: ServiceConfig, device: torch.device) -> Engine:
    """The engine `serve`'s flags ask for: on one device, or rank 0 of a tensor-parallel group
    whose other ranks it starts."""
    if args.tensor_parallel_size > 1:
        engine: Engine = ranks.launch(
            ranks.Launch(
                args.model,
                svc,
                args.dtype,
                device.type,
                args.tensor_parallel_size,
                args.tp_reduce,
                args.tp_timeout,
                args.threads,
                args.drafter,
                bool(args.expert_parallel),
            )
        )
    else:
        engine = Engine(args.model, svc, args.dtype, device, drafter=args.drafter)
    engine.set_forward(default_forward(device))
    return engine


async def serve(
    args: argparse.Namespace,
    svc: ServiceConfig,
    device: torch.device,
    credentials: grpc.ServerCredentials | None,
) -> None:
    """Serve until SIGTERM or SIGINT, which stop it at any moment: a stop during the load (a
    compile takes minutes) leaves the engine thread to the process's end (`stopping.leave`)."""
    use_threads(args.threads)
    flush_spans = setup_tracing("gpu-service", args.otlp_endpoint)
    servicer = ModelServicer(access(args))
    health_servicer = health.aio.HealthServicer()
    drain = stopping.Drain("GPU service")
    server = build_server(servicer, health_servicer, drain)
    port = tls.add_port(server, f"{args.host}:{args.port}", credentials)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    loop = asyncio.get_running_loop()
    stop = stopping.stop_event(loop)
    await server.start()
    stopping.say(f"gpu-service listening on {args.host}:{port}")

    load = servicer.run_on_engine_thread(lambda: _load(args, svc, device))
    loaded, engine = await stopping.unless_stopped(load, stop)
    if loaded:
        assert engine is not None
        servicer.engine = engine
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        for line in _serving_lines(engine, svc, args, device):
            stopping.say(line)
        await stop.wait()
    stopping.ignore_signals(loop)
    stopping.say("gpu-service shutting down")
    await health_servicer.enter_graceful_shutdown()
    servicer.end_sessions()
    await drain.drain(args.grace)
    await server.stop(0)
    if isinstance(engine, ranks.TpEngine):
        engine.close()
    flush_spans()


def _serving_lines(
    engine: Engine, svc: ServiceConfig, args: argparse.Namespace, device: torch.device
) -> list[str]:
    """What the start-up says once the engine serves: its step, then the serving line."""
    caps = engine.capabilities()
    quantized = f", linears in {caps.quantization}" if caps.quantization else ""
    placed = ", experts placed" if args.expert_parallel else ""
    split = (
        f" x {caps.tensor_parallel_size} ranks ({args.tp_reduce} reduction{placed})"
        if caps.tensor_parallel_size > 1
        else ""
    )
    return [
        *_step_lines(engine, svc, args.compile_why, device),
        f"gpu-service serving {engine.name} ({svc.num_slots} slots{quantized}) on "
        f"{caps.device}{split}, forward {engine.forward_name}"
        f"{' (compiled)' if caps.compiled else ''}",
    ]


def _step_lines(engine: Engine, svc: ServiceConfig, why: str, device: torch.device) -> list[str]:
    """What the start-up says of the step: the keys that would not compile (the first reason
    stands for all: they are one forward's), what compiles in the background, or why the
    CPU's step runs eagerly."""
    lines = []
    graphs = engine.choice.graphs if isinstance(engine, Engine) else None
    if graphs is not None and graphs.failed:
        reason = next(iter(graphs.failed.values())).splitlines()[0]
        lines.append(
            f"gpu-service could not compile {len(graphs.failed)} step graphs, which run "
            f"eagerly: {reason}"
        )
    if graphs is not None and graphs.compiled:
        lines.append(compiled.queued(graphs.pending, svc.compile_cache))
    elif device.type == "cpu":
        lines.append(f"gpu-service runs the step eagerly: {why}")
    return lines


def _refuse(message: object) -> NoReturn:
    """End the process as argparse ends it on a bad flag: one sentence on stderr, status 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _device_or_exit(flag: str) -> torch.device:
    """The `--device` flag resolved before anything loads."""
    try:
        return choose_device(flag)
    except DeviceError as e:
        _refuse(e)


def _ranks_or_exit(size: int, device: torch.device) -> None:
    """`--tensor-parallel-size` checked against the devices before anything loads: rank r
    takes cuda:r."""
    if size == 1 or device.type == "cpu":
        return
    if device.index not in (None, 0):
        _refuse(f"--tensor-parallel-size {size} puts rank r on cuda:r; drop the index of --device")
    count = torch.cuda.device_count()
    if count < size:
        _refuse(
            f"--tensor-parallel-size {size} needs {size} CUDA devices; this machine has {count}"
        )


def _drafter_or_exit(args: argparse.Namespace) -> None:
    """A `--drafter` the engine cannot serve ends the process with a sentence, before any
    weight loads."""
    if args.drafter is None:
        return
    try:
        check_drafter(args.drafter, ModelConfig.load(args.model))
    except (OSError, ValueError) as e:
        _refuse(e)


def _planned(args: argparse.Namespace, device: torch.device, compiling: bool) -> ServiceConfig:
    """The memory plan (gpu_service/sizing/plan.py), made before anything loads and summed up on
    stdout; a plan that does not fit the device ends the process. -> the settings planned
    (`--num-slots auto` settled). Compiled keys hold buffers as captured graphs do."""
    try:
        wanted = graphs.wanted(args.cuda_graphs, device, os.environ) or compiling
        made = plan.from_args(args, device, wanted)
    except (OSError, ValueError) as e:
        _refuse(e)
    stopping.say(plan_report.summary(made))
    if made.fits is False:
        _refuse(plan_report.refusal(made))
    return made.svc


def run(args: argparse.Namespace) -> None:
    stopping.watch_parent()
    credentials = tls.or_exit(PROG, tls.server_credentials, args)
    device = _device_or_exit(args.device)
    _ranks_or_exit(args.tensor_parallel_size, device)
    _drafter_or_exit(args)
    try:
        on, why = compiled.decide(args.compile, device, args.tensor_parallel_size, os.environ)
    except ValueError as e:
        _refuse(e)
    args.compile_why = why
    svc = replace(_planned(args, device, on), compile=on)
    logging.basicConfig(level=logging.INFO)
    tls.or_exit(PROG, lambda a: asyncio.run(serve(a, svc, device, credentials)), args)
    stopping.leave(0)
