"""Sessions and admin calls of the GPU service, over real sockets: a sequence belongs to the
session that allocated it, an ended session's sequences are freed within the session timeout
(closed, killed or frozen client), and admin calls need the admin key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from control_plane.cli.launch import start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import SESSION_METADATA, NotFound, PermissionDenied
from tests.conftest import SERVE_ARGS
from tests.servers import free_slots_within

# Slow: starts service processes, kills and freezes clients.
pytestmark = pytest.mark.slow

KEY = "test-admin-key"
SESSION_TIMEOUT = 1.0
SLACK = 1.0  # scheduling noise on a loaded machine, on top of the bound under test
NUM_SLOTS = 8  # SERVE_ARGS' tiers: 2 + 2 + 4

# A client process that takes every slot, says so, and waits to be killed or stopped.
HOLDER = f"""
import sys, time
from control_plane.replicas.client import GrpcModel
model = GrpcModel(sys.argv[1])
seqs = [model.alloc_sequence() for _ in range({NUM_SLOTS})]
print("holding", len(seqs), flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def target(tiny_dir: Path) -> Iterator[str]:
    args = ("--session-timeout", str(SESSION_TIMEOUT), "--admin-key", KEY)
    args += ("--max-slots-per-session", str(NUM_SLOTS))  # `HOLDER` takes every slot
    proc, target = start_gpu_service(tiny_dir, *SERVE_ARGS, *args)
    try:
        yield target
    finally:
        assert stop(proc) == 0


@pytest.fixture
def observer(target: str) -> Iterator[GrpcModel]:
    model = GrpcModel(target)
    yield model
    model.close()


def test_another_sessions_sequence_is_not_found(target: str) -> None:
    mine, theirs = GrpcModel(target), GrpcModel(target)
    try:
        seq = mine.alloc_sequence()
        with pytest.raises(NotFound) as unknown:
            mine.free_sequence(type(seq)(seq_id=10**9, slot=0))
        attempts: list[Callable[[], object]] = [
            lambda: theirs.free_sequence(seq),
            lambda: theirs.prefill([seq], [[1, 2, 3]]),
            lambda: theirs.decode_verify_batched([1], [1], [seq]),
            lambda: theirs.trim_proposer_state([seq]),
        ]
        for attempt in attempts:
            with pytest.raises(NotFound) as refused:
                attempt()
            assert str(refused.value) == str(unknown.value).replace(str(10**9), str(seq.seq_id))
        assert len(mine.prefill([seq], [[1, 2, 3]]).argmax) == 1, "the owner still uses it"
        mine.free_sequence(seq)
    finally:
        mine.close()
        theirs.close()


@pytest.mark.parametrize("metadata", [(), ((SESSION_METADATA, "no-such-session"),)])
def test_a_call_without_a_live_session_is_refused(target: str, metadata: tuple) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ModelServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.AllocSequence(pb.AllocSequenceRequest(), metadata=metadata, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "session" in e.value.details()


def test_closing_a_session_frees_its_sequences(target: str, observer: GrpcModel) -> None:
    model = GrpcModel(target)
    for _ in range(3):
        model.alloc_sequence()
    assert observer.capabilities().free_slots == NUM_SLOTS - 3
    model.close()
    free_slots_within(observer, NUM_SLOTS, SESSION_TIMEOUT + SLACK)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_client_frees_every_slot(target: str, observer: GrpcModel, sig: int) -> None:
    """Killed: the connection closes. Frozen: it stays open but stops answering the service's
    pings, so only the session timeout ends it."""
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, target], cwd=repo, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == f"holding {NUM_SLOTS}\n"
        assert observer.capabilities().free_slots == 0
        os.kill(child.pid, sig)
        free_slots_within(observer, NUM_SLOTS, SESSION_TIMEOUT + SLACK)
    finally:
        child.kill()
        child.wait()


def test_admin_calls_need_the_key(target: str) -> None:
    without, wrong, admin = (GrpcModel(target, admin_key=k) for k in ("", "guess", KEY))
    try:
        calls: list[Callable[[GrpcModel], object]] = [
            lambda m: m.set_forward("eager"),
            lambda m: m.read_logits(),
            lambda m: m.measure_costs([1], 1, repeats=1),
        ]
        for call in calls:
            for model in (without, wrong):
                with pytest.raises(PermissionDenied, match="admin key"):
                    call(model)
            call(admin)
    finally:
        for model in (without, wrong, admin):
            model.close()


def test_without_an_admin_key_admin_calls_are_refused(tiny_dir: Path) -> None:
    proc, target = start_gpu_service(tiny_dir, *SERVE_ARGS, "--admin-key", "")
    try:
        model = GrpcModel(target, admin_key="anything")
        with pytest.raises(PermissionDenied, match="without an admin key"):
            model.set_forward("eager")
        model.close()
    finally:
        assert stop(proc) == 0
