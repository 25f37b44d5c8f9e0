"""The `met` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from protos.defaults import DEFAULT_MODEL_DIR, DEFAULT_SEED
from protos.hub import model_path


def _gpu_service(args: argparse.Namespace) -> None:
    from gpu_service.server import run

    run(args)


def _gpu_service_plan(args: argparse.Namespace) -> None:
    from gpu_service.plan_report import run

    sys.exit(run(args))


def _control_plane(args: argparse.Namespace) -> None:
    from control_plane.cli.server import run

    run(args)


def _init_model(args: argparse.Namespace) -> None:
    from training.checkpoint import init_model

    print(f"wrote {init_model(args.directory, seed=args.seed)}")


def _quantize(args: argparse.Namespace) -> None:
    from gpu_service.quantize import quantize_checkpoint

    try:
        names = quantize_checkpoint(args.src, args.dst, args.fp8_block)
    except (ValueError, FileNotFoundError) as e:
        print(f"met quantize: error: {e}", file=sys.stderr)
        sys.exit(2)
    block = f"{args.fp8_block} x {args.fp8_block}"
    print(f"{args.dst}: {len(names)} linear weights in FP8 ({block} blocks)")


def _up(args: argparse.Namespace) -> None:
    from control_plane.cli.up import run

    sys.exit(run(args))


def _generate(args: argparse.Namespace) -> None:
    from control_plane.cli.generate import run

    sys.exit(run(args))


def _choose_device() -> None:
    """For a command that builds an engine in this process: the Triton interpreter decision,
    made for the device the engine picks, before anything imports a kernel."""
    from gpu_service.device import choose_device

    choose_device()


def _circuit_diff(args: argparse.Namespace) -> None:
    if not args.gpu_service:
        _choose_device()
    from control_plane.circuit.report import main

    sys.exit(main(args))


def _bench(args: argparse.Namespace) -> None:
    _choose_device()
    from control_plane.benchmarks.run import run

    sys.exit(run(args))


def _train(args: argparse.Namespace) -> None:
    from training.run import run

    sys.exit(run(args))


def _replica_count(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"the number of GPU services must be a whole number of at least 1, not {text!r}"
        )
    return int(text)


def _add_up_args(parser: argparse.ArgumentParser) -> None:
    """`met up`'s own arguments; the control plane's follow them."""
    parser.add_argument("--model", type=model_path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--replicas",
        type=_replica_count,
        default=1,
        metavar="N",
        help="GPU-service children, each on its own free port, all serving --model; the "
        "control plane routes among them (default: %(default)s)",
    )


def _add_gpu_service(sub: argparse._SubParsersAction) -> None:
    """`met gpu-service serve` and `met gpu-service plan`."""
    from gpu_service.options import add_plan_args, add_serve_args

    gpu = sub.add_parser("gpu-service", help="the GPU service process")
    gpu_sub = gpu.add_subparsers(dest="action", required=True)
    gpu_serve = gpu_sub.add_parser("serve", help="serve met.v1.ModelService over gRPC")
    add_serve_args(gpu_serve)
    gpu_serve.set_defaults(fn=_gpu_service)
    gpu_plan = gpu_sub.add_parser(
        "plan",
        help="the memory plan of serving MODEL: each part's bytes against the device's memory",
        description="The bytes serve would allocate for MODEL with these flags, from shapes "
        "alone, as a CUDA service allocates them (captured graphs counted unless "
        "--no-cuda-graphs or --device cpu). Exit status 0 when the plan fits or no memory is "
        "known, 1 when it does not fit, 2 on a bad flag or config.",
    )
    gpu_plan.add_argument(
        "model",
        type=model_path,
        metavar="MODEL",
        help="a checkpoint directory, a bare config.json, or a Hugging Face hub id "
        "ORG/NAME[@REVISION]",
    )
    add_plan_args(gpu_plan)
    gpu_plan.add_argument("--json", action="store_true", help="print one JSON object")
    gpu_plan.set_defaults(fn=_gpu_service_plan)


def build_parser() -> argparse.ArgumentParser:
    from control_plane.benchmarks import run as bench
    from control_plane.circuit import report
    from control_plane.cli import generate, server
    from training import options as train_options

    parser = argparse.ArgumentParser(prog="met", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    _add_gpu_service(sub)

    cp = sub.add_parser("control-plane", help="the control plane process")
    cp_sub = cp.add_subparsers(dest="action", required=True)
    cp_serve = cp_sub.add_parser("serve", help="serve met.v1.GenerationService over gRPC")
    server.add_serve_args(cp_serve)
    cp_serve.set_defaults(fn=_control_plane)

    up = sub.add_parser(
        "up", help="start the GPU service(s) and the control plane on the default model and serve"
    )
    _add_up_args(up)
    server.add_serve_args(up, gpu_service_required=False)
    up.set_defaults(fn=_up)

    gen = sub.add_parser("generate", help="stream one request from a running control plane")
    generate.add_args(gen)
    gen.set_defaults(fn=_generate)

    circuit = sub.add_parser("circuit", help="proofs that a forward computes the reference")
    circuit_sub = circuit.add_subparsers(dest="action", required=True)
    diff = circuit_sub.add_parser("diff", help="compare forwards byte for byte")
    report.add_args(diff)
    diff.set_defaults(fn=_circuit_diff)

    bench_cmd = sub.add_parser("bench", help="what speculation buys: methods, batching, split")
    bench.add_args(bench_cmd)
    bench_cmd.set_defaults(fn=_bench)

    train_cmd = sub.add_parser(
        "train", help="train the default checkpoint (and its MTP head) on the stdlib's source"
    )
    train_options.add_args(train_cmd)
    train_cmd.set_defaults(fn=_train)

    quantize = sub.add_parser(
        "quantize", help="rewrite a checkpoint in the block-FP8 layout Qwen publishes"
    )
    quantize.add_argument(
        "--fp8-block", type=int, required=True, metavar="N", help="the scale block (only 128)"
    )
    quantize.add_argument("src", type=Path, help="a bf16 or fp32 checkpoint directory")
    quantize.add_argument("dst", type=Path, help="a new directory for the FP8 checkpoint")
    quantize.set_defaults(fn=_quantize)

    init = sub.add_parser("init-model", help="write seeded random weights into a checkpoint")
    init.add_argument("directory", type=Path, help="a new checkpoint directory")
    init.add_argument("--seed", type=int, default=DEFAULT_SEED)
    init.set_defaults(fn=_init_model)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
