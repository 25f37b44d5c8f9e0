"""`met gpu-service serve`'s flags; torch-free, so `met` parses fast for every command."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from gpu_service.config import ServiceConfig
from protos import tls
from protos.defaults import DEFAULT_MODEL_DIR
from protos.model import ADMIN_KEY_ENV


@dataclass(frozen=True)
class Access:
    """Who may call what (protos/model.py): sessions and the admin key."""

    admin_key: str | None = None  # None: every admin call is refused
    session_timeout: float = 10.0  # seconds to notice a session's client has vanished


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
        "--device",
        default="auto",
        help="auto (CUDA when torch sees it, else the CPU), cpu, cuda or cuda:N (default auto)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
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
        "--threads", type=int, default=1, help="torch intra-op threads of the engine (CPU)"
    )
    _add_graphs_flag(parser)
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help="export spans over OTLP here (shortcut for OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    parser.add_argument(
        "--grace", type=float, default=5.0, help="seconds in-flight calls get on SIGTERM"
    )
    tls.add_server_args(parser)
    parser.add_argument(
        "--admin-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help=f"the key admin calls (SetForward, ReadLogits, MeasureCosts) must send (default: "
        f"env {ADMIN_KEY_ENV}; with neither, or an empty key, admin calls are refused)",
    )
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=Access.session_timeout,
        metavar="SECONDS",
        help="free a session's sequences at most this long after its client vanished "
        "(default %(default)s)",
    )


def _add_graphs_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=ServiceConfig.cuda_graphs,
        help="on a CUDA device, replay the batched verify and the drafter's chain from captured "
        "graphs, per batch bucket and rows per sequence (METRALE_NO_MTP_VERIFY_GRAPHS set also "
        "turns them off; default: on)",
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
        cuda_graphs=args.cuda_graphs,
    )


def access(args: argparse.Namespace) -> Access:
    if args.session_timeout <= 0:
        message = f"--session-timeout is {args.session_timeout}; it must be above 0"
        print(f"met gpu-service serve: error: {message}", file=sys.stderr)
        raise SystemExit(2)
    return Access(admin_key=args.admin_key or None, session_timeout=args.session_timeout)
