"""What the process split costs: `met bench`'s split section, and alone as
`python -m control_plane.benchmarks.split`.

The same requests through the scheduler, in one run: driving the engine in process, then
driving a GPU service process over gRPC on loopback. Prints tokens per second and the mean
step time of each, and the split's overhead."""

from __future__ import annotations

import argparse
from pathlib import Path

from control_plane.benchmarks.workload import Workload, median, serve
from control_plane.client import GrpcModel
from control_plane.env import Env
from control_plane.launch import start_gpu_service, stop
from control_plane.scheduler.seq import MTP, NONE
from protos.defaults import DEFAULT_MODEL_DIR


def split(
    model_dir: Path,
    local_connect,
    work: Workload,
    concurrency: list[int],
    tokens: int,
    repeats: int,
) -> list[dict]:
    """Each method in process and through a GPU service child process over gRPC, greedy steps
    as one `DecodeStep` round trip and as two calls (`--no-fused-step`)."""
    proc, target = start_gpu_service(model_dir)
    rows = []
    try:
        fused: dict = {}
        two_calls = {"fused_step": False}
        remote = lambda: GrpcModel(target)  # noqa: E731
        arms = (
            ("local", local_connect, fused),
            ("grpc", remote, fused),
            ("grpc_two_calls", remote, two_calls),
        )
        for n in concurrency:
            runs: dict[tuple[str, str], list[dict]] = {}
            for _ in range(repeats):  # methods and arms interleaved: drift falls on all alike
                for m in (NONE, MTP):
                    for where, connect, options in arms:
                        reqs = work.requests(m, n, tokens)
                        got = serve(connect, reqs, work.tokenizer, options)
                        runs.setdefault((m, where), []).append(got)
            rows += [_split_row(runs, m, n) for m in (NONE, MTP)]
    finally:
        stop(proc)
    return rows


def _split_row(runs: dict[tuple[str, str], list[dict]], method: str, n: int) -> dict:
    """One method at one concurrency: its medians in process and over gRPC, and their ratio."""
    local, grpc_, two = (
        median(runs[(method, where)]) for where in ("local", "grpc", "grpc_two_calls")
    )
    return {
        "method": method,
        "concurrency": n,
        "in_process_tok_s": local["tok_s"],
        "grpc_tok_s": grpc_["tok_s"],
        "grpc_two_calls_tok_s": two["tok_s"],
        "in_process_step_ms": local["step_ms"],
        "grpc_step_ms": grpc_["step_ms"],
        "grpc_two_calls_step_ms": two["step_ms"],
        "overhead": grpc_["step_ms"] / local["step_ms"] - 1,
        "overhead_two_calls": two["step_ms"] / local["step_ms"] - 1,
        "accepted_length": grpc_["accepted_length"],
    }


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

    from gpu_service.config import ServiceConfig
    from gpu_service.engine import Engine

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the GPU service runs its engine (see gpu_service/server.py)
    engine = Engine(DEFAULT_MODEL_DIR, ServiceConfig())
    work = Workload(DEFAULT_MODEL_DIR)
    proc, target = start_gpu_service(DEFAULT_MODEL_DIR)
    try:
        print("method  seqs   in-process tok/s  step ms   gRPC tok/s  step ms   overhead")
        for method in (NONE, MTP):
            for n in args.concurrency:
                reqs = work.requests(method, n, args.tokens)
                local = serve(lambda: engine, reqs, work.tokenizer, env=Env.read())
                remote = serve(lambda: GrpcModel(target), reqs, work.tokenizer, env=Env.read())
                print(
                    f"{method:6}  {n:4d}   {local['tok_s']:16.1f}  {local['step_ms']:7.2f}   "
                    f"{remote['tok_s']:10.1f}  {remote['step_ms']:7.2f}   "
                    f"{(remote['step_ms'] / local['step_ms'] - 1) * 100:7.1f}%"
                )
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
