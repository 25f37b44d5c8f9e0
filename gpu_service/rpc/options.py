"""The flags of `met gpu-service serve` and `plan`; torch-free, so `met` parses fast."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from gpu_service.engine.compiled import NO_COMPILE_ENV
from gpu_service.model.config import (
    DFLASH_VERIFY_TIERS,
    ServiceConfig,
)
from gpu_service.sizing import MAX_AUTO_SLOTS
from gpu_service.tp import DEFAULT_REDUCE, DEFAULT_TIMEOUT_S, REDUCES
from kernels.attention.format import KEY_BLOCK
from protos import tls
from protos.defaults import DEFAULT_MODEL_DIR
from protos.hub import model_path
from protos.model import ADMIN_KEY_ENV

# `met up`'s prefix snapshots, as compose.yaml's MET_PREFIX_SNAPSHOTS default: the control
# plane's prefix cache is on by default, and it needs them.
UP_PREFIX_SNAPSHOTS = 32
# The flags that shape a model's serving, which `met up` takes and passes to its GPU services.
SHAPE_FLAGS = (
    "--drafter",
    "--device",
    "--tensor-parallel-size",
    "--expert-parallel",
    "--max-context",
    "--kv-blocks",
    "--prefix-snapshots",
    "--compile",
)


@dataclass(frozen=True)
class Access:
    """Who may call what (protos/model.py): sessions and the admin key."""

    admin_key: str | None = None  # None: every admin call is refused
    session_timeout: float = 10.0  # seconds to notice a session's client has vanished
    max_slots_per_session: int | None = None  # None: every slot but one

    def session_slots(self, num_slots: int) -> int:
        """The most sequences a session without the admin key may hold at once: the flag's,
        else every slot but one, so that no such client holds them all and the control plane
        (whose session holds the key, and may take every slot) always finds one."""
        if self.max_slots_per_session is not None:
            return self.max_slots_per_session
        return max(1, num_slots - 1)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=model_path,
        default=DEFAULT_MODEL_DIR,
        help="checkpoint directory, or a Hugging Face hub id ORG/NAME[@REVISION] (default: the "
        "bundled model)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=50051, help="port (0 picks a free one)")
    add_plan_args(parser)
    add_threads_arg(parser)
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        help="export spans over OTLP here (shortcut for OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    parser.add_argument(
        "--tp-reduce",
        choices=REDUCES,
        default=DEFAULT_REDUCE,
        help="how a row-parallel output is summed over ranks: ordered (gathered and added in "
        "rank order: a row's bytes never depend on its batch) or nccl (the backend's "
        "all-reduce; gloo's on the CPU) (default %(default)s)",
    )
    parser.add_argument(
        "--tp-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="a collective waiting this long for a rank ends the service (default %(default)s)",
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
    parser.add_argument(
        "--max-slots-per-session",
        type=whole_number(1),
        default=Access.max_slots_per_session,
        metavar="N",
        help="the most sequences one session without the admin key may hold at once; past "
        "them AllocSequence is RESOURCE_EXHAUSTED (default: every slot but one, so that no "
        "client holds them all and the control plane, whose calls carry the key, always finds "
        "one)",
    )


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    """`--threads`: the service's, and every command's that runs an engine in its process."""
    parser.add_argument(
        "--threads",
        type=whole_number(1),
        default=1,
        help="torch intra-op threads of the engine (CPU) (default %(default)s)",
    )


def use_threads(threads: int) -> None:
    """`--threads` applied. The engine runs on a worker thread, and an OpenMP team outside the
    main thread doubled the step time at 2 threads on a 2-core machine (measured: 13 ms against
    6.3 ms at 1), so one thread is the default; more pay off only with cores to spare."""
    import torch  # here, so that parsing stays torch-free

    torch.set_num_threads(threads)


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """The flags that size the service: `serve`'s, and `plan`'s, which plans what they ask."""
    add_shape_args(parser)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
        default=None,
        help="serving dtype (default: the checkpoint's)",
    )
    parser.add_argument(
        "--verify-tiers",
        default=None,
        help=f"verify buffers by slot, SLOTS:DRAFTS,... (default {ServiceConfig.verify_tiers}; "
        f"with --drafter {DFLASH_VERIFY_TIERS})",
    )
    _add_slots_arg(parser)
    parser.add_argument("--max-rows", type=int, default=ServiceConfig.max_rows)
    parser.add_argument("--max-batch", type=int, default=ServiceConfig.max_batch)
    parser.add_argument("--max-prefill-tokens", type=int, default=ServiceConfig.max_prefill_tokens)
    _add_image_args(parser)
    _add_graphs_flag(parser)
    parser.add_argument(
        "--device-memory",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="memory the plan must fit: bytes, or with a unit (141GB, 80GiB); default: the CUDA "
        "device's free memory, none on the CPU (the plan then gives no verdict)",
    )


def _add_image_args(parser: argparse.ArgumentParser) -> None:
    """The bounds on a prompt's images (a model with a vision tower): what a prefill past them
    is refused with, and what the plan sizes the tower's activations for."""
    parser.add_argument(
        "--limit-images-per-prompt",
        type=whole_number(1),
        default=ServiceConfig.max_images_per_prompt,
        metavar="N",
        help="images one sequence's prompt may hold (vLLM's --limit-mm-per-prompt image count; "
        "its default, %(default)s)",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=whole_number(1),
        default=ServiceConfig.max_image_pixels,
        metavar="N",
        help="pixels of one image as the tower takes it (its grid's patches times "
        "patch_size ** 2, after the preprocessor's resize); the plan counts the tower's "
        "activations at an image this large (default %(default)s: 4096 x 4096, Qwen3-VL's "
        "preprocessor's longest_edge)",
    )


def add_shape_args(
    parser: argparse.ArgumentParser, prefix_snapshots: int = ServiceConfig.prefix_snapshots
) -> None:
    """`SHAPE_FLAGS` (`--prefix-snapshots` defaulting to `prefix_snapshots`): where the model
    runs and what each sequence, the KV pool and the prefix cache may hold."""
    parser.add_argument(
        "--drafter",
        type=Path,
        default=None,
        metavar="PATH",
        help="a DFlash block drafter's directory (z-lab's published layout) served beside the "
        "MTP head, for requests with method dflash (default: none)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when torch sees it, else the CPU), cpu, cuda or cuda:N (default auto)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tensor_parallel_size",
        type=whole_number(1),
        default=1,
        metavar="N",
        help="ranks the model is split over, one process per device (cuda:0 .. N-1, or N CPU "
        "processes); the plan is one rank's (default %(default)s)",
    )
    parser.add_argument(
        "--expert-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --tensor-parallel-size N, place the routed experts on the ranks, rank r "
        "holding experts r E/N .. (r + 1) E/N - 1 whole, each row's sent to them and back and "
        "added in expert order, rather than split every expert's intermediate over the ranks; "
        "attention, GDN and the shared expert stay split (default: off)",
    )
    _add_capacity_args(parser, prefix_snapshots)
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on the CPU, compile the batched verify and the drafter's chain per batch bucket "
        "with torch.compile (inductor, C++ wrapper); a start-up line says what it compiled and "
        f"how long it took (default: on where a C++ compiler is, unless {NO_COMPILE_ENV} is set)",
    )


def shape_argv(args: argparse.Namespace) -> list[str]:
    """The flags `add_shape_args` added, as `met gpu-service serve`'s arguments (one left at
    None is left to the service's default)."""
    values = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in SHAPE_FLAGS}
    out = []
    for flag, v in values.items():
        if isinstance(v, bool):  # a switch: --compile or --no-compile
            out.append(flag if v else f"--no-{flag[2:]}")
        elif v is not None:
            out += [flag, str(v)]
    return out


def _add_slots_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-slots",
        type=parse_num_slots,
        default=None,
        metavar="N|auto",
        help="sequences served at once: N slots take the tiers' capacities in order, the last "
        f"tier's repeated past them (or the first N); auto: the most, up to {MAX_AUTO_SLOTS}, "
        "whose memory plan fits the device memory (on the CPU with no --device-memory, the "
        "tiers' count); default: one slot per tier entry",
    )


def _add_capacity_args(parser: argparse.ArgumentParser, prefix_snapshots: int) -> None:
    """What the service holds: the context each sequence may reach, the KV pool, snapshots."""
    parser.add_argument(
        "--max-context",
        type=multiple_of(KEY_BLOCK),
        default=None,
        help="positions a sequence may reach, a multiple of 64: a limit, not an allocation "
        "(the KV pool's blocks are, --kv-blocks); default: the model's max_position_embeddings, "
        "lowered to what the memory plan holds when the device memory is known",
    )
    parser.add_argument(
        "--kv-blocks",
        type=parse_kv_blocks,
        default=ServiceConfig.kv_blocks,
        metavar="N|auto",
        help="blocks of the paged attention KV pool (target and drafter), 64 positions of "
        "every attention layer each, taken as sequences grow and given back as they shrink "
        "or end; auto: as many as 95%% of the device memory holds after the rest of the plan "
        "(on the CPU with no --device-memory, 0); 0: enough for every slot's whole context "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--prefix-snapshots",
        type=whole_number(0),
        default=prefix_snapshots,
        metavar="N",
        help="prefix snapshots the service can hold (each every GDN layer's state and conv "
        "window at a block boundary, and the drafter's carry), so that a prompt starting with a "
        "cached prefix prefills only the rest; 0: no prefix cache (default %(default)s)",
    )


def _add_graphs_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="inductor's caches, so that a second start loads the compiled step "
        "(default: $TORCHINDUCTOR_CACHE_DIR where set, else $XDG_CACHE_HOME/met/compile)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=ServiceConfig.cuda_graphs,
        help="on a CUDA device, replay the batched verify and the drafter's chain from captured "
        "graphs, per batch bucket and rows per sequence (METRALE_NO_MTP_VERIFY_GRAPHS set also "
        "turns them off; default: on)",
    )


def multiple_of(step: int) -> Callable[[str], int]:
    """A flag's parser: a positive multiple of `step`, else a sentence saying so."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < step or n % step:
            raise argparse.ArgumentTypeError(
                f"expected a positive multiple of {step}, got {text!r}"
            )
        return n

    return parse


def whole_number(least: int) -> Callable[[str], int]:
    """A flag's parser: a whole number of at least `least`, else a sentence saying so."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = least - 1
        if n < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {least}")
        return n

    return parse


def parse_kv_blocks(text: str) -> int | str:
    """`--kv-blocks`: a whole number, or `auto` (the plan's to settle)."""
    return text if text == "auto" else whole_number(0)(text)


def parse_num_slots(text: str) -> int | str:
    """`--num-slots`: a whole number of at least 1, or `auto`."""
    if text == "auto":
        return text
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of at least 1, or auto; got {text!r}"
        )
    return int(text)


# Decimal units as memory is sold (141GB), binary ones as allocators count (80GiB).
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AMOUNT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str) -> int:
    """`--device-memory`: `150000000000`, `141GB`, `139.8GB`, `80GiB`, `512MiB` -> bytes."""
    amount = _AMOUNT.fullmatch(text)
    unit = _UNITS.get(amount[2].lower()) if amount else None
    if amount is None or unit is None or (unit == 1 and "." in amount[1]):
        raise argparse.ArgumentTypeError(
            f"expected bytes, or a number with a unit (KB, MB, GB, TB, KiB, MiB, GiB, TiB) such "
            f"as 141GB or 80GiB; got {text!r}"
        )
    return int(Decimal(amount[1]) * unit)


def access(args: argparse.Namespace) -> Access:
    if args.session_timeout <= 0:
        message = f"--session-timeout is {args.session_timeout}; it must be above 0"
        print(f"met gpu-service serve: error: {message}", file=sys.stderr)
        raise SystemExit(2)
    return Access(
        admin_key=args.admin_key or None,
        session_timeout=args.session_timeout,
        max_slots_per_session=args.max_slots_per_session,
    )
