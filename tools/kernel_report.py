"""What every Triton kernel of the `triton` forward compiles to on a GPU, built on a CPU:
`python -m tools.kernel_report --target sm_80,sm_90,sm_100 --shapes default,qwen3-next-80b`.
With `--tensor-parallel-size N` (and `--expert-parallel`) the forward is rank 0's of N, its
shapes those one rank runs: heads and intermediates divided, or under expert parallelism its
share of the experts whole, their rows an even share of the pairs.

At each shape set (a model's config.json) the forward runs on the `meta` device with the triton
ops: a prefill, a verify, a decode and the drafter's pass, with logits, argmax and fold, at
batches of 1, 8 and 32 sequences; where a DFlash drafter's config sits beside the model's
(`dflash/config.json`), its context writes ride the prefill and the verify, and its block
propose (non-causal attention over the context) runs at each batch too. Each kernel launch the
real wrappers make is caught before it reaches a driver: its arguments bound and specialised as
Triton's launcher binds them, its grid kept. Every distinct compile is built with
`triton.compile` for each target, and the wheel's `cuobjdump` reads the cubin's registers,
stack (spilled registers) and shared memory. Nothing runs on a GPU and nothing is downloaded;
the compiles run in parallel processes."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tools.compiling import Catcher, Launch, catching, compile_all, compiler_mode

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "gpu_service" / "models"
SHAPE_SETS = {
    "default": MODELS / "default" / "config.json",
    "qwen3-next-80b": MODELS / "qwen3-next-80b-a3b" / "config.json",
    "qwen3-next-80b-fp8": MODELS / "qwen3-next-80b-a3b-fp8" / "config.json",
    "qwen3.5-27b": MODELS / "qwen3.5-27b" / "config.json",
    "qwen3.5-35b-a3b": MODELS / "qwen3.5-35b-a3b" / "config.json",
    "qwen3.5-397b-a17b": MODELS / "qwen3.5-397b-a17b" / "config.json",
    "qwen3.5-35b-a3b-fp8": MODELS / "qwen3.5-35b-a3b-fp8" / "config.json",
    "qwen3.5-397b-a17b-fp8": MODELS / "qwen3.5-397b-a17b-fp8" / "config.json",
    "qwen3.5-122b-a10b": MODELS / "qwen3.5-122b-a10b" / "config.json",
    "qwen3.5-122b-a10b-fp8": MODELS / "qwen3.5-122b-a10b-fp8" / "config.json",
}
# The GPU each target stands for (an A100, an H100 or H200, a B200): its compute capability,
# its streaming multiprocessors, and the shared memory one block may take (163 KB on Ampere,
# 227 KB on Hopper and Blackwell).
TARGETS = {
    "sm_80": (80, 108, 163 * 1024),
    "sm_90": (90, 132, 227 * 1024),
    "sm_100": (100, 148, 227 * 1024),
}
# The modules holding the triton forward's kernels.
KERNEL_MODULES = (
    "kernels.argmax.triton",
    "kernels.attention.triton",
    "kernels.causal_conv1d.triton",
    "kernels.fold.triton",
    "kernels.fp8.triton",
    "kernels.gated_delta_rule.chunk",
    "kernels.gated_delta_rule.recurrent",
    "kernels.matmul.triton",
    "kernels.moe.fp8",
    "kernels.moe.triton",
    "kernels.rmsnorm.triton",
)
BATCHES = (1, 8, 32)
# Tensor-parallel ranks and whether the experts are placed (`--tensor-parallel-size`,
# `--expert-parallel`): the report is rank 0's.
Ranks = tuple[int, bool]
PREFILL_ROWS = 64  # per sequence
VERIFY_ROWS = 4  # per sequence: three drafts and the last accepted token
CONTEXT = 32768  # keys before a verify or decode row
# -- the forward, on the meta device ---------------------------------------------------------


def drive(
    config: Path, batches: tuple[int, ...], catcher: Catcher, ranks: Ranks | None = None
) -> None:
    """Every call of the serving path at each batch, on `meta` with the triton ops (rank 0's of
    `ranks`, where given)."""
    from gpu_service.model.batch import Segment
    from gpu_service.model.config import ModelConfig, ServiceConfig
    from gpu_service.model.hybrid import PREFILL, VERIFY
    from gpu_service.model.state import DeviceState
    from gpu_service.model.triton_forward import TRITON
    from gpu_service.sizing.plan_meta import META, meta_model

    size, experts = (1, False) if ranks is None else ranks
    cfg = ModelConfig.from_dict(json.loads(config.read_text()))
    most = max(batches)
    context = -(-(CONTEXT + PREFILL_ROWS) // 64) * 64  # a multiple of the key block
    svc = ServiceConfig(
        verify_tiers=f"{most}:{VERIFY_ROWS - 1}",
        max_context=context,
        max_rows=most * VERIFY_ROWS,
        max_batch=most,
        max_prefill_tokens=most * PREFILL_ROWS,
        num_slots_override=most,
    )
    model = meta_model(cfg, torch.bfloat16, context, size, experts)
    model.ops = TRITON
    state = DeviceState(model.cfg, svc, torch.bfloat16, META)
    dflash = _meta_dflash(config.parent, model, state, context)

    def rows(n: int, start: int, count: int) -> tuple[torch.Tensor, list[Segment]]:
        segs = [Segment(i, start, count, i * count) for i in range(n)]
        return torch.zeros(n * count, dtype=torch.long, device=META), segs

    for n in batches:
        catcher.batch = n
        catcher.phase = "prefill"
        tokens, segs = rows(n, 0, PREFILL_ROWS)
        hidden = model.forward(tokens, segs, state, PREFILL)
        TRITON.argmax_logprob(model.logits(hidden[:n]))
        for phase, count in (("verify", VERIFY_ROWS), ("decode", 1)):
            catcher.phase = phase
            tokens, segs = rows(n, CONTEXT, count)
            hidden = model.forward(tokens, segs, state, VERIFY, write_live=False)
            TRITON.argmax_logprob(model.logits(hidden[: n * count]))
            if cfg.has_mtp:
                catcher.phase = f"drafter after {phase}"
                drafted = model.mtp_forward(tokens, hidden[: n * count], segs, state)
                assert drafted is not None
                TRITON.draft_argmax(model.logits(drafted[: n * count]))
        if dflash is not None:
            catcher.phase = "dflash block"
            _block(dflash, model, state, n)
        catcher.phase = "fold"
        picks = torch.zeros(n, dtype=torch.long, device=META)
        slots = torch.arange(n, device=META)
        TRITON.fold(state.gdn, state.verify_gdn, slots, picks)
        TRITON.fold(state.conv, state.verify_conv, slots, picks)


def _meta_dflash(directory: Path, model: Any, state: Any, context: int) -> Any:
    """The DFlash drafter whose config sits in `directory/dflash`, on `meta` with the triton
    ops, its taps attached to `model` and its pool in `state`; None where there is none."""
    from gpu_service.dflash.config import read_config
    from gpu_service.model.triton_forward import TRITON
    from gpu_service.sizing.plan_meta import meta_drafter
    from protos.defaults import DRAFTER_DIR

    if not (directory / DRAFTER_DIR / "config.json").is_file():
        return None
    dcfg = read_config(directory / DRAFTER_DIR, model.cfg)
    dflash = meta_drafter(dcfg, model, context)
    dflash.ops = TRITON
    state.add_dflash_pool(dcfg.num_hidden_layers, dcfg.num_key_value_heads, dcfg.head_dim)
    model.attach_taps(dcfg.target_layer_ids, dflash.write_context)
    return dflash


def _block(dflash: Any, model: Any, state: Any, n: int) -> None:
    """One block propose of `n` sequences after CONTEXT committed tokens."""
    from gpu_service.engine.block_drafter import BLOCK_TILE
    from gpu_service.model.batch import Layout, Segment, build
    from gpu_service.model.ops import ROW_TILE
    from gpu_service.model.triton_forward import TRITON
    from gpu_service.sizing.plan_meta import META
    from kernels.attention.format import KEY_BLOCK

    b = dflash.cfg.block_size
    segs = [Segment(i, CONTEXT, b, i * b) for i in range(n)]
    layout = Layout(BLOCK_TILE, KEY_BLOCK, model.cfg.linear_conv_kernel_dim, 0, causal=False)
    batch = build(segs, layout, ROW_TILE, META)
    hidden = dflash.block(torch.zeros(n, dtype=torch.long, device=META), batch, state)
    TRITON.draft_argmax(model.logits(hidden[: n * b]))


# -- the report ------------------------------------------------------------------------------


def shape_path(name: str) -> Path:
    path = SHAPE_SETS.get(name, Path(name))
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SystemExit(
            f"tools.kernel_report: --shapes {name!r} is neither a known set "
            f"({', '.join(SHAPE_SETS)}) nor a config.json or a directory holding one"
        )
    return path


def shape_key(name: str, ranks: Ranks | None) -> str:
    """A shape set's name in the report: with its ranks, where rank 0's shapes are reported."""
    if ranks is None:
        return name
    return f"{name}@tp{ranks[0]}" + ("-ep" if ranks[1] else "")


def build(
    targets: list[str],
    shapes: list[str],
    batches: tuple[int, ...],
    processes: int,
    kernels: list[str] | None = None,
    ranks: Ranks | None = None,
) -> dict[str, Any]:
    """The report as one JSON-able object: per shape set, each variant's figures per target
    and each launch's program count; with `kernels`, only those kernels' variants compile
    (every launch is still listed); with `ranks` (size, expert parallel), rank 0's shapes."""
    report: dict[str, Any] = {
        "triton": importlib.metadata.version("triton"),
        "targets": {
            t: {"arch": TARGETS[t][0], "sms": TARGETS[t][1], "max_shared_bytes": TARGETS[t][2]}
            for t in targets
        },
        "batches": list(batches),
        "shapes": {},
    }
    for name in shapes:
        path = shape_path(name)
        with catching() as catcher:
            drive(path, batches, catcher, ranks)
        variants = [v for v in catcher.variants.values() if not kernels or v.kernel in kernels]
        missing = sorted(set(kernels or ()) - {v.kernel for v in catcher.variants.values()})
        if missing:
            raise SystemExit(f"the forward at {name} launches no {', '.join(missing)}")
        jobs = [(v, TARGETS[t][0]) for v in variants for t in targets]
        figures = iter(compile_all(jobs, processes))
        report["shapes"][shape_key(name, ranks)] = {
            "config": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
            "variants": [
                {
                    "kernel": v.kernel,
                    "label": v.label,
                    "variant": v.key,
                    "targets": {t: next(figures) for t in targets},
                }
                for v in variants
            ],
            "launch_summary": launch_table(catcher.launches),
            "launches": distinct_launches(catcher.launches),
        }
    return report


def distinct_launches(launches: list[Launch]) -> list[dict[str, Any]]:
    """Each distinct launch once, with how many times the forward made it (a layer's
    launches repeat in every layer of its kind)."""
    out: dict[str, dict[str, Any]] = {}
    for launch in launches:
        row = asdict(launch)
        key = json.dumps(row, sort_keys=True)
        out.setdefault(key, {**row, "count": 0})["count"] += 1
    return list(out.values())


def launch_table(launches: list[Launch]) -> list[dict[str, Any]]:
    """Each (phase, batch, kernel)'s fewest and most programs over its launches."""
    table: dict[tuple[str, int, str], list[int]] = {}
    for launch in launches:
        table.setdefault((launch.phase, launch.batch, launch.kernel), []).append(launch.programs)
    return [
        {
            "phase": p,
            "batch": b,
            "kernel": k,
            "launches": len(v),
            "min_programs": min(v),
            "max_programs": max(v),
        }
        for (p, b, k), v in table.items()
    ]


def problems(report: dict[str, Any]) -> list[str]:
    """A sentence for each variant that spills or takes more shared memory than a block may."""
    out = []
    for name, shape in report["shapes"].items():
        for v in shape["variants"]:
            for target, f in v["targets"].items():
                if "error" in f:
                    out.append(f"{name} {target}: {v['variant']} does not compile: {f['error']}")
                    continue
                if f["spill_bytes"] or f["local_bytes"]:
                    out.append(
                        f"{name} {target}: {v['variant']} spills {f['spill_bytes']} bytes "
                        f"({f['local_bytes']} local)"
                    )
                limit = report["targets"][target]["max_shared_bytes"]
                if f["shared_bytes"] > limit:
                    out.append(
                        f"{name} {target}: {v['variant']} takes {f['shared_bytes']} bytes of "
                        f"shared memory, over a block's {limit}"
                    )
    return out


def tables(report: dict[str, Any]) -> str:
    lines = [f"Triton {report['triton']} kernels compiled on a CPU; spill = stack bytes a thread"]
    targets = list(report["targets"])
    for name, shape in report["shapes"].items():
        lines += ["", f"== {name} ({shape['config']})"]
        head = "  ".join(f"{t:>27}" for t in targets)
        lines.append(f"  {'variant':<60}  {head}")
        lines.append(
            f"  {'':<60}  " + "  ".join(f"{'regs spill  shared w/s':>27}" for _ in targets)
        )
        seen: dict[str, int] = {}
        for v in shape["variants"]:
            seen[v["label"]] = seen.get(v["label"], 0) + 1
            label = v["label"] + (f" #{seen[v['label']]}" if seen[v["label"]] > 1 else "")
            cells = [
                "compile failed"
                if "error" in f
                else f"{f['registers']:4d} {f['spill_bytes']:5d} {f['shared_bytes']:7d} "
                f"{f['warps']:3d}/{f['stages']}"
                for f in v["targets"].values()
            ]
            lines.append(f"  {label[:60]:<60}  " + "  ".join(f"{c:>27}" for c in cells))
        sms = ", ".join(f"{t} {report['targets'][t]['sms']}" for t in targets)
        lines += ["", f"  programs per launch (SMs: {sms})"]
        for row in shape["launch_summary"]:
            span = (
                str(row["min_programs"])
                if row["min_programs"] == row["max_programs"]
                else f"{row['min_programs']}..{row['max_programs']}"
            )
            lines.append(
                f"  {row['phase']:<22} batch {row['batch']:>3}  {row['kernel']:<22} "
                f"x{row['launches']:<4} {span:>12}"
            )
    found = problems(report)
    lines += ["", "no spills, shared memory within bounds" if not found else "PROBLEMS:", *found]
    return "\n".join(lines)


def _names(known: dict[str, Any] | None) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [n for n in names if known is not None and n not in known]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a comma-separated list of {', '.join(known or ['names'])}"
            )
        return names

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.kernel_report", description=__doc__)
    parser.add_argument("--target", type=_names(TARGETS), default=list(TARGETS))
    parser.add_argument(
        "--shapes",
        type=_names(None),
        default=list(SHAPE_SETS),
        help=f"shape sets ({', '.join(SHAPE_SETS)}) or paths of config.json files",
    )
    parser.add_argument(
        "--batches", type=lambda s: tuple(int(x) for x in s.split(",")), default=BATCHES
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument(
        "--kernels",
        type=lambda s: [k for k in s.split(",") if k],
        help="compile only these kernels' variants, by name (default: every kernel)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="report rank 0's shapes of N tensor-parallel ranks (default %(default)s)",
    )
    parser.add_argument(
        "--expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size, the routed experts placed on the ranks, whole",
    )
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when a kernel spills or overflows shared"
    )
    args = parser.parse_args(argv)
    compiler_mode()
    ranks = (args.tensor_parallel_size, args.expert_parallel)
    placed = ranks if ranks != (1, False) else None
    try:
        report = build(args.target, args.shapes, args.batches, args.jobs, args.kernels, placed)
    except ValueError as e:  # ranks that do not split (or place) a shape set's model
        raise SystemExit(f"tools.kernel_report: {e}") from None
    print(tables(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if args.check and problems(report) else 0


if __name__ == "__main__":
    sys.exit(main())
