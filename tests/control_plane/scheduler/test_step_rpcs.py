"""The RPCs of the speculative step over a real socket, counted: the batching rule is a function
of the capabilities read once at connection, so no step asks `CanBatchVerify` or
`Capabilities`."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import grpc

from control_plane.replicas.client import GrpcModel
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from protos.params import MTP
from tests.collect import run_all
from tests.conftest import TINY_SERVICE
from tests.servers import model_server

STEPS = 100
ROUNDS = 8  # of 4 requests, 24 tokens each: more than STEPS steps on the tiny model


class Counting(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Counts the calls of a channel by RPC name (a stream counts once, with its messages)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def _count(self, details: Any) -> None:
        self.calls[details.method.rsplit("/", 1)[-1]] += 1

    def intercept_unary_unary(self, continuation, details, request):
        self._count(details)
        return continuation(details, request)

    def intercept_unary_stream(self, continuation, details, request):
        self._count(details)
        return continuation(details, request)

    def intercept_stream_stream(self, continuation, details, requests):
        self._count(details)
        return continuation(details, requests)


def _round(s: Scheduler, n: int) -> None:
    reqs = [
        GenRequest(f"r{n}-{i}", ((n * 4 + i) % 250 + 1, 7, 9), 24, method=MTP) for i in range(4)
    ]
    assert all(o.finish is not None for o in run_all(s, reqs))


def test_a_hundred_steps_ask_neither_capabilities_nor_the_batching_rule(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, TINY_SERVICE)
    counting = Counting()
    with model_server(engine) as target:
        s = Scheduler(
            lambda: GrpcModel(target, interceptors=[counting]),
            ByteTokenizer.default(),
            SchedulerOptions(),
            Env(),
        )
        s.start()
        try:
            _round(s, 0)  # the connection, its capabilities and cost table
            connected = Counter(counting.calls)
            before = s.snapshot()["counters"]
            base = Counter(counting.calls)  # what the snapshot asked is not the steps'
            for n in range(1, ROUNDS + 1):
                _round(s, n)
            during = counting.calls - base
            after = s.snapshot()["counters"]
        finally:
            s.stop()
    assert after.steps - before.steps >= STEPS
    assert connected["Capabilities"] == 1, connected
    assert during["Capabilities"] == 0 and during["CanBatchVerify"] == 0, during
    assert during["Prefill"] > 0, "the counter sees the session's calls"
