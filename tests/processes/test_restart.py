"""A lost control plane, over real processes: killed (`kill -9`) or frozen (SIGSTOP) with open
streams, its GPU service session ends and every slot it held is free within the session
timeout; a control plane started in its place then serves a full house of streams."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.servers import free_slots_within

# Slow: kills and freezes control plane processes.
pytestmark = pytest.mark.slow

SESSION_TIMEOUT = 2.0
SLACK = 1.5  # scheduling noise on a loaded machine, on top of the bound under test
TIERS = "8:3,8:2,16:1"  # 32 slots
NUM_SLOTS = 32
NUM_HELD = 8
MAX_CONTEXT = 1024
HELD_TOKENS = 1000  # far more than a stream can produce before the kill
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def service(tiny_dir: Path) -> Iterator[str]:
    proc, target = start_gpu_service(
        tiny_dir,
        *("--verify-tiers", TIERS, "--max-context", str(MAX_CONTEXT)),
        *("--max-rows", "64", "--max-batch", str(NUM_SLOTS)),
        *("--session-timeout", str(SESSION_TIMEOUT)),
        # One control plane's streams take every slot (by default a session holds all but one).
        *("--max-slots-per-session", str(NUM_SLOTS)),
    )
    try:
        yield target
    finally:
        assert stop(proc) == 0


@pytest.fixture
def observer(service: str) -> Iterator[GrpcModel]:
    model = GrpcModel(service)
    assert model.capabilities().num_slots == NUM_SLOTS
    yield model
    model.close()


def fewest_free_slots(model: GrpcModel, work: Callable[[], object]) -> int:
    """The fewest free slots the service reported while `work` ran."""
    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen.append(model.capabilities().free_slots)
            time.sleep(0.002)  # sampling another process's slot table

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return min(seen)


def hold_slots(stub: pb_grpc.GenerationServiceStub, n: int) -> list[grpc.Future]:
    """`n` long streams, each past its first token: admitted, so holding a slot."""
    calls = [
        stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=[i + 1], ignore_eos=True, max_new_tokens=HELD_TOKENS
            )
        )
        for i in range(n)
    ]
    for call in calls:
        assert next(call).token_ids
    return calls


def generate(stub: pb_grpc.GenerationServiceStub, prompt: list[int]) -> list[int]:
    """A greedy stream's tokens, checked to end by length with every token counted."""
    request = pb.GenerateRequest(
        prompt_token_ids=prompt, ignore_eos=True, max_new_tokens=NEW_TOKENS
    )
    tokens, last = [], None
    for msg in stub.Generate(request, timeout=60):
        tokens += msg.token_ids
        last = msg
    assert last is not None and last.finish_reason == "length"
    assert len(tokens) == last.usage.completion_tokens == NEW_TOKENS
    return tokens


@contextmanager
def control_plane(
    service: str, tiny_dir: Path
) -> Iterator[tuple[subprocess.Popen, pb_grpc.GenerationServiceStub]]:
    """A control plane process and a stub over a channel to it; killed on the way out unless
    it has exited."""
    proc, target = start_control_plane(service, "--tokenizer", str(tiny_dir))
    try:
        with grpc.insecure_channel(target) as channel:
            yield proc, pb_grpc.GenerationServiceStub(channel)
    finally:
        proc.kill()  # a no-op once it has exited; SIGKILL ends a stopped process too
        proc.wait()


def lose_slots(
    observer: GrpcModel,
    proc: subprocess.Popen,
    stub: pb_grpc.GenerationServiceStub,
    sig: signal.Signals,
) -> list[grpc.Future]:
    """`NUM_HELD` streams open on `proc`, then `sig` to it; returns the streams once the
    service has freed every slot they held."""
    calls = hold_slots(stub, NUM_HELD)
    assert observer.capabilities().free_slots == NUM_SLOTS - NUM_HELD
    proc.send_signal(sig)
    seconds = free_slots_within(observer, NUM_SLOTS, SESSION_TIMEOUT + SLACK)
    print(f"\n{sig.name}: every slot free after {seconds:.2f} s")
    return calls


def broken_codes(calls: list[grpc.Future]) -> list[grpc.StatusCode]:
    """How each stream ended; each must end with an error."""
    codes = []
    for call in calls:
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:
                pass
        codes.append(ended.value.code())
    return codes


def test_killed_control_plane_frees_its_slots_and_a_new_one_serves(
    service: str, observer: GrpcModel, tiny_dir: Path
) -> None:
    with control_plane(service, tiny_dir) as (lost, stub):
        calls = lose_slots(observer, lost, stub, signal.SIGKILL)
        assert lost.wait(10) == -signal.SIGKILL
        assert set(broken_codes(calls)) == {grpc.StatusCode.UNAVAILABLE}
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(1 + i % 13)] for i in range(NUM_SLOTS)]
    with control_plane(service, tiny_dir) as (proc, stub):
        quiet = [generate(stub, p) for p in prompts]
        busy: list[list[int]] = []
        start = time.monotonic()
        with ThreadPoolExecutor(NUM_SLOTS) as pool:
            fewest = fewest_free_slots(
                observer, lambda: busy.extend(pool.map(lambda p: generate(stub, p), prompts))
            )
        print(f"{NUM_SLOTS} concurrent streams in {time.monotonic() - start:.2f} s")
        assert fewest == 0, f"the streams never held every slot at once ({fewest} stayed free)"
        assert busy == quiet
        free_slots_within(observer, NUM_SLOTS, SLACK)
        assert stop(proc) == 0


def test_frozen_control_plane_loses_its_slots_and_reconnects(
    service: str, observer: GrpcModel, tiny_dir: Path
) -> None:
    """Frozen, its connection stays open but it stops answering the service's pings, so only
    the session timeout ends its session. Resumed, it fails the streams whose sequences are
    gone and serves new ones over a new session."""
    with control_plane(service, tiny_dir) as (proc, stub):
        calls = lose_slots(observer, proc, stub, signal.SIGSTOP)
        proc.send_signal(signal.SIGCONT)
        assert set(broken_codes(calls)) == {grpc.StatusCode.UNAVAILABLE}, "a lost link"
        assert len(generate(stub, [5])) == NEW_TOKENS
        free_slots_within(observer, NUM_SLOTS, SLACK)
        assert stop(proc) == 0
