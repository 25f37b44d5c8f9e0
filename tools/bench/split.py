"""What the process split costs: `met bench`'s split section, and alone as
`python -m tools.bench.split`.

The same requests through the scheduler, in one run: driving the engine in process, then
driving a GPU service process over gRPC on loopback, each with greedy steps pipelined (the
default) and not. Prints tokens per second of each, gRPC over in process, and how much of
the run the service spent idle between pipelined steps; `--load N` runs it again beside N busy
processes, for what the two processes lose on a busy machine against the engine alone."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from pathlib import Path

from control_plane.cli.launch import start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from protos.defaults import DEFAULT_MODEL_DIR
from protos.params import MTP, NONE
from tools.bench.baseline import same_rounds
from tools.bench.workload import Workload, busy, median, serve, served, settled

# The section's repeats in a full run: its ratios compare arms within a few percent, on a
# shared machine whose speed moves more than that between runs a second apart, so it takes
# more of them than the other sections. (Its requests are the others' length, so its gRPC
# figures compare with transformers' `generate` on the same work.)
REPEATS = 9

# name, over gRPC, scheduler options
ARMS: tuple[tuple[str, bool, dict], ...] = (
    ("in_process", False, {}),
    ("in_process_unpipelined", False, {"pipeline": False}),
    ("grpc", True, {}),
    ("grpc_unpipelined", True, {"pipeline": False}),
)


def split(
    model_dir: Path,
    local_connect,
    work: Workload,
    concurrency: list[int],
    tokens: int,
    repeats: int,
    outside: dict[int, Callable[[], float]] | None = None,
) -> list[dict]:
    """Each method in process and through a GPU service child process over gRPC, with the
    pipelined step stream and without it (`--no-pipeline`); `outside` (by concurrency: one
    run of transformers' generate, its tok/s) runs in the same rounds. A first round at each
    concurrency is not counted: a compiled step compiles the keys the work reaches there, and
    the counted ones wait until it has (`settled`)."""
    proc, target = start_gpu_service(model_dir)
    rows = []
    outside = outside or {}
    try:
        remote = lambda: GrpcModel(target)  # noqa: E731
        for n in concurrency:
            runs: dict[tuple[str, str], list[dict]] = {}
            hf: list[float] = []
            for counted in [False] + [True] * repeats:  # methods and arms interleaved: drift
                for m in (NONE, MTP):  # falls on all alike
                    for arm, over_grpc, options in ARMS:
                        reqs = work.requests(m, n, tokens)
                        connect = remote if over_grpc else local_connect
                        got = serve(connect, reqs, work.tokenizer, options)
                        got["idle"] = got["engine_waited_s"] / got["seconds"]
                        if counted:
                            runs.setdefault((m, arm), []).append(got)
                if not counted:
                    settled(remote)
                    settled(local_connect)
                elif n in outside:
                    hf.append(outside[n]())
            rows += [_split_row(runs, m, n, hf) for m in (NONE, MTP)]
    finally:
        stop(proc)
    return rows


def pair(
    model_dir: Path,
    work: Workload,
    n: int,
    tokens: int,
    repeats: int,
    outside: Callable[[], float] | None = None,
    service: tuple[str, ...] = (),
) -> list[dict]:
    """`none` and `mtp` at `n` concurrent requests through a GPU service child over gRPC,
    pipelined (the default): the pair as a user runs it, for the static-batch comparison, with
    `outside` (one run of transformers' generate over a batch of `n`) in the same rounds. One
    row per method, with whether its tokens equal `none`'s in every repeat. `service`: the
    child's further flags (`--compile`). A first round, not counted, warms the service (a
    compiled one compiles the keys the work reaches, waited for: `settled`)."""
    proc, target = start_gpu_service(model_dir, *service)
    runs: dict[str, list[dict]] = {NONE: [], MTP: []}
    hf: list[float] = []
    try:
        for m in runs:
            serve(lambda: GrpcModel(target), work.requests(m, n, tokens), work.tokenizer)
        settled(lambda: GrpcModel(target))
        for _ in range(repeats):
            for m in runs:
                reqs = work.requests(m, n, tokens)
                runs[m].append(serve(lambda: GrpcModel(target), reqs, work.tokenizer))
            if outside is not None:
                hf.append(outside())
    finally:
        stop(proc)
    tokens_of = lambda r, m: [r["tokens"][f"{m}-{i}"] for i in range(n)]  # noqa: E731
    base = tokens_of(runs[NONE][0], NONE)
    return [
        {
            "method": m,
            "concurrency": n,
            "grpc_tok_s": median(r)["tok_s"],
            "accepted_length": median(r)["accepted_length"],
            "identical": all(tokens_of(x, m) == base for x in r),
            **(same_rounds([x["tok_s"] for x in r], hf) if hf else {}),
        }
        for m, r in runs.items()
    ]


def _split_row(
    runs: dict[tuple[str, str], list[dict]], method: str, n: int, hf: list[float]
) -> dict:
    """One method at one concurrency: each arm's medians, gRPC over in process with the
    pipeline and without it, the service's idle fraction between pipelined steps, and the
    pipelined gRPC arm against transformers' generate in the same rounds (`hf`, when run)."""
    arm = {name: median(runs[(method, name)]) for name, _, _ in ARMS}
    row: dict = {"method": method, "concurrency": n}
    for name in arm:
        row[f"{name}_tok_s"] = arm[name]["tok_s"]
        row[f"{name}_step_ms"] = arm[name]["step_ms"]
        row[f"{name}_plans"] = min(r["plans"] for r in runs[(method, name)])
        row[f"{name}_accepted_length"] = arm[name]["accepted_length"]
    for name in ("in_process", "grpc"):  # engine_waited_s over the run's wall time
        row[f"{name}_idle"] = statistics.median(r["idle"] for r in runs[(method, name)])
    # The median of each repeat's ratio: the arms of one repeat ran seconds apart, so the
    # machine's drift cancels in each ratio, where it would not between two medians.
    ratio = lambda a, b: statistics.median(  # noqa: E731
        x["tok_s"] / y["tok_s"] for x, y in zip(runs[(method, a)], runs[(method, b)], strict=True)
    )
    row["grpc_over_in_process"] = ratio("grpc", "in_process")
    row["grpc_over_in_process_unpipelined"] = ratio("grpc_unpipelined", "in_process_unpipelined")
    row["accepted_length"] = arm["grpc"]["accepted_length"]
    if hf:
        row.update(same_rounds([r["tok_s"] for r in runs[(method, "grpc")]], hf))
    return row


def speedups(split_rows: list[dict]) -> list[dict]:
    """mtp over none at each concurrency, in process and over gRPC."""
    by = {(r["method"], r["concurrency"]): r for r in split_rows}
    return [
        {
            "concurrency": n,
            "in_process": by[(MTP, n)]["in_process_tok_s"] / by[(NONE, n)]["in_process_tok_s"],
            "grpc": by[(MTP, n)]["grpc_tok_s"] / by[(NONE, n)]["grpc_tok_s"],
        }
        for (m, n) in by
        if m == MTP and (NONE, n) in by
    ]


def main() -> None:
    import torch

    from gpu_service.engine.facade import Engine
    from gpu_service.model.config import ServiceConfig
    from tools.bench.report import split_lines

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument(
        "--pair",
        action="store_true",
        help="only the served pair against transformers' generate (one request, and a static "
        "batch at each other concurrency), as a user runs the service",
    )
    parser.add_argument(
        "--load",
        type=int,
        nargs="+",
        default=[0],
        metavar="N",
        help="the split again beside N busy processes (one spinning core each) per value: "
        "what the two processes lose against the engine alone on a busy machine",
    )
    parser.add_argument(
        "--service",
        default="",
        help="the GPU service child's further flags, given as --service=FLAGS (default: none)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the GPU service runs its engine (see gpu_service/rpc/server.py)
    if args.pair:
        _pair_main(args)
        return
    if min(args.load) < 0:
        parser.error("--load takes counts of 0 or more")
    engine = Engine(DEFAULT_MODEL_DIR, served(ServiceConfig()))
    work = Workload(DEFAULT_MODEL_DIR)
    for n in args.load:
        with busy(n):
            load = os.getloadavg()[0]
            rows = split(
                DEFAULT_MODEL_DIR, lambda: engine, work, args.concurrency, args.tokens, args.repeats
            )
            print(f"beside {n} busy processes (load {load:.2f} to {os.getloadavg()[0]:.2f}):")
        print("\n".join(split_lines(rows)))


def _pair_main(args: argparse.Namespace) -> None:
    """The pair against transformers, one thread each, interleaved; the machine's load beside."""
    import json

    from tools.bench.baseline import transformers_baselines

    work = Workload(DEFAULT_MODEL_DIR)
    hf = transformers_baselines(DEFAULT_MODEL_DIR, work, args.tokens, args.concurrency)
    for n in args.concurrency:
        load = os.getloadavg()[0]
        rows = pair(
            DEFAULT_MODEL_DIR,
            work,
            n,
            args.tokens,
            args.repeats,
            hf.get(n),
            tuple(args.service.split()),
        )
        for r in rows:
            print(
                json.dumps(
                    {**r, "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}
                )
            )


if __name__ == "__main__":
    main()
