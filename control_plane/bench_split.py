"""What the process split costs: `python -m control_plane.bench_split`.

The same requests through the scheduler twice, in one run: driving the engine in process,
then driving a GPU service process over gRPC on loopback. Prints tokens per second and the
mean step time of each, and the split's overhead."""

from __future__ import annotations

import argparse
import threading
import time

import torch

from control_plane.bench import Workload
from control_plane.client import GrpcModel
from control_plane.env import Env
from control_plane.launch import start_gpu_service, stop
from control_plane.scheduler.loop import Scheduler
from control_plane.scheduler.seq import MTP, NONE, GenRequest
from control_plane.tokenizer import load_tokenizer
from gpu_service.config import ServiceConfig
from gpu_service.engine import Engine
from protos.defaults import DEFAULT_MODEL_DIR


def _run(connect, reqs: list[GenRequest]) -> tuple[float, int, int]:
    """Seconds, tokens and steps for all of `reqs`, submitted at once."""
    sched = Scheduler(connect, load_tokenizer(DEFAULT_MODEL_DIR), env=Env.read())
    sched.start()
    left, done, tokens = [len(reqs)], threading.Event(), [0]
    lock = threading.Lock()

    def sink(ev: object) -> None:
        with lock:
            tokens[0] += len(getattr(ev, "token_ids", []))
            if not hasattr(ev, "token_ids"):
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    t0 = time.perf_counter()
    for r in reqs:
        sched.submit(r, sink)
    done.wait()
    seconds = time.perf_counter() - t0
    steps = sched.snapshot()["counters"].steps
    sched.stop()
    return seconds, tokens[0], steps


def main() -> None:
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
                local = _run(lambda: engine, reqs)
                remote = _run(lambda: GrpcModel(target), reqs)
                rate = [t / s for s, t, _ in (local, remote)]
                step = [s / k * 1e3 for s, _, k in (local, remote)]
                print(
                    f"{method:6}  {n:4d}   {rate[0]:16.1f}  {step[0]:7.2f}   {rate[1]:10.1f}  "
                    f"{step[1]:7.2f}   {(step[1] / step[0] - 1) * 100:7.1f}%"
                )
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
