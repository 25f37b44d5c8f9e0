"""A bad request ends alone: while four greedy Generate streams run on real processes, bad
calls reach the GPU service and the control plane (undecodable bodies, out-of-range cost
measurements, another session's sequence ids and admin calls without the key). Each bad call
gets its status, and the healthy streams finish token-identical to a quiet run with every slot
free afterwards."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import grpc
import pytest

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from protos.met.v1 import generate_pb2, generate_pb2_grpc, model_pb2
from protos.met.v1 import model_pb2_grpc as model_grpc
from protos.model import ADMIN_KEY_ENV, ADMIN_KEY_METADATA, SESSION_METADATA
from tests.conftest import SERVE_ARGS
from tests.gpu_service.test_costs import OUT_OF_RANGE
from tests.protos.test_bodies import GARBAGE

# Slow: starts both processes beside live streams.
pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47], [200] * 13, list(range(60, 78))]
MAX_NEW = 24
TIMEOUT_S = 30.0
SERVICES = [
    model_pb2.DESCRIPTOR.services_by_name["ModelService"],
    generate_pb2.DESCRIPTOR.services_by_name["GenerationService"],
]
# On the wire repeats 0 is unset (the service's default), so that case is a valid request.
WIRE_OUT_OF_RANGE = {k: v for k, v in OUT_OF_RANGE.items() if k != "repeats-zero"}
OK, INVALID, NOT_FOUND, DENIED = (
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
)
# One bad call: what it is, and how it goes out (its status comes back).
BadCall = tuple[str, Callable[[], grpc.StatusCode]]


@dataclass
class Pair:
    gpu: Popen
    gpu_target: str
    control: Popen
    control_target: str


@pytest.fixture(scope="module")
def pair(tiny_dir: Path) -> Iterator[Pair]:
    """Processes of this module's own: bad calls never reach the session's shared services."""
    gpu, gpu_target = start_gpu_service(tiny_dir, *SERVE_ARGS, "--max-prefill-tokens", "512")
    control, control_target = start_control_plane(gpu_target, "--tokenizer", str(tiny_dir))
    try:
        yield Pair(gpu, gpu_target, control, control_target)
    finally:
        assert stop(control) == 0
        assert stop(gpu) == 0


@pytest.fixture(scope="module")
def quiet(pair: Pair) -> list[list[int]]:
    """The four streams' tokens with nothing else sent."""
    streams = Streams(pair.control_target)
    streams.join()
    return streams.tokens()


@pytest.fixture
def other(pair: Pair) -> Iterator[GrpcModel]:
    """A second session on the GPU service, beside the control plane's."""
    model = GrpcModel(pair.gpu_target)
    yield model
    model.close()


class Streams:
    """Four greedy Generate streams, each read on a thread of its own."""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        stub = generate_pb2_grpc.GenerationServiceStub(self._channel)
        self.replies: list[list[generate_pb2.GenerateResponse]] = [[] for _ in PROMPTS]
        self.started = [threading.Event() for _ in PROMPTS]
        self.errors: list[grpc.RpcError] = []
        self._threads = [
            threading.Thread(target=self._read, args=(stub, i), daemon=True)
            for i in range(len(PROMPTS))
        ]
        for t in self._threads:
            t.start()

    def _read(self, stub: generate_pb2_grpc.GenerationServiceStub, i: int) -> None:
        request = generate_pb2.GenerateRequest(
            prompt_token_ids=PROMPTS[i], max_new_tokens=MAX_NEW, ignore_eos=True
        )
        try:
            for reply in stub.Generate(request, timeout=TIMEOUT_S):
                self.replies[i].append(reply)
                self.started[i].set()
        except grpc.RpcError as e:
            self.errors.append(e)
        finally:
            self.started[i].set()

    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def join(self) -> None:
        for t in self._threads:
            t.join(TIMEOUT_S + 5)
        self._channel.close()
        assert not self.running(), "a stream did not end"

    def tokens(self) -> list[list[int]]:
        assert not self.errors, [(e.code(), e.details()) for e in self.errors]
        for replies in self.replies:
            assert replies and replies[-1].finish_reason == "length", replies[-1:]
        return [[t for r in replies for t in r.token_ids] for replies in self.replies]


def beside_streams(pair: Pair, quiet: list[list[int]], calls: list[BadCall]) -> dict[str, set]:
    """Sends `calls` in rounds while the streams run (one round at least, begun once every
    stream has its first reply); returns the statuses each call got."""
    streams = Streams(pair.control_target)
    for started in streams.started:
        assert started.wait(TIMEOUT_S)
    statuses: dict[str, set] = {name: set() for name, _ in calls}
    rounds_beside = 0
    while True:
        rounds_beside += streams.running()
        for name, call in calls:
            statuses[name].add(call())
        if not streams.running():
            break
    streams.join()
    assert rounds_beside >= 1, "the streams ended before any bad call went out"
    assert streams.tokens() == quiet
    assert_all_free(pair.gpu_target)
    return statuses


def assert_all_free(target: str) -> None:
    """The control plane frees a finished stream's sequence within a moment."""
    model = GrpcModel(target)
    try:
        deadline = time.monotonic() + 5.0
        while (caps := model.capabilities()).free_slots != caps.num_slots:
            assert time.monotonic() < deadline, f"{caps.free_slots} of {caps.num_slots} free"
            time.sleep(0.02)  # polling the control plane's cleanup
    finally:
        model.close()


def code_of(send: Callable[[], object]) -> grpc.StatusCode:
    try:
        send()
    except grpc.RpcError as e:
        return e.code()
    return OK


def raw(channel: grpc.Channel, service, method) -> Callable[[], grpc.StatusCode]:
    """`GARBAGE` as `method`'s request, bytes as they are (no serializers)."""
    path = f"/{service.full_name}/{method.name}"
    if method.server_streaming:
        stream = channel.unary_stream(path)
        return lambda: code_of(lambda: list(stream(GARBAGE, timeout=5.0)))
    unary = channel.unary_unary(path)
    return lambda: code_of(lambda: unary(GARBAGE, timeout=5.0))


def test_garbage_bodies_beside_healthy_streams(pair: Pair, quiet: list[list[int]]) -> None:
    targets = {"ModelService": pair.gpu_target, "GenerationService": pair.control_target}
    channels = {name: grpc.insecure_channel(t) for name, t in targets.items()}
    try:
        calls: list[BadCall] = [
            (m.full_name, raw(channels[s.name], s, m)) for s in SERVICES for m in s.methods
        ]
        statuses = beside_streams(pair, quiet, calls)
    finally:
        for channel in channels.values():
            channel.close()
    assert statuses == {name: {INVALID} for name, _ in calls}


def test_out_of_range_costs_beside_healthy_streams(
    pair: Pair, quiet: list[list[int]], other: GrpcModel
) -> None:
    metadata = (
        (SESSION_METADATA, other.session_id),
        (ADMIN_KEY_METADATA, os.environ[ADMIN_KEY_ENV]),
    )
    details: dict[str, str] = {}
    with grpc.insecure_channel(pair.gpu_target) as channel:
        stub = model_grpc.ModelServiceStub(channel)

        def measure(case: str, widths: list[int], depth: int, repeats: int) -> grpc.StatusCode:
            request = model_pb2.CostRequest(widths=widths, max_depth=depth, repeats=repeats)
            try:
                stub.MeasureCosts(request, metadata=metadata, timeout=5.0)
            except grpc.RpcError as e:
                details[case] = e.details() or ""
                return e.code()
            return OK

        calls: list[BadCall] = [
            (case, lambda case=case, c=c: measure(case, *c[:3]))
            for case, c in WIRE_OUT_OF_RANGE.items()
        ]
        statuses = beside_streams(pair, quiet, calls)
    assert statuses == {case: {INVALID} for case in WIRE_OUT_OF_RANGE}
    for case, (*_, word) in WIRE_OUT_OF_RANGE.items():
        assert word in details[case], details[case]
    assert "max_depth 4294967295" in details["huge-depth"]


def test_another_sessions_calls_beside_healthy_streams(
    pair: Pair, quiet: list[list[int]], other: GrpcModel
) -> None:
    session = ((SESSION_METADATA, other.session_id),)
    with grpc.insecure_channel(pair.gpu_target) as channel:
        stub = model_grpc.ModelServiceStub(channel)

        def free(i: int) -> grpc.StatusCode:
            request = model_pb2.FreeSequenceRequest(seq_id=i)
            return code_of(lambda: stub.FreeSequence(request, metadata=session, timeout=5.0))

        def verify(i: int) -> grpc.StatusCode:
            request = model_pb2.VerifyRequest(seq_ids=[i], ks=[1], tokens=[1])
            return code_of(lambda: stub.DecodeVerifyBatched(request, metadata=session, timeout=5.0))

        calls: list[BadCall] = [
            *((f"FreeSequence-{i}", lambda i=i: free(i)) for i in range(1, 65)),
            *((f"DecodeVerifyBatched-{i}", lambda i=i: verify(i)) for i in range(1, 65)),
            (
                "ReadLogits",
                lambda: code_of(
                    lambda: stub.ReadLogits(
                        model_pb2.ReadLogitsRequest(), metadata=session, timeout=5.0
                    )
                ),
            ),
            (
                "SetForward",
                lambda: code_of(
                    lambda: stub.SetForward(
                        model_pb2.SetForwardRequest(forward="eager"), metadata=session, timeout=5.0
                    )
                ),
            ),
        ]
        statuses = beside_streams(pair, quiet, calls)
    want = {name: {NOT_FOUND} for name, _ in calls[:-2]} | {
        "ReadLogits": {DENIED},
        "SetForward": {DENIED},
    }
    assert statuses == want
