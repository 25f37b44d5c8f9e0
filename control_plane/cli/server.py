"""`met control-plane serve`: the control plane process (grpc.aio), with health and
reflection, driving a GPU service through the scheduler thread."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import socket
import ssl
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control_plane.admission import auth
from control_plane.admission.door import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_PROMPT_BYTES,
    DEFAULT_METHOD,
    Admission,
    Door,
)
from control_plane.admission.workers import (
    DEFAULT_MEMORY_MB,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WORKERS,
    AdmissionBounds,
)
from control_plane.cli.http_drain import DrainHttp
from control_plane.fronts import http_app, http_limits, openai_http
from control_plane.fronts.api import GenerationServicer
from control_plane.fronts.openai_routes import MAX_BODY_BYTES
from control_plane.replicas.client import GrpcModel
from control_plane.replicas.router import Router, Target, TargetError, parse_targets
from control_plane.scheduler.env import Env
from control_plane.scheduler.methods import METHODS
from control_plane.scheduler.metrics import Metrics
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Joins, Scheduler
from control_plane.text.chat import KWARGS, parse_kwargs
from control_plane.text.detok import Tokenizer
from control_plane.text.images import (
    LIMIT_FLAG,
    LOCAL_FLAG,
    PIL_MOST_PIXELS,
    MediaBounds,
    limit_per_prompt,
)
from control_plane.text.tokenizer import Tokenization
from protos import ports, stopping, tls
from protos.bodies import RejectUndecodable
from protos.defaults import CONTROL_PLANE_PORT
from protos.met.v1 import generate_pb2, generate_pb2_grpc
from protos.model import ADMIN_KEY_ENV
from protos.telemetry import setup_tracing

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
DEFAULT_PORT = CONTROL_PLANE_PORT
DEFAULT_HTTP_PORT = 8000  # vLLM's; `met up` serves HTTP by default, `serve` only when asked
PROG = "met control-plane serve"
# What a stop waits for the schedulers: a call in flight to a GPU service ends with its channel.
ROUTER_STOP_S = 1.0


@dataclasses.dataclass(frozen=True)
class Security:
    """What the TLS and key flags name, read and checked before anything starts."""

    server: grpc.ServerCredentials | None  # None: plaintext
    gpu_service: grpc.ChannelCredentials | None  # the channel to the GPU service; None: plaintext
    api_keys: frozenset[str]  # empty: the generation API is open


def add_serve_args(parser: argparse.ArgumentParser, gpu_service_required: bool = True) -> None:
    """The server's own arguments, then one per scheduler option (from its fields)."""
    if gpu_service_required:
        add_gpu_service_args(parser)
    add_listen_args(parser, None if gpu_service_required else DEFAULT_HTTP_PORT)
    add_model_args(parser)
    parser.add_argument(
        "--method",
        choices=list(METHODS),
        default=DEFAULT_METHOD,
        help="speculative method of requests that leave it unspecified (default: auto, the "
        "server's choice each step from what each option delivered)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="default for requests that leave it unset (default: the rest of the context)",
    )
    parser.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=DEFAULT_MAX_PROMPT_BYTES,
        metavar="BYTES",
        help="refuse text prompts longer than this in UTF-8, before tokenizing them; a "
        f"request's own bound ({MAX_BODY_BYTES >> 20} MiB) still applies (default: %(default)s)",
    )
    add_admission_args(parser)
    add_media_args(parser)
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
    tls.add_server_args(parser)
    auth.add_args(parser)
    SchedulerOptions.add_arguments(parser)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The served model's text side: its tokenizer, the names it answers to, its chats'
    default template variables."""
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="a checkpoint directory whose tokenizer files override those the GPU service serves",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="the names the model answers to in requests (the first is the one reported); "
        "default: the checkpoint's",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=_template_kwargs,
        default={},
        metavar="JSON",
        help="chat template variables for every chat, a JSON object such as "
        "{\"enable_thinking\": false} (vLLM's flag); a request's own chat_template_kwargs "
        "override them by name",
    )


def _template_kwargs(text: str) -> dict[str, Any]:
    try:
        return parse_kwargs(text)
    except ValueError as e:
        sentence = str(e).replace(KWARGS, "--default-chat-template-kwargs", 1)
        raise argparse.ArgumentTypeError(sentence) from None


def add_admission_args(parser: argparse.ArgumentParser) -> None:
    """The bounds of the work a request's template, tools and grammar cost."""
    parser.add_argument(
        "--admission-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="refuse a request whose template, tools or grammar take a worker longer than this "
        "to render, close or build (default: %(default)s)",
    )
    parser.add_argument(
        "--admission-memory-mb",
        type=int,
        default=DEFAULT_MEMORY_MB,
        metavar="MIB",
        help="refuse a request whose template, tools or grammar need more memory than this "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--admission-workers",
        type=int,
        default=DEFAULT_WORKERS,
        metavar="N",
        help="processes that render chats and build grammars, each one request at a time "
        "(default: %(default)s)",
    )


def add_media_args(parser: argparse.ArgumentParser) -> None:
    """The bounds of a request's images (`MediaBounds`), under vLLM's names where it has them."""
    parser.add_argument(
        LIMIT_FLAG,
        type=_limit,
        default=MediaBounds.max_images,
        metavar="JSON",
        help='the most images a request may hold, as vLLM writes it: {"image": N} (other '
        "modalities: 0) (default: %(default)s images)",
    )
    parser.add_argument(
        "--max-image-bytes",
        type=http_limits.count,
        default=MediaBounds.max_image_bytes,
        metavar="BYTES",
        help="refuse an image whose file is larger (default: %(default)s)",
    )
    parser.add_argument(
        "--max-image-file-pixels",
        type=_pixels,
        default=MediaBounds.max_image_file_pixels,
        metavar="N",
        help="refuse an image file of more pixels (width x height), read from its header "
        "before any pixel is decoded; the GPU service's --max-image-pixels bounds what the "
        "tower takes after the preprocessor's resize (default: %(default)s)",
    )
    parser.add_argument(
        LOCAL_FLAG,
        type=_directory,
        default=None,
        metavar="DIR",
        help="let image parts name files under DIR as file:// URLs (vLLM's flag; links that "
        "lead out of it are refused); default: no local files",
    )


def _limit(text: str) -> int:
    try:
        return limit_per_prompt(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _pixels(text: str) -> int:
    value = http_limits.count(text)
    if value > PIL_MOST_PIXELS:
        raise argparse.ArgumentTypeError(
            f"{value} is more pixels than PIL opens ({PIL_MOST_PIXELS})"
        )
    return value


def _directory(text: str) -> str:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return str(path.resolve())


def media_bounds(args: argparse.Namespace) -> MediaBounds:
    return MediaBounds(
        args.limit_mm_per_prompt,
        args.max_image_bytes,
        args.max_image_file_pixels,
        args.allowed_local_media_path,
    )


def add_gpu_service_args(parser: argparse.ArgumentParser) -> None:
    """The GPU services to drive, and how to reach them."""
    parser.add_argument(
        "--gpu-service",
        required=True,
        metavar="HOST:PORT[,...]",
        help="the GPU service to drive, or several replicas, comma-separated; "
        "dns:///NAME:PORT is every address NAME resolves to, resolved again as it changes "
        "(compose's scaled services)",
    )
    tls.add_client_args(parser, "gpu-service", "the GPU service")
    parser.add_argument(
        "--gpu-service-admin-key",
        default=None,
        help=f"the GPU service's admin key, for the measured cost model's MeasureCosts "
        f"(default: env {ADMIN_KEY_ENV})",
    )


def add_listen_args(parser: argparse.ArgumentParser, http_port: int | None) -> None:
    """Where the control plane listens: gRPC, and HTTP on `http_port` unless told otherwise."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: a free one)")
    default = "off" if http_port is None else http_port
    parser.add_argument(
        "--http-port",
        type=int,
        default=http_port,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on "
        f"this port, with the same TLS and keys (0: a free one; default: {default})",
    )
    parser.add_argument(
        "--http-read-timeout",
        type=http_limits.seconds,
        default=http_limits.HttpLimits.read_timeout,
        metavar="SECONDS",
        help="close an HTTP connection whose request's headers and body have not all arrived "
        "within this many seconds (with a 408 when part came); responses, streams included, "
        "are not bounded (default: %(default)s)",
    )
    parser.add_argument(
        "--http-max-connections",
        type=http_limits.count,
        default=http_limits.HttpLimits.max_connections,
        metavar="N",
        help="open HTTP connections served at once; a request on a connection past them is "
        "answered 503 and the connection closed (default: %(default)s)",
    )


def read_security(args: argparse.Namespace, prog: str, gpu_service: bool = True) -> Security:
    """The flags' credentials and keys, or the process ended with status 2 and a sentence
    naming the flag. Without `gpu_service` (`met up`, whose GPU service is its own loopback
    child) the channel to it stays plaintext."""

    def build(a: argparse.Namespace) -> Security:
        client = tls.channel_credentials(a, "gpu-service") if gpu_service else None
        return Security(tls.server_credentials(a), client, auth.read_keys(a))

    return tls.or_exit(prog, build, args)


def admission(args: argparse.Namespace) -> Admission:
    bounds = AdmissionBounds(
        args.admission_timeout, args.admission_memory_mb, args.admission_workers
    )
    names = tuple(args.served_model_name)
    return Admission(
        args.method,
        args.max_new_tokens,
        args.max_prompt_bytes,
        bounds,
        model_names=names,
        chat_kwargs=args.default_chat_template_kwargs,
        media=media_bounds(args),
    )


def read_tokenizer(args: argparse.Namespace) -> Tokenization | None:
    """`--tokenizer`'s files, or None for the served model's."""
    if args.tokenizer is None:
        return None
    try:
        return Tokenization.from_dir(args.tokenizer)
    except (OSError, ValueError) as e:
        raise tls.FlagError(f"--tokenizer {args.tokenizer}: {e}") from None


def read_targets(args: argparse.Namespace) -> list[Target]:
    try:
        return parse_targets(args.gpu_service)
    except TargetError as e:
        raise tls.FlagError(f"--gpu-service {args.gpu_service!r}: {e}") from None


def build_router(args: argparse.Namespace, credentials: grpc.ChannelCredentials | None) -> Router:
    """A scheduler per replica the targets name, all under one metrics registry (served on
    the HTTP port, as vLLM serves its own, and on `--metrics-port` when given), its series
    labelled with the name the model is served under."""
    targets = tls.or_exit(PROG, read_targets, args)
    tokenizer = tls.or_exit(PROG, read_tokenizer, args)
    metrics = Metrics(next(iter(args.served_model_name), None))
    opts = SchedulerOptions.from_args(args)
    return grpc_router(targets, tokenizer, opts, metrics, credentials, args.gpu_service_admin_key)


def grpc_router(
    targets: list[Target],
    tokenizer: Tokenizer | Tokenization | None,
    opts: SchedulerOptions,
    metrics: Metrics | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    admin_key: str | None = None,
    env: Env | None = None,
) -> Router:
    """A router whose replicas' schedulers drive their GPU services over gRPC (`env`: the
    switches the schedulers read; default the process environment)."""

    def build(address: str, authority: str | None, joins: Joins) -> Scheduler:
        def connect() -> GrpcModel:
            return GrpcModel(
                address, admin_key=admin_key, credentials=credentials, authority=authority
            )

        return Scheduler(
            connect, tokenizer, opts, env, metrics=metrics, replica=address, joins=joins
        )

    router = Router(targets, build)
    router.metrics = metrics
    return router


def build_server(
    servicer: GenerationServicer,
    health_servicer: health.aio.HealthServicer,
    api_keys: frozenset[str],
    drain: stopping.Drain | None = None,
) -> grpc.aio.Server:
    """The server with its services and interceptors, no port yet: `serve` and the tests
    build it the same way. `drain` tracks its generation calls for the stop (default: one of
    its own)."""
    drain = drain or stopping.Drain("control plane")
    # INVALID_ARGUMENT, not UNKNOWN, for a body that does not parse.
    interceptors: list[grpc.aio.ServerInterceptor] = [
        stopping.DrainInterceptor(drain, [SERVICE_NAME]),
        RejectUndecodable(),
    ]
    if api_keys:
        # Outermost: a call without a key is refused before its body is even parsed.
        interceptors.insert(0, auth.RequireApiKey(api_keys, [SERVICE_NAME]))
    options = (*ports.EXCLUSIVE, ("grpc.max_receive_message_length", MAX_BODY_BYTES))
    server = grpc.aio.server(interceptors=interceptors, options=options)
    generate_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return server


async def serve(args: argparse.Namespace, security: Security) -> None:
    """Serve until SIGTERM or SIGINT, which stop it at any moment (replicas still loading, calls
    in flight): calls get `--grace` seconds, then UNAVAILABLE (HTTP 503) and a sentence.
    FlagError naming the flag of a port that cannot be bound, before the GPU services are
    asked anything."""
    flush_spans = setup_tracing("control-plane", args.otlp_endpoint)
    router = build_router(args, security.gpu_service)
    loop = asyncio.get_running_loop()
    health_servicer = health.aio.HealthServicer()
    servicer = GenerationServicer(router, admission(args))
    drain = stopping.Drain("control plane")
    server = build_server(servicer, health_servicer, security.api_keys, drain)
    port = tls.add_port(server, f"{args.host}:{args.port}", security.server)
    http_socket = bind_listener(args.host, args.http_port, "--http-port")
    if router.metrics is not None and args.metrics_port is not None:
        metrics_port = serve_metrics(router.metrics, args.host, args.metrics_port)
        stopping.say(f"control-plane metrics on http://{args.host}:{metrics_port}/metrics")

    def tell_health(up: bool) -> None:  # from the router's thread, or this one
        status = health_pb2.HealthCheckResponse.SERVING if up else NOT_SERVING
        for name in ("", SERVICE_NAME):
            asyncio.run_coroutine_threadsafe(health_servicer.set(name, status), loop)

    # Before anything waits: a signal from here on, the announcement's moment included, stops
    # cleanly.
    stop = stopping.stop_event(loop)
    # Every replica asked once before the server answers: health is right from the first check.
    # A replica whose engine compiles answers late: the stop does not wait for its answer.
    started, _ = await stopping.unless_stopped(stopping.in_thread(router.start), stop)
    if not started:  # a replica is still asked: no scheduler runs yet, no call to drain
        stopping.ignore_signals(loop)
        servicer.door.close()
        return
    warming = loop.run_in_executor(None, servicer.door.warm)  # beside serving, not before it
    # A stop closes the workers under a warm-up still setting them up: its error is no one's.
    warming.add_done_callback(lambda f: f.cancelled() or f.exception())
    tell_health(router.healthy)
    router.on_health = tell_health
    await server.start()
    http = (
        serve_http(args, servicer.door, security, http_socket, router.metrics, drain)
        if http_socket is not None
        else None
    )
    stopping.say(
        f"control-plane listening on {args.host}:{port} ({describe(security)}, "
        f"GPU service {args.gpu_service})"
    )
    await stop.wait()
    stopping.ignore_signals(loop)
    stopping.say("control-plane shutting down")
    await health_servicer.enter_graceful_shutdown()
    await drain.drain(args.grace)
    await asyncio.gather(server.stop(0), *([http.stop()] if http else []))
    await _stop_router(router)
    servicer.door.close()
    await asyncio.wait([warming], timeout=1)
    flush_spans()


async def _stop_router(router: Router) -> None:
    """The schedulers stopped, waiting `ROUTER_STOP_S` at most: one blocked on a call its GPU
    service is slow to answer (a compile) is left to the process's end."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.in_thread(router.stop), ROUTER_STOP_S)


def listen_ports(args: argparse.Namespace) -> dict[str, int | None]:
    """The ports the control plane listens on, by the flag that sets each."""
    return {"--port": args.port, "--http-port": args.http_port, "--metrics-port": args.metrics_port}


def bind_listener(host: str, port: int | None, flag: str) -> socket.socket | None:
    """`port` bound on `host` for an HTTP listener (None: none asked for); FlagError naming
    `flag` when it cannot be bound."""
    if port is None:
        return None
    try:
        return ports.bind(host, port)
    except OSError as e:
        raise ports.refusal(host, port, flag, e) from None


def serve_metrics(metrics: Metrics, host: str, port: int) -> int:
    """Prometheus' /metrics on `port`; -> the bound port, or FlagError naming --metrics-port."""
    try:
        return metrics.serve(port, host)
    except OSError as e:
        raise ports.refusal(host, port, "--metrics-port", e) from None


def serve_http(
    args: argparse.Namespace,
    door: Door,
    security: Security,
    sock: socket.socket,
    metrics: Metrics | None = None,
    drain: stopping.Drain | None = None,
) -> openai_http.HttpServer:
    """The OpenAI-compatible front on `door` and the bound `sock`, under the gRPC port's
    certificate and keys; `/metrics` too, as vLLM serves it on its API port. `drain`: the gRPC
    port's, so that a stop drains both fronts at once."""
    tls: dict = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key}
    if args.tls_client_ca is not None:
        tls |= {"ssl_ca_certs": str(args.tls_client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    app = http_app.build_app(door, security.api_keys, metrics=metrics)
    app = DrainHttp(app, drain or stopping.Drain("control plane"))
    limits = http_limits.HttpLimits(args.http_read_timeout, args.http_max_connections)
    http = openai_http.serve(app, args.host, args.http_port, args.grace, sock, limits, **tls)
    scheme = "https" if security.server else "http"
    stopping.say(f"control-plane OpenAI API on {scheme}://{args.host}:{http.port}/v1")
    return http


def describe(security: Security) -> str:
    keys = "API key required" if security.api_keys else "no API key"
    return f"{'TLS' if security.server else 'plaintext'}, {keys}"


def check_ports(prog: str, args: argparse.Namespace) -> None:
    """Every port the control plane listens on free, else the process ended with status 2 and
    a sentence naming the port and its flag."""
    tls.or_exit(prog, lambda a: ports.check_free(a.host, listen_ports(a)), args)


def _free_large_blocks_at_once() -> None:
    """glibc's malloc keeps a freed block of several megabytes for reuse once it has seen
    one (its mmap threshold rises with the largest block freed): a request's 4 MB body would
    stay in this process after its refusal. A fixed threshold returns every block of 128 KiB
    and more to the system when it is freed."""
    try:
        ctypes.CDLL(None).mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def run(args: argparse.Namespace) -> None:
    stopping.watch_parent()
    _free_large_blocks_at_once()
    security = read_security(args, PROG)
    tls.or_exit(PROG, read_targets, args)  # a bad list ends the process before anything starts
    check_ports(PROG, args)
    logging.basicConfig(level=logging.INFO)
    tls.or_exit(PROG, lambda a: asyncio.run(serve(a, security)), args)
    stopping.leave(0)
