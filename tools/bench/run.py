"""`met bench`: what speculation buys, in one run so the machine's drift cancels out.

On one checkpoint (default: the bundled one), each figure a median over repeats:
- `none` vs `mtp` vs `prompt_lookup` (and `dflash`, with a drafter: `MODEL/dflash` or
  `--drafter`) under the default options, and `mtp_auto` (the `auto`
  cost model over the step-cost table the run measures first, as a service that has
  measured its costs runs it) at several concurrencies: output tokens per second, mean
  accepted length, acceptance per draft position; all must produce identical tokens (the run
  fails otherwise);
- batched vs serial verify (`METRALE_NO_MTP_BATCH_VERIFY`);
- in process vs over gRPC (a GPU service child process), greedy steps pipelined and not:
  the split's cost, and the service's idle time between pipelined steps;
- the verify buffers' bytes with the slot tiers vs every slot at full capacity;
- tracing off vs exporting to a local OTLP receiver (both processes);
- transformers' own `generate` on the same checkpoint, the outside baseline: one request,
  and a static batch of 16 against ours at 16 concurrent requests, in process and through
  the pair (a GPU service child over gRPC);
- drafting deeper: an engine with deeper verify slots, fixed depths and the measured cost
  model up to them (`tools.bench.depth`);
- at one request: a draft's measured cost against a plain decode step, and the mtp / none
  speedup the accepted length predicts from them against the measured one
  (`tools.bench.predict`);
- the prefix cache on and off: time to first token and hit rate over a shared system prompt
  and over multi-turn chats (`tools.bench.prefix`);
- with `--replicas N`: greedy `mtp` through one GPU service child under a plain scheduler,
  the same child through a router, and N children through a router: what routing costs,
  and the requests each replica took; all must produce identical tokens;
- with `--tensor-parallel N`: greedy `mtp` through one GPU service child at TP 1, at TP N
  summing in rank order (`--tp-reduce ordered`) and at TP N through the backend's all-reduce
  (`nccl`), one at a time: tokens per second, what the ordered reduction costs, one reduction
  timed alone; all must produce identical tokens.
Prompts are the checkpoint's held-out ones when it ships them. Prints a table, writes JSON
(`--out`) and a PNG chart (`--chart`). `--quick` is the CI-sized smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from control_plane.scheduler.widths import cost_widths
from protos.defaults import DEFAULT_MODEL_DIR, DRAFTER_DIR
from protos.hub import model_path
from tools.bench import llama_cpp
from tools.bench.baseline import (
    against_transformers,
    batch_against_transformers,
    grpc_against_transformers,
    transformers_baselines,
)
from tools.bench.breakdown import breakdown
from tools.bench.choice import choice, choice_failures
from tools.bench.depth import depth
from tools.bench.methods import batch_vs_serial, batched_over_serial, methods
from tools.bench.predict import configured_depth, draft_cost, prediction
from tools.bench.prefix import QUICK, Sizes, prefix
from tools.bench.replicas import replicas
from tools.bench.report import draw_chart, markdown, print_table
from tools.bench.split import REPEATS as SPLIT_REPEATS
from tools.bench.split import pair, speedups, split
from tools.bench.tensor_parallel import tensor_parallel
from tools.bench.tracing import tracing
from tools.bench.workload import Workload, scratch_env, served

# transformers' static batch, against ours at as many concurrent requests.
BATCH = 16


def memory(engine) -> dict:
    """The verify buffers' bytes with the engine's slot tiers and with every slot at full
    capacity: the recurrent state and conv window of each linear-attention layer per row."""
    cfg, svc = engine.cfg, engine.svc
    per_row = len(cfg.linear_layers) * (
        cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        + (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * engine.model.dtype.itemsize
    )
    caps = svc.slot_verify_drafts
    return {
        "tiers": svc.verify_tiers,
        "tiered_bytes": per_row * sum(c + 1 for c in caps),
        "full_capacity_bytes": per_row * len(caps) * (max(caps) + 1),
    }


def measure(args: argparse.Namespace) -> dict:
    """Every section: the report dict. It runs in a cache directory of its own (the GPU
    service children inherit it), so no cost table of the user's is read or changed; compiled
    steps come from and go to the user's compile cache (`scratch_env`)."""
    with (
        tempfile.TemporaryDirectory() as cache,
        mock.patch.dict(os.environ, scratch_env(cache)),
    ):
        return _measure(args)


def _measure(args: argparse.Namespace) -> dict:
    """Every section on one engine in this process, after the step-cost table that the
    `auto` cost model reads: as a service that has measured its costs runs."""
    import torch

    from gpu_service.engine.facade import Engine
    from gpu_service.model.config import DFLASH_VERIFY_TIERS, ServiceConfig

    torch.set_num_threads(1)  # as the GPU service runs its engine
    drafter = args.drafter or (args.model / DRAFTER_DIR)
    dflash = (drafter / "config.json").is_file()
    svc = served(ServiceConfig(verify_tiers=DFLASH_VERIFY_TIERS) if dflash else ServiceConfig())
    engine = Engine(args.model, svc, drafter=drafter if dflash else None)
    work = Workload(args.model)
    quick = args.quick
    widths = cost_widths(engine.svc.num_slots)
    engine.measure_costs(widths, configured_depth(engine), repeats=2 if quick else 10)
    conc, tokens, repeats = ([1, 4], 12, 1) if quick else ([1, 4, 16], 64, 5)
    report: dict = {"model": engine.name, "quick": quick, "machine": machine()}
    local = lambda: engine  # noqa: E731
    hf = {} if quick else transformers_baselines(args.model, work, tokens, [1, BATCH])
    report["methods"], failures, outside = methods(local, work, conc, tokens, repeats, hf, dflash)
    if 1 in outside:
        report["transformers_generate"] = against_transformers(report["methods"], outside[1])
    report["draft_cost"] = draft_cost(engine, configured_depth(engine), 10 if quick else 40)
    report["batch_vs_serial"] = batch_vs_serial(
        local, work, [4] if quick else [8, 16], tokens, repeats
    )
    report["batched_over_serial"] = batched_over_serial(report["batch_vs_serial"])
    split_at, split_repeats = ([1], repeats) if quick else ([1, 4], SPLIT_REPEATS)
    report["split"] = split(args.model, local, work, split_at, tokens, split_repeats, hf)
    report["speedup"] = speedups(report["split"])
    report["prediction"] = prediction(report["methods"], report["draft_cost"], report["speedup"])
    if "transformers_generate" in report:
        one = report["transformers_generate"]
        report["transformers_generate"] = grpc_against_transformers(one, report["split"])
    if BATCH in outside:
        report["pair"] = pair(args.model, work, BATCH, tokens, repeats, hf[BATCH])
        failures += [
            f"{r['method']} at {BATCH} over gRPC differs from none"
            for r in report["pair"]
            if not r["identical"]
        ]
        report["transformers_generate_batch"] = batch_against_transformers(
            report["methods"], report["split"] + report["pair"], outside[BATCH], BATCH
        )
    choice_at, choice_repeats = ([1], 1) if quick else ([1, 4, 16], repeats)
    report["choice"] = choice(args.model, work, choice_at, tokens, choice_repeats)
    failures += choice_failures(report["choice"], speed=not quick)
    report["memory"] = memory(engine)
    report["depth"] = depth(args.model, work, [1] if quick else [1, 4], tokens, repeats, quick)
    failures += report["depth"]["failures"]
    report["prefix_cache"] = prefix(args.model, work, QUICK if quick else Sizes())
    failures += report["prefix_cache"]["failures"]
    if not quick:
        report.update(traced(tokens))
    failures += _many_services(args, work, tokens, repeats, report)
    report["failures"] = failures
    return report


def traced(tokens: int) -> dict:
    """The sections read from both processes' spans: what tracing costs, and where a step's
    time goes."""
    return {"tracing": tracing(4, tokens), "breakdown": breakdown([1, 16], tokens, 3)}


def _many_services(
    args: argparse.Namespace, work: Workload, tokens: int, repeats: int, report: dict
) -> list[str]:
    """The sections over several servers (`--replicas`, `--tensor-parallel`, llama.cpp's
    with `--gguf`), into `report`. -> their failures"""
    quick, failures = args.quick, []
    if args.replicas:
        rows = replicas(
            args.model, work, [4] if quick else [16, 32], tokens, repeats, args.replicas
        )
        report["replicas"] = rows
        failures += [
            f"replicas at {r['concurrency']}: the arms' tokens differ"
            for r in rows
            if not r["identical"]
        ]
    if args.tensor_parallel:
        rows = tensor_parallel(
            args.model, work, [1] if quick else [1, 16], tokens, repeats, args.tensor_parallel
        )
        report["tensor_parallel"] = rows
        failures += [
            f"tensor parallel at {r['concurrency']}: {', '.join(r['differs'])} differ from TP 1"
            for r in rows
            if not r["identical"]
        ]
    if args.gguf is not None:
        if shutil.which(llama_cpp.BINARY) is None:
            failures.append(f"--gguf: no {llama_cpp.BINARY} on the PATH to serve it")
        else:
            at = [1] if quick else [1, 16]
            report["llama_cpp"] = llama_cpp.compare(args.gguf, at, tokens, 1 if quick else 6)
    return failures


def run(args: argparse.Namespace) -> int:
    """`met bench`: measure, print, write what was asked for; 1 when a method's tokens
    differ from plain decoding's."""
    chart = args.chart or (args.out.with_suffix(".png") if args.out else None)
    for path in (args.out, args.markdown, chart):
        if path:  # before the minutes of measuring, so that none of them is lost to a path
            path.parent.mkdir(parents=True, exist_ok=True)
    report = measure(args)
    print_table(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(report))
    if chart:
        draw_chart(report, chart)
        print(f"chart: {chart}")
    return 1 if report["failures"] else 0


def machine() -> dict:
    """The CPU, core count and versions the figures were measured on."""
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "engine_threads": torch.get_num_threads(),
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=model_path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--quick", action="store_true", help="the CI-sized smoke run")
    parser.add_argument(
        "--drafter",
        type=Path,
        default=None,
        metavar="PATH",
        help="a DFlash drafter for the dflash method (default: MODEL/dflash when it exists)",
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        metavar="PATH",
        help="also measure llama.cpp's llama-server (on the PATH) on this GGUF of the model "
        "(README, 'Against llama.cpp'; default: not measured)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument(
        "--chart", type=Path, default=None, help="the PNG chart (default: --out with .png)"
    )
    parser.add_argument("--markdown", type=Path, default=None, help="the report's tables")
    parser.add_argument(
        "--replicas",
        type=_at_least_2("the GPU services to route among"),
        default=None,
        metavar="N",
        help="also measure routing: one GPU service with and without a router, and N services "
        "under one (default: not measured)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=_at_least_2("the ranks of the tensor-parallel arms"),
        default=None,
        metavar="N",
        help="also measure tensor parallelism: one GPU service at TP 1, and at TP N with each "
        "--tp-reduce, one at a time (default: not measured)",
    )


def _at_least_2(what: str) -> Callable[[str], int]:
    """An argparse type: a whole number of `what` of at least 2."""

    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < 2:
            raise argparse.ArgumentTypeError(f"{what} must number at least 2, not {text!r}")
        return int(text)

    return parse
