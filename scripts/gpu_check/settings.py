"""What the check runs: one frozen dataclass, the GPU's values by default and smaller ones
under `--cpu`; the command line is built from its fields, by name."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from protos.defaults import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[2]


def _default_out() -> Path:
    # On the borrowed GPU machine only what lands under $OUT comes back.
    return Path(os.environ.get("OUT", ".")) / "gpu_check.json"


def _flag(text: str) -> dict:
    """A field's metadata that makes it a command-line flag."""
    return {"help": text}


@dataclass(frozen=True)
class Settings:
    device: str = "cuda"  # `cuda`, or `cpu` with --cpu; the service's `--device`
    out: Path = field(default_factory=_default_out, metadata=_flag("the JSON report"))
    model: Path = field(
        default=DEFAULT_MODEL_DIR,
        metadata=_flag("checkpoint the service serves and the profile loads"),
    )
    forward: str = field(
        default="", metadata=_flag("forward of every check (default: the device's serving one)")
    )
    prompts: tuple[str, ...] = ("def fib(n):", "import os\n", "class Stack:\n")
    max_new_tokens: int = field(default=32, metadata=_flag("tokens per generation"))
    diff_widths: str = field(default="2,3,5", metadata=_flag("the circuit diff's --widths"))
    diff_ks: str = field(default="2,3,4", metadata=_flag("the circuit diff's --ks"))
    diff_steps: int = field(default=6, metadata=_flag("the circuit diff's --steps"))
    kernel_tests: str = field(
        default="", metadata=_flag("pytest -k selection of tests/kernels (default: all)")
    )
    profile_batches: tuple[int, ...] = field(
        default=(1, 8, 32), metadata=_flag("sequences per profiled step, comma-separated")
    )
    repeats: int = field(default=5, metadata=_flag("timed steps per batch size"))
    gemm_rows: int = field(
        # Past 64 rows the GEMM walks its splits in one program: the comparison crosses there.
        default=128,
        metadata=_flag("the GEMM's row bytes compared over M = 1 .. this"),
    )
    gemm_speed_rows: tuple[int, ...] = field(
        default=(1, 16, 64), metadata=_flag("M at which the GEMM is timed against cuBLAS")
    )
    moe_shape: tuple[int, ...] = field(
        default=(2048, 512, 512, 10), metadata=_flag("H,I,E,k of the fused MoE kernel's check")
    )
    moe_rows: tuple[int, ...] = field(
        default=(4, 32, 256),
        metadata=_flag("rows at which the fused MoE kernel is timed against the routed path"),
    )
    fp8_rows: tuple[int, ...] = field(
        # Up to 64 rows the FP8 GEMM quantizes x itself; past them a kernel does first.
        default=(1, 8, 64, 1024),
        metadata=_flag("M at which the FP8 GEMM is checked and timed against the bf16 one"),
    )

    @property
    def diff_forwards(self) -> tuple[str, str]:
        """The reference and the forwards it is compared with: the forward against itself
        (run to run) and its serial twin (batch invariance); both byte for byte."""
        base = self.forward.removesuffix("-serial")
        return self.forward, f"{base},{base}-serial"


GPU = Settings()
# The same checks at a size that fits a test on two cores, where Triton is interpreted.
CPU = replace(
    GPU,
    device="cpu",
    max_new_tokens=12,
    diff_widths="2",
    diff_ks="2,3",
    diff_steps=2,
    kernel_tests="rmsnorm or argmax",
    profile_batches=(1, 4),
    repeats=2,
    gemm_rows=8,
    gemm_speed_rows=(1, 4),
    moe_shape=(64, 32, 8, 2),
    moe_rows=(4, 8),
    fp8_rows=(1, 70),
)


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, not {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, not {text!r}")
    return values


def _parser_type(default: object) -> Callable[[str], object]:
    return _int_tuple if isinstance(default, tuple) else type(default)


def _show(value: object) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _defaults(name: str) -> str:
    gpu, cpu = getattr(GPU, name), getattr(CPU, name)
    shown = ([f"default {_show(gpu)}"] if gpu != "" else []) + (
        [f"--cpu {_show(cpu)}"] if cpu != gpu else []
    )
    return f" ({'; '.join(shown)})" if shown else ""


def build_parser() -> argparse.ArgumentParser:
    from scripts import gpu_check

    parser = argparse.ArgumentParser(prog="gpu_check", description=gpu_check.__doc__)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU, smaller")
    for f in fields(Settings):
        if "help" in f.metadata:
            parser.add_argument(
                f"--{f.name.replace('_', '-')}",
                type=_parser_type(getattr(GPU, f.name)),
                default=None,
                help=f.metadata["help"] + _defaults(f.name),
            )
    return parser


def parse_args(argv: list[str] | None = None) -> Settings:
    args = vars(build_parser().parse_args(argv))
    base = CPU if args.pop("cpu") else GPU
    return replace(base, **{k: v for k, v in args.items() if v is not None})
