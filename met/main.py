"""The `met` command."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protos.defaults import DEFAULT_MODEL_DIR, DEFAULT_SEED
from protos.hub import model_path

GPU_SERVE = "met gpu-service serve"


def _gpu_service(args: argparse.Namespace) -> None:
    from protos import ports, tls

    # Before torch loads: a busy port is refused in a blink.
    tls.or_exit(GPU_SERVE, lambda a: ports.check_free(a.host, {"--port": a.port}), args)
    from gpu_service.rpc.server import run

    run(args)


def _gpu_service_plan(args: argparse.Namespace) -> None:
    from gpu_service.sizing.plan_report import run

    sys.exit(run(args))


def _control_plane(args: argparse.Namespace) -> None:
    from control_plane.cli.server import run

    run(args)


def _init_model(args: argparse.Namespace) -> None:
    from training.checkpoint import init_model

    print(f"wrote {init_model(args.directory, seed=args.seed)}")


def _quantize(args: argparse.Namespace) -> None:
    from gpu_service.model.quantize import quantize_checkpoint

    try:
        names = quantize_checkpoint(args.src, args.dst, args.fp8_block)
    except (ValueError, FileNotFoundError) as e:
        print(f"met quantize: error: {e}", file=sys.stderr)
        sys.exit(2)
    block = f"{args.fp8_block} x {args.fp8_block}"
    print(f"{args.dst}: {len(names)} linear weights in FP8 ({block} blocks)")


def _up(args: argparse.Namespace) -> None:
    from control_plane.cli.up import run
    from gpu_service.rpc.options import shape_argv
    from protos.stopping import leave

    leave(run(args, shape_argv(args)))


def _generate(args: argparse.Namespace) -> None:
    from control_plane.cli.generate import run

    sys.exit(run(args))


def _in_process_engine(args: argparse.Namespace) -> None:
    """For a command that builds an engine in this process: the Triton interpreter decision,
    made for the device the engine picks, before anything imports a kernel; the service's
    `--threads`."""
    from gpu_service.engine.device import choose_device
    from gpu_service.rpc.options import use_threads

    choose_device()
    use_threads(args.threads)


def _circuit_diff(args: argparse.Namespace) -> None:
    from protos.model import OpenModel

    open_model: OpenModel | None = None
    if not args.gpu_service:
        _in_process_engine(args)
        from gpu_service.engine import facade

        open_model = facade.open_engine
    from control_plane.circuit.report import main

    sys.exit(main(args, open_model))


def _bench(args: argparse.Namespace) -> None:
    _in_process_engine(args)
    from tools.bench.run import run

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
    """`met up`'s own arguments, the GPU service's that shape its serving, then the control
    plane's."""
    from control_plane.cli import server
    from gpu_service.rpc.options import UP_PREFIX_SNAPSHOTS, add_shape_args

    parser.add_argument("--model", type=model_path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--replicas",
        type=_replica_count,
        default=1,
        metavar="N",
        help="GPU-service children, each on its own free port, all serving --model; the "
        "control plane routes among them (default: %(default)s)",
    )
    add_shape_args(parser, prefix_snapshots=UP_PREFIX_SNAPSHOTS)
    server.add_serve_args(parser, gpu_service_required=False)


class _Commands(argparse._SubParsersAction):
    """Subcommands whose flags are added only when the command is parsed, so that `met --help`
    imports no command's module; an argument the command does not take ends the parse with the
    command's usage and the closest of its flags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fills: dict[str, Callable[[argparse.ArgumentParser], None]] = {}

    def add(
        self, name: str, fill: Callable[[argparse.ArgumentParser], None], **kwargs: Any
    ) -> argparse.ArgumentParser:
        """The command `name`, its flags added by `fill` when it is parsed."""
        self.fills[name] = fill
        return self.add_parser(name, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        command = self.choices.get(values[0])
        if command is not None and (fill := self.fills.pop(values[0], None)) is not None:
            fill(command)
        super().__call__(parser, namespace, values, option_string)
        extras = getattr(namespace, argparse._UNRECOGNIZED_ARGS_ATTR, None)
        if command is not None and extras:
            command.error(unrecognized(command, extras))


def unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's sentence for arguments `parser` does not take, with the closest flag."""
    flags = [flag for action in parser._actions for flag in action.option_strings]
    typed = [arg.split("=", 1)[0] for arg in extras if arg.startswith("--")]
    close = [c for arg in typed for c in difflib.get_close_matches(arg, flags, n=1)]
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def _commands(parser: argparse.ArgumentParser, dest: str) -> _Commands:
    commands = parser.add_subparsers(dest=dest, required=True, action=_Commands)
    assert isinstance(commands, _Commands)
    return commands


def _fill_gpu_service(gpu: argparse.ArgumentParser) -> None:
    """`met gpu-service serve` and `met gpu-service plan`."""
    from gpu_service.rpc import options

    gpu_sub = _commands(gpu, "action")
    gpu_sub.add("serve", options.add_serve_args, help="serve met.v1.ModelService over gRPC")
    gpu_sub.choices["serve"].set_defaults(fn=_gpu_service)
    gpu_plan = gpu_sub.add(
        "plan",
        _fill_plan,
        help="the memory plan of serving MODEL: each part's bytes against the device's memory",
        description="The bytes serve would allocate for MODEL with these flags, from shapes "
        "alone, as a CUDA service allocates them (captured graphs counted unless "
        "--no-cuda-graphs or --device cpu). Exit status 0 when the plan fits or no memory is "
        "known, 1 when it does not fit, 2 on a bad flag or config.",
    )
    gpu_plan.set_defaults(fn=_gpu_service_plan)


def _fill_plan(gpu_plan: argparse.ArgumentParser) -> None:
    from gpu_service.rpc.options import add_plan_args

    gpu_plan.add_argument(
        "model",
        type=model_path,
        metavar="MODEL",
        help="a checkpoint directory, a bare config.json, or a Hugging Face hub id "
        "ORG/NAME[@REVISION]",
    )
    add_plan_args(gpu_plan)
    gpu_plan.add_argument("--json", action="store_true", help="print one JSON object")


def _fill_control_plane(cp: argparse.ArgumentParser) -> None:
    def fill_serve(cp_serve: argparse.ArgumentParser) -> None:
        from control_plane.cli import server

        server.add_serve_args(cp_serve)

    cp_sub = _commands(cp, "action")
    serve = cp_sub.add("serve", fill_serve, help="serve met.v1.GenerationService over gRPC")
    serve.set_defaults(fn=_control_plane)


def _fill_generate(gen: argparse.ArgumentParser) -> None:
    from control_plane.cli import generate

    generate.add_args(gen)


def _fill_circuit(circuit: argparse.ArgumentParser) -> None:
    def fill_diff(diff: argparse.ArgumentParser) -> None:
        from control_plane.circuit import report
        from gpu_service.rpc.options import add_threads_arg

        report.add_args(diff)
        add_threads_arg(diff)

    circuit_sub = _commands(circuit, "action")
    diff = circuit_sub.add("diff", fill_diff, help="compare forwards byte for byte")
    diff.set_defaults(fn=_circuit_diff)


def _fill_bench(bench_cmd: argparse.ArgumentParser) -> None:
    from gpu_service.rpc.options import add_threads_arg
    from tools.bench import run as bench

    bench.add_args(bench_cmd)
    add_threads_arg(bench_cmd)


def _fill_train(train_cmd: argparse.ArgumentParser) -> None:
    from training import dflash_options
    from training import options as train_options

    train_options.add_args(train_cmd)
    stages = train_cmd.add_subparsers(dest="stage", metavar="{dflash}")
    dflash = stages.add_parser(
        "dflash", help="train a DFlash block drafter for a trained checkpoint (MODEL/dflash)"
    )
    dflash_options.add_args(dflash)
    dflash.set_defaults(fn=_train_dflash)


def _train_dflash(args: argparse.Namespace) -> None:
    from training.dflash_run import run

    sys.exit(run(args))


def _fill_quantize(quantize: argparse.ArgumentParser) -> None:
    quantize.add_argument(
        "--fp8-block", type=int, required=True, metavar="N", help="the scale block (only 128)"
    )
    quantize.add_argument("src", type=Path, help="a bf16 or fp32 checkpoint directory")
    quantize.add_argument("dst", type=Path, help="a new directory for the FP8 checkpoint")


def _fill_init_model(init: argparse.ArgumentParser) -> None:
    init.add_argument("directory", type=Path, help="a new checkpoint directory")
    init.add_argument("--seed", type=int, default=DEFAULT_SEED)


# Each command: its flags' filler, what it runs (None: a group of commands), its help.
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Any, str]] = {
    "gpu-service": (_fill_gpu_service, None, "the GPU service process"),
    "control-plane": (_fill_control_plane, None, "the control plane process"),
    "up": (
        _add_up_args,
        _up,
        "start the GPU service(s) and the control plane on the default model and serve",
    ),
    "generate": (_fill_generate, _generate, "stream one request from a running control plane"),
    "circuit": (_fill_circuit, None, "proofs that a forward computes the reference"),
    "bench": (_fill_bench, _bench, "what speculation buys: methods, batching, split"),
    "train": (
        _fill_train,
        _train,
        "train the default checkpoint (and its MTP head) on the stdlib's source",
    ),
    "quantize": (
        _fill_quantize,
        _quantize,
        "rewrite a checkpoint in the block-FP8 layout Qwen publishes",
    ),
    "init-model": (_fill_init_model, _init_model, "write seeded random weights into a checkpoint"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="met", description=__doc__)
    sub = _commands(parser, "command")
    for name, (fill, fn, help) in COMMANDS.items():
        command = sub.add(name, fill, help=help)
        if fn is not None:
            command.set_defaults(fn=fn)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
