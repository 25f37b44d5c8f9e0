"""What batch invariance by construction costs: `python -m tools.batch_invariance`.

Prints the tiled linear against a plain `F.linear` at the default model's widest projection,
one batched verify step of the default model at a few batch shapes, and a speculative step's
two calls by width and drafts. `--profile` prints torch.profiler's table of one sequence's
speculative steps instead."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from gpu_service.model.ops import linear, pad_rows
from protos.defaults import DEFAULT_MODEL_DIR


def _median_us(fn: Callable[[], object], repeats: int = 200) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _padded_linear(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    return linear(pad_rows(x), weight_t)


def bench_linear() -> None:
    weight = torch.randn(768, 256)
    weight_t = weight.t().contiguous()
    print("linear 256 -> 768     rows   F.linear us   tiled us")
    for rows in (1, 4, 16, 32, 64):
        x = torch.randn(rows, 256)
        plain = _median_us(partial(F.linear, x, weight))
        tiled = _median_us(partial(_padded_linear, x, weight_t))
        print(f"{'':22}{rows:4d}   {plain:11.1f}   {tiled:8.1f}")


def bench_verify() -> None:
    engine = Engine(DEFAULT_MODEL_DIR, ServiceConfig())
    print("default model verify step (prefix 128)   seqs x k   ms")
    for n, k in ((1, 1), (1, 4), (8, 4), (16, 2), (32, 1)):
        seqs = [engine.alloc_sequence() for _ in range(n)]
        engine.prefill(seqs, [[i % 256 for i in range(128)]] * n)

        def step(seqs: list = seqs, n: int = n, k: int = k) -> None:
            engine.decode_verify_batched([1] * (n * k), [k] * n, seqs)
            engine.gdn_fold_accepted(seqs, [1] * n)
            engine.commit_accepted_prefix(seqs, [1] * n, [k] * n)

        ms = _median_us(step, repeats=10) / 1e3
        print(f"{'':41}{n:4d} x {k}   {ms:6.1f}")
        for s in seqs:
            engine.free_sequence(s)


def bench_costs() -> None:
    """One speculative step split in its two calls, by sequences and drafts: what the
    scheduler's cost model reads, and where a step's time goes."""
    engine = Engine(DEFAULT_MODEL_DIR, ServiceConfig())
    entries, _ = engine.measure_costs([1, 4, 8], 3, repeats=20, refresh=True)
    print("step costs   seqs  drafts   verify ms   verdict+propose ms   total ms")
    for e in entries:
        print(
            f"{'':12}{e.width:5d}  {e.depth:6d}   {e.verify_ms:9.2f}   {e.propose_ms:18.2f}"
            f"   {e.verify_ms + e.propose_ms:8.2f}"
        )


def profile_step(drafts: int = 3, steps: int = 30) -> None:
    """torch.profiler over one sequence's speculative steps (verify drafts + 1 rows, then the
    verdict with the next drafts): the ops that take the time."""
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(DEFAULT_MODEL_DIR, ServiceConfig())
    seq = engine.alloc_sequence()
    engine.prefill([seq], [[(7 * i + 3) % 251 for i in range(64)]])
    k = drafts + 1

    def step() -> None:
        engine.decode_verify_batched([1] * k, [k], [seq])
        engine.settle_verdict([seq], [1], [k], [0], [1], drafts)

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    print(f"profile of {steps} steps, 1 sequence, {drafts} drafts")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    import argparse

    from gpu_service.engine.device import choose_device

    parser = argparse.ArgumentParser(prog="python -m tools.batch_invariance", description=__doc__)
    parser.add_argument(
        "--profile", action="store_true", help="torch.profiler's table of speculative steps"
    )
    args = parser.parse_args()
    choose_device()
    torch.manual_seed(0)
    if args.profile:
        profile_step()
    else:
        bench_linear()
        bench_verify()
        bench_costs()
