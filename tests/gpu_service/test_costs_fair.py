"""MeasureCosts over gRPC runs in short engine-thread steps: another client's calls, issued
while a measurement runs, complete between its steps instead of waiting for the whole of it
(they end before it does: an order, not a timing);
its scratch sequences stay reserved from the first step to the last and are freed when the
call ends, cancelled included."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpu_service.engine.facade import Engine
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import ADMIN_KEY_METADATA, SESSION_METADATA
from tests.conftest import TINY_SERVICE
from tests.protos.test_bodies import ADMIN_KEY, serving

# Slow: measurements slowed to seconds on purpose.
pytestmark = pytest.mark.slow

ADMIN = ((ADMIN_KEY_METADATA, ADMIN_KEY),)
WIDTHS, MAX_DEPTH, REPEATS = [1, 6], 1, 25
CELLS = [(w, d) for w in WIDTHS for d in range(MAX_DEPTH + 1)]  # TINY_SERVICE allows them all
SCRATCH = max(WIDTHS)
# Each fold of the measured forward sleeps this long, so the measurement's 100 steps take
# seconds on any machine: far longer than a few calls queued between two of them.
FOLD_S = 0.02


def slow_engine(tiny_dir: Path) -> Engine:
    engine = Engine(tiny_dir, TINY_SERVICE)
    engine.add_forward("slow-fold", lambda state, slots: time.sleep(FOLD_S))
    engine.set_forward("slow-fold")
    return engine


@pytest.fixture
async def stub(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    async with serving(slow_engine(tiny_dir)) as target:
        async with grpc.aio.insecure_channel(target) as channel:
            yield pb_grpc.ModelServiceStub(channel)


def measure(stub: pb_grpc.ModelServiceStub) -> Any:
    request = pb.CostRequest(widths=WIDTHS, max_depth=MAX_DEPTH, repeats=REPEATS, refresh=True)
    return stub.MeasureCosts(request, metadata=ADMIN)


async def free_slots(stub: pb_grpc.ModelServiceStub) -> int:
    return (await stub.Capabilities(pb.CapabilitiesRequest())).free_slots


async def reserved(stub: pb_grpc.ModelServiceStub, measuring: Any) -> None:
    """Polls Capabilities, each answered while the measurement (a task or a call) runs, until
    the scratch sequences are allocated."""
    for _ in range(100):
        free = await free_slots(stub)
        assert not measuring.done(), "Capabilities waited behind the whole measurement"
        if free == TINY_SERVICE.num_slots - SCRATCH:
            return
        await asyncio.sleep(0.01)  # polling the measurement's first step
    raise AssertionError(f"{free} slots free; the measurement never started")


async def test_calls_run_between_measurement_steps(stub: pb_grpc.ModelServiceStub) -> None:
    stream = stub.OpenSession(pb.OpenSessionRequest())
    session = ((SESSION_METADATA, (await stream.read()).session_id),)
    measuring = asyncio.ensure_future(measure(stub))
    await reserved(stub, measuring)
    seq = await stub.AllocSequence(pb.AllocSequenceRequest(), metadata=session)
    item = pb.PrefillItem(seq_id=seq.seq_id, tokens=[1, 2, 3, 4])
    await stub.Prefill(pb.PrefillRequest(items=[item]), metadata=session)
    await stub.FreeSequence(pb.FreeSequenceRequest(seq_id=seq.seq_id), metadata=session)
    assert await free_slots(stub) == TINY_SERVICE.num_slots - SCRATCH, "still reserved"
    assert not measuring.done(), "the calls finished while the measurement ran"
    reply = await measuring
    stream.cancel()
    assert [(e.width, e.depth) for e in reply.entries] == CELLS and not reply.cached
    assert all(e.verify_ms > 0 and e.propose_ms > 0 for e in reply.entries)
    assert await free_slots(stub) == TINY_SERVICE.num_slots


async def test_cancelled_measurement_frees_its_sequences(stub: pb_grpc.ModelServiceStub) -> None:
    call = measure(stub)
    await reserved(stub, call)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(100):
        if await free_slots(stub) == TINY_SERVICE.num_slots:
            break
        await asyncio.sleep(0.01)  # the cancelled handler's free job, queued behind its step
    assert await free_slots(stub) == TINY_SERVICE.num_slots
