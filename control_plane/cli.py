"""The `met` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpu_service.checkpoint import DEFAULT_MODEL_DIR, DEFAULT_SEED


def _gpu_service(args: argparse.Namespace) -> None:
    from gpu_service.server import run

    run(args)


def _init_model(args: argparse.Namespace) -> None:
    from gpu_service.checkpoint import init_model

    print(f"wrote {init_model(args.directory, seed=args.seed)}")


def _up(args: argparse.Namespace) -> None:
    from control_plane.demo import run_demo

    sys.exit(run_demo(args))


def build_parser() -> argparse.ArgumentParser:
    from gpu_service.server import add_serve_args

    parser = argparse.ArgumentParser(prog="met", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gpu = sub.add_parser("gpu-service", help="the GPU service process")
    gpu_sub = gpu.add_subparsers(dest="action", required=True)
    serve = gpu_sub.add_parser("serve", help="serve met.v1.ModelService over gRPC")
    add_serve_args(serve)
    serve.set_defaults(fn=_gpu_service)

    init = sub.add_parser("init-model", help="write seeded random weights into a checkpoint")
    init.add_argument("directory", type=Path, nargs="?", default=DEFAULT_MODEL_DIR)
    init.add_argument("--seed", type=int, default=DEFAULT_SEED)
    init.set_defaults(fn=_init_model)

    up = sub.add_parser(
        "up",
        help="start the GPU service on the default model and run one "
        "prefill + verify + propose round against it",
    )
    up.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    up.add_argument("--prompt", default="def fibonacci(n):")
    up.add_argument("--num-drafts", type=int, default=3)
    up.set_defaults(fn=_up)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
