"""The `--verify-batch` report: every width and shape, the verdict, JSON on disk and stdout,
and `met circuit diff`'s command line."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from control_plane.circuit.verify_batch import (
    DiffError,
    ShapeReport,
    diff_verify_batch,
    verify_batch_failures,
)
from kernels.attention.format import KEY_BLOCK
from protos.defaults import DEFAULT_MODEL_DIR, DRAFTER_DIR
from protos.hub import model_path
from protos.model import ADMIN_KEY_ENV, Capabilities, CircuitModel, ModelError, OpenModel

SCHEMA = Path(__file__).with_name("report.schema.json")


def _int_at_least(text: str, name: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f"{name} takes integers of at least {low}, not {text!r}")
    return value


def _int_list(text: str, name: str, low: int) -> list[int]:
    values = [x for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{name} takes comma-separated integers, not {text!r}")
    return [_int_at_least(x, name, low) for x in values]


def _name_list(text: str, name: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{name} takes comma-separated names, not {text!r}")
    return values


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verify-batch",
        action="store_true",
        required=True,
        help="diff the batched verify (the only diff so far)",
    )
    parser.add_argument(
        "--widths",
        default="2,3,5",
        type=lambda t: _int_list(t, "--widths", 2),
        help="batch widths, each at least 2 (default %(default)s)",
    )
    parser.add_argument(
        "--ks",
        default="2,3,4",
        type=lambda t: _int_list(t, "--ks", 1),
        help="verify widths k (default %(default)s)",
    )
    parser.add_argument("--steps", type=int, default=6, help="verify steps per run")
    parser.add_argument("--reference", default="eager", help="the reference forward")
    parser.add_argument(
        "--forwards",
        default="eager-serial",
        type=lambda t: _name_list(t, "--forwards"),
        help="forwards compared with the reference (default %(default)s)",
    )
    parser.add_argument(
        "--fragment", action="store_true", help="hold a spare slot before sequence n/2"
    )
    _add_drafter_args(parser)
    _add_prompt_args(parser)
    parser.add_argument(
        "--num-drafts",
        default="3",
        type=lambda t: _int_at_least(t, "--num-drafts", 1),
        help="drafts per step: caps each verify at this many drafts, and the drafts per "
        "propose with --mtp (default %(default)s)",
    )
    _add_target_args(parser)


def _add_prompt_args(parser: argparse.ArgumentParser) -> None:
    """What the diff's prompts hold and how they are prefilled."""
    parser.add_argument(
        "--long-prompt",
        default=0,
        type=lambda t: _int_at_least(t, "--long-prompt", 0),
        metavar="TOKENS",
        help="the first sequence's prompt this long and the others' half that, so that they are "
        "verified beside keys reaching blocks past theirs (default: prompts of about 12 tokens)",
    )
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="also run each forward with every prompt's whole blocks restored from a prefix "
        "snapshot of another sequence and the rest prefilled: the same bytes as after a whole "
        f"prefill (needs --long-prompt of at least {2 * (KEY_BLOCK + 1)}, so that every prompt "
        "holds a whole KV block and a token, and a service with --prefix-snapshots)",
    )
    parser.add_argument(
        "--images",
        action="store_true",
        help="every other sequence's prompt holds an image (a fixed picture of its own through "
        "the checkpoint's preprocessor, across the point --snapshot cuts the prompt at), sent "
        "with its prefill: each batch mixes image and text prompts (needs a service with a "
        "vision tower)",
    )


def _add_drafter_args(parser: argparse.ArgumentParser) -> None:
    """Which drafter's batched propose the diff takes too."""
    parser.add_argument("--mtp", action="store_true", help="also diff the batched propose")
    parser.add_argument(
        "--dflash",
        action="store_true",
        help="the sequences draft with the service's DFlash drafter: also diff its batched "
        "block propose (an in-process engine loads --drafter)",
    )
    parser.add_argument(
        "--mix",
        action="store_true",
        help="each batch mixes, sequence by sequence, the rows the scheduler sends together: "
        "a one-row verify (none), MTP drafts, MTP drafts under allowed-token masks (as a "
        "grammar's), and DFlash drafts where the service has a DFlash drafter (an in-process "
        "engine loads --drafter, or MODEL/dflash where there is one); every drafting sequence "
        "then proposes with its own drafter, and that propose is diffed too",
    )


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    """Where the diff runs and where its report goes."""
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("circuit-diff-verify-batch.json"),
        help="where the JSON report goes; - for stdout (default %(default)s)",
    )
    parser.add_argument(
        "--gpu-service",
        metavar="HOST:PORT",
        default=None,
        help="a running GPU service (default: an engine in this process)",
    )
    parser.add_argument(
        "--gpu-service-admin-key",
        default=None,
        metavar="KEY",
        help="the GPU service's admin key, which the diff's forward switches and logits "
        f"read-backs need (default: env {ADMIN_KEY_ENV})",
    )
    parser.add_argument(
        "--model",
        type=model_path,
        default=DEFAULT_MODEL_DIR,
        help="checkpoint of the in-process engine: a directory or a hub id ORG/NAME[@REVISION]",
    )
    parser.add_argument(
        "--drafter",
        type=Path,
        default=None,
        metavar="PATH",
        help="the in-process engine's DFlash drafter with --dflash (default: MODEL/dflash)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the in-process engine compiles its step (`met gpu-service serve --compile`): the "
        "diff then compares compiled against compiled-serial",
    )


def build_report(model: CircuitModel, args: argparse.Namespace, shapes: list[ShapeReport]) -> dict:
    caps = model.capabilities()
    reasons = verify_batch_failures(shapes)
    return {
        # Whether the service's batched verify replays captured graphs (the serial forwards
        # never do, so a PASS against `-serial` holds the graphs to the eager bytes), or
        # compiled ones (the serial forwards replay them too: compiled against compiled-serial).
        "graphs": "compiled" if caps.compiled else "graphed" if caps.graphs else "eager",
        "fragment_slots": args.fragment,
        "drafter": args.mtp,
        "steps": args.steps,
        "long_prompt": args.long_prompt,
        "snapshot": args.snapshot,
        "mix": args.mix,
        "images": args.images,
        "variants": [
            {"name": "reference", "forward": args.reference},
            *({"name": f, "forward": f} for f in args.forwards),
        ],
        "model": {"name": caps.model_name, "device": caps.device, "dtype": caps.dtype},
        "shapes": [
            {
                "ks": r.ks,
                "accepted": r.accepted,
                "comparisons": [c.to_json() for c in r.comparisons],
                "timings": r.timings,
                "detection_control": asdict(r.detection_control),
                "roles": r.roles,
            }
            for r in shapes
        ],
        "verdict": "FAIL" if reasons else "PASS",
        "reasons": reasons,
    }


def validate_args(model: CircuitModel, args: argparse.Namespace) -> None:
    caps = model.capabilities()
    unknown = [f for f in [args.reference, *args.forwards] if f not in caps.forwards]
    if unknown:
        raise DiffError(
            f"forward {unknown[0]!r} is not offered; the service has {', '.join(caps.forwards)}"
        )
    if args.steps < 2:
        raise DiffError(f"--steps is {args.steps}; the detection control needs at least 2")
    if max(args.widths) + int(args.fragment) > caps.free_slots:
        raise DiffError(
            f"a width of {max(args.widths)} needs more than the {caps.free_slots} free slots"
        )
    longest = args.long_prompt + args.steps * (max(args.ks) + 1) + 1
    if args.long_prompt and longest > caps.max_context:
        raise DiffError(
            f"--long-prompt {args.long_prompt} and {args.steps} steps reach {longest} positions; "
            f"the service holds {caps.max_context}"
        )
    if (args.mtp or args.mix) and not caps.has_mtp:
        raise DiffError(f"{'--mtp' if args.mtp else '--mix'}: the model has no MTP head")
    if args.dflash or (args.mix and caps.dflash_block):
        _check_dflash(caps, args, longest)
    if args.snapshot:
        _check_snapshot(caps, args)


def _check_dflash(caps: Capabilities, args: argparse.Namespace, longest: int) -> None:
    flag = "--dflash" if args.dflash else "--mix"
    block = caps.dflash_block
    if not block:
        raise DiffError(f"{flag}: the service has no DFlash drafter (--drafter)")
    if args.num_drafts > block - 1:
        raise DiffError(f"{flag}: --num-drafts {args.num_drafts}; a block gives {block - 1}")
    if longest + block > caps.max_context:
        raise DiffError(
            f"{flag}: a block of {block} after {longest} positions passes the service's "
            f"{caps.max_context}"
        )


def _check_snapshot(caps: Capabilities, args: argparse.Namespace) -> None:
    least = 2 * (caps.kv_block_size + 1)
    if args.long_prompt < least:
        raise DiffError(
            f"--snapshot needs --long-prompt of at least {least}: every prompt a whole KV block "
            "and a token"
        )
    if caps.prefix_snapshots < 1:
        raise DiffError("--snapshot: the service holds no prefix snapshots (--prefix-snapshots)")
    if max(args.widths) + int(args.fragment) + 1 > caps.free_slots:
        raise DiffError(
            f"--snapshot: a width of {max(args.widths)} and the sequence a snapshot is taken "
            f"from need more than the {caps.free_slots} free slots"
        )


def run_diff(model: CircuitModel, args: argparse.Namespace) -> dict:
    """The whole diff; the service's forward is set back as it was found."""
    validate_args(model, args)
    found = model.capabilities().current_forward
    try:
        shapes = diff_verify_batch(
            model,
            args.widths,
            args.ks,
            args.fragment,
            args.mtp,
            args.num_drafts,
            args.steps,
            args.reference,
            args.forwards,
            progress=lambda line: print(line, file=sys.stderr),
            long_prompt=args.long_prompt,
            snapshot=args.snapshot,
            dflash=args.dflash,
            mixed=args.mix,
            images=args.images,
        )
    finally:
        model.set_forward(found)
    return build_report(model, args, shapes)


def _connect(args: argparse.Namespace, open_model: OpenModel | None) -> CircuitModel:
    if args.gpu_service:
        from control_plane.replicas.client import GrpcModel

        if args.compile:
            raise DiffError(
                "--compile compiles the in-process engine; a running service compiles its "
                "step with its own --compile"
            )

        return GrpcModel(args.gpu_service, admin_key=args.gpu_service_admin_key)
    if open_model is None:
        raise DiffError("no --gpu-service to diff, and no engine to build in this process")
    drafter = args.drafter or _model_drafter(args)
    return open_model(args.model, drafter, 1 if args.snapshot else 0, bool(args.compile))


def _model_drafter(args: argparse.Namespace) -> Path | None:
    """The checkpoint's own DFlash drafter: the one `--dflash` needs, or the one `--mix` takes
    where the checkpoint has it."""
    path = args.model / DRAFTER_DIR
    return path if args.dflash or (args.mix and path.is_dir()) else None


def main(args: argparse.Namespace, open_model: OpenModel | None = None) -> int:
    """`met circuit diff`: against `--gpu-service`, else against what `open_model` builds in
    this process (`met` passes the GPU service's builder)."""
    try:
        report = run_diff(_connect(args, open_model), args)
    except (DiffError, ModelError) as e:  # the arguments, or the service refusing them
        print(f"circuit diff could not run: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    if str(args.out) == "-":
        print(text)
    else:
        args.out.write_text(text + "\n")
        shapes = len(report["shapes"])
        print(f"circuit diff {report['verdict']}: {shapes} shapes; the report is in {args.out}")
    if report["reasons"]:
        print("circuit diff FAILED:\n  " + "\n  ".join(report["reasons"]), file=sys.stderr)
        return 1
    return 0
