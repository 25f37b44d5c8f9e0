"""Fair slots: a session of the GPU service holds at most its share of the slots
(`--max-slots-per-session`, by default every slot but one), and a `Generate` that finds every
slot held by other sessions is refused with RESOURCE_EXHAUSTED after the scheduler's
`slot_wait`, not left to its deadline, while the holder's sequences go on untouched. Servers in
this process, over the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from control_plane.replicas.client import GrpcModel
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.rpc.options import Access
from protos.met.v1 import generate_pb2 as gpb
from protos.met.v1 import generate_pb2_grpc as gpb_grpc
from protos.model import ResourceExhausted, SequenceHandle
from tests.conftest import TINY_SERVICE
from tests.servers import model_server, serving

NUM_SLOTS = TINY_SERVICE.num_slots
# Well inside the Generate's deadline: a refusal at the deadline would be DEADLINE_EXCEEDED.
SLOT_WAIT_S = 0.2
DEADLINE_S = 60.0


@contextmanager
def gpu_service(tiny_dir: Path, access: Access) -> Iterator[str]:
    """The GPU service's server, built as `serve` builds it, over a fresh tiny engine."""
    engine = Engine(tiny_dir, TINY_SERVICE)

    with model_server(engine, access) as target:
        yield target


def hold_all(model: GrpcModel) -> tuple[list[SequenceHandle], str]:
    """Sequences allocated until the service refuses one, each with a prompt in. -> (them,
    the refusal's sentence)"""
    held = []
    with pytest.raises(ResourceExhausted) as refused:
        while True:
            held.append(model.alloc_sequence())
    model.prefill(held, [[1 + i, 2] for i in range(len(held))])
    return held, str(refused.value)


def generate(target: str) -> tuple[grpc.StatusCode, str, int]:
    """A greedy Generate of 4 tokens -> (its status, its sentence, tokens received)"""
    with grpc.insecure_channel(target) as channel:
        stub = gpb_grpc.GenerationServiceStub(channel)
        request = gpb.GenerateRequest(prompt_token_ids=[5, 6], max_new_tokens=4, ignore_eos=True)
        got = 0
        try:
            for reply in stub.Generate(request, timeout=DEADLINE_S):
                got += len(reply.token_ids)
        except grpc.RpcError as e:
            return e.code(), e.details(), got
        return grpc.StatusCode.OK, "", got


@contextmanager
def control_plane(gpu_target: str) -> Iterator[str]:
    opts = SchedulerOptions(slot_wait=SLOT_WAIT_S)
    scheduler = Scheduler(lambda: GrpcModel(gpu_target), ByteTokenizer.default(), opts, Env())
    with serving(scheduler) as target:
        yield target


def untouched(model: GrpcModel, held: list[SequenceHandle]) -> None:
    """The holder's sequences go on: one step each, from where they were."""
    lens = [h.seq_len for h in held]
    model.decode_step([7] * len(held), [1] * len(held), held, [False] * len(held), 0)
    assert [h.seq_len for h in held] == [n + 1 for n in lens]
    assert model.capabilities().free_slots == NUM_SLOTS - len(held)


def test_a_session_holds_every_slot_but_one_by_default(tiny_dir: Path) -> None:
    with gpu_service(tiny_dir, Access()) as target:
        holder = GrpcModel(target)
        try:
            held, sentence = hold_all(holder)
            assert len(held) == NUM_SLOTS - 1
            assert "--max-slots-per-session" in sentence
            with control_plane(target) as cp:
                code, _, got = generate(cp)
            assert (code, got) == (grpc.StatusCode.OK, 4), "the control plane found the slot"
            untouched(holder, held)
        finally:
            holder.close()


def test_a_configured_share_refuses_past_it_alone(tiny_dir: Path) -> None:
    with gpu_service(tiny_dir, Access(max_slots_per_session=3)) as target:
        first, second = GrpcModel(target), GrpcModel(target)
        try:
            held, sentence = hold_all(first)
            assert len(held) == 3 and "holds 3 sequences" in sentence
            other = second.alloc_sequence()  # another session's share is its own
            first.free_sequence(held.pop())
            held.append(first.alloc_sequence())  # a freed one makes room again
            second.free_sequence(other)
        finally:
            first.close()
            second.close()


def test_a_generate_finding_every_slot_held_elsewhere_is_refused(tiny_dir: Path) -> None:
    with gpu_service(tiny_dir, Access(max_slots_per_session=NUM_SLOTS)) as target:
        holder = GrpcModel(target)
        try:
            held, _ = hold_all(holder)
            assert len(held) == NUM_SLOTS
            with control_plane(target) as cp:
                code, sentence, got = generate(cp)
            assert (code, got) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 0)
            assert f"no slot of the GPU service came free in {SLOT_WAIT_S:g} s" in sentence
            untouched(holder, held)
        finally:
            holder.close()
