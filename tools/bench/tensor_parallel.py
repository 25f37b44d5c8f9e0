"""What tensor parallelism and its ordered reduction cost: `met bench --tensor-parallel N`'s
section, and alone as `python -m tools.bench.tensor_parallel`.

The same greedy `mtp` requests (the default method) through one GPU service child at a time:
- `tp_1`: one rank, the single-device service;
- `ordered`: N ranks, row-parallel outputs gathered and summed in rank order (the default);
- `nccl`: N ranks, summed by the backend's all-reduce (gloo's on the CPU).
Each arm's service is started, warmed, run `repeats` times and stopped before the next is
driven, so that no two compete for the machine's cores. Prints tokens per second of each, TP N over
TP 1, what `ordered` costs against `nccl`, one reduction of a step's hidden rows timed alone
(both ways, ranks as threads of this process), and whether every arm produced TP 1's tokens.
On a CPU the N ranks share the machine's cores, so TP N over TP 1 measures the split's
overhead against the cores it adds, not a device's worth of scaling."""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from control_plane.cli.launch import start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from control_plane.scheduler.env import Env
from control_plane.scheduler.scheduler import Scheduler
from gpu_service.model.config import ModelConfig
from gpu_service.tp import REDUCES
from protos.defaults import DEFAULT_MODEL_DIR
from protos.params import MTP
from tools.bench.workload import Workload, drive, median, options_for

if TYPE_CHECKING:  # torch, which this module's callers need not import to parse flags
    import torch.distributed as dist

    from gpu_service.tp.group import Rendezvous

ARMS = ("tp_1", *REDUCES)
# Timed reductions per mode in the micro figure, after as many untimed.
REDUCE_CALLS = 100


def tensor_parallel(
    model_dir: Path,
    work: Workload,
    concurrency: list[int],
    tokens: int,
    repeats: int,
    size: int = 2,
) -> list[dict]:
    """A row per concurrency: each arm's median tokens per second, the ratios, the reduction
    timed alone, and which arms' tokens differ from TP 1's."""
    hidden = ModelConfig.load(model_dir).hidden_size
    reduce = {n: reduce_us(size, n, hidden) for n in concurrency}
    runs: dict[str, dict[int, list[dict]]] = {}
    stops: list[threading.Thread] = []
    try:
        for arm in ARMS:
            tp = ("--tp", "1") if arm == "tp_1" else ("--tp", str(size), "--tp-reduce", arm)
            proc, target = start_gpu_service(model_dir, *tp, "--threads", "1")
            # The last arm's service stopped while this one started, and gone before it is
            # driven: one service serving at a time.
            for t in stops:
                t.join()
            try:
                runs[arm] = _arm(target, work, concurrency, tokens, repeats)
            finally:
                stops.append(threading.Thread(target=stop, args=(proc,)))
                stops[-1].start()
    finally:
        for t in stops:
            t.join()
    return [_row({a: runs[a][n] for a in ARMS}, n, size, reduce[n]) for n in concurrency]


def _arm(
    target: str, work: Workload, concurrency: list[int], tokens: int, repeats: int
) -> dict[int, list[dict]]:
    """One arm's service warmed, then every concurrency `repeats` times through it."""
    # Untimed: the first batch pays for warming the allocator and caches.
    warm = work.requests(MTP, max(concurrency), tokens)
    drive(_scheduler(target, work, warm), warm)
    out: dict[int, list[dict]] = {}
    for n in concurrency:
        out[n] = []
        for _ in range(repeats):
            reqs = work.requests(MTP, n, tokens)
            got = drive(_scheduler(target, work, reqs), reqs)
            got["outputs"] = [got["tokens"][r.request_id] for r in reqs]
            out[n].append(got)
    return out


def _scheduler(target: str, work: Workload, reqs: list) -> Scheduler:
    return Scheduler(lambda: GrpcModel(target), work.tokenizer, options_for(reqs), Env())


def _row(runs: dict[str, list[dict]], n: int, size: int, reduce: dict) -> dict:
    arm = {name: median(runs[name]) for name in ARMS}
    first = runs["tp_1"][0]["outputs"]
    row: dict = {"method": MTP, "concurrency": n, "size": size, "cores": os.cpu_count()}
    for name in ARMS:
        row[f"{name}_tok_s"] = arm[name]["tok_s"]
    row["ordered_over_tp_1"] = row["ordered_tok_s"] / row["tp_1_tok_s"]
    row["nccl_over_tp_1"] = row["nccl_tok_s"] / row["tp_1_tok_s"]
    # What the ordered reduction costs: the throughput it gives up against the backend's.
    row["ordered_cost"] = 1 - row["ordered_tok_s"] / row["nccl_tok_s"]
    row.update(reduce)
    row["accepted_length"] = arm["tp_1"]["accepted_length"]
    row["differs"] = [a for a in ARMS if any(r["outputs"] != first for r in runs[a])]
    row["identical"] = not row["differs"]
    return row


def reduce_us(size: int, rows: int, hidden: int, calls: int = REDUCE_CALLS) -> dict:
    """Microseconds of one row-parallel reduction of an fp32 [rows, hidden] tensor per mode
    (`reduce_us`, with the shape): `size` ranks as threads of this process over gloo, the
    median over ranks of each's mean."""
    from gpu_service.tp.group import Rendezvous, TpGroup

    out: dict[str, float] = {}
    for mode in REDUCES:
        store = TpGroup.host_store(size)
        meet = Rendezvous("127.0.0.1", store.port, size)
        times = [0.0] * size
        threads = [
            threading.Thread(
                target=_time_rank,
                args=(r, meet, mode, store if r == 0 else None, (rows, hidden), calls, times),
            )
            for r in range(size)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out[mode] = statistics.median(times)
    return {"reduce_us": out, "reduce_rows": rows, "hidden": hidden}


def _time_rank(
    r: int,
    meet: Rendezvous,
    mode: str,
    store: dist.Store | None,
    shape: tuple[int, int],
    calls: int,
    times: list[float],
) -> None:
    """Rank `r`'s mean microseconds per reduction into `times[r]`, after `calls` untimed."""
    import torch

    from gpu_service.tp.group import TpGroup

    group = TpGroup(r, meet, torch.device("cpu"), mode, store)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(r))
    for _ in range(calls):
        group.reduce(x)
    t0 = time.perf_counter()
    for _ in range(calls):
        group.reduce(x)
    times[r] = (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    from tools.bench.report import tensor_parallel_lines

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tensor-parallel", type=int, default=2, help="ranks of the TP arms")
    args = parser.parse_args()
    work = Workload(args.model)
    rows = tensor_parallel(
        args.model, work, args.concurrency, args.tokens, args.repeats, args.tensor_parallel
    )
    print("\n".join(tensor_parallel_lines(rows)))


if __name__ == "__main__":
    main()
