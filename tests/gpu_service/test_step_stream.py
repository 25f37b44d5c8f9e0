"""The step stream over gRPC (`StepStream`): plans sent ahead give the tokens of the same
unary steps, refusals stay with their sequence, the service's wait is told, a frame that
does not parse ends the stream after the results before it, and a dead service fails a waiting
`recv` at once. The conversions first, as tests/protos/test_convert.py's."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from control_plane.cli.launch import start_gpu_service
from control_plane.replicas.client import GrpcModel
from gpu_service.engine.facade import Engine
from gpu_service.engine.plans import PlanClock
from protos import convert as cv
from protos.met.v1 import model_pb2 as pb
from protos.model import SESSION_METADATA, Proposal, SequenceHandle, StepResult
from protos.steps import MAX_PLAN_REPEAT, PlanResult, StepPlan
from tests.conftest import SERVE_ARGS, TINY_SERVICE
from tests.servers import model_server

PROMPTS = [[1, 2, 3, 4, 5], [9] * 7, [200, 100, 50]]
# Frames that do not parse as a StepPlan: a varint that never ends; a trace key not UTF-8.
UNPARSED = [b"\xff" * 8, b"\x3a\x03\x0a\x01\xff"]
NUM_DRAFTS = 2  # within every slot the three prompts take (0 .. 2: 3, 3 and 2 drafts)
UNKNOWN = 10**9


def wire(msg: Any) -> Any:
    """The message as the other process parses it."""
    return type(msg).FromString(msg.SerializeToString())


def test_plan_round_trip() -> None:
    plan = StepPlan(
        cv.handles([5, 2**40, 7]),
        [True, False, False],
        [11, 12, 13],
        [0, 2, 1],
        [True, False, True],
        3,
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        repeat=3,
        then_trace=[
            {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01"},
            {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-d7ad6b7169203331-01"},
        ],
        drafters=["dflash", "", "mtp"],
    )
    assert cv.plan_from_pb(wire(cv.plan_to_pb(plan))) == plan
    assert cv.plan_from_pb(pb.StepPlan()).repeat == 1, "unset: one step"


@pytest.mark.parametrize(
    "result",
    [
        PlanResult(
            StepResult(
                [5, 6, 7, 8], [-0.5, 0.0, -1.0, -0.25], [1, 0], [1], Proposal([[3]], [[0.5]])
            ),
            [0, 2],
            [1, 2, 3, 4],
            [3, 1],
            [(1, "NOT_FOUND", "sequence 9 is unknown or already freed")],
            0.125,
        ),
        PlanResult(
            StepResult([], [], [], [], Proposal([], [])),
            [],
            [],
            [],
            [(0, "INVALID_ARGUMENT", "a"), (1, "INVALID_ARGUMENT", "a")],
        ),
    ],
    ids=["a-refusal-among-two", "refused-whole"],
)
def test_plan_result_round_trip(result: PlanResult) -> None:
    lens = [20 + i for i in range(len(result.ran))]
    reply = wire(cv.plan_result_to_pb(result, lens))
    assert cv.plan_result_from_pb(reply) == result
    assert list(reply.step.seq_lens) == lens


def test_a_plans_steps_travel_in_one_message() -> None:
    empty = StepResult([], [], [], [], Proposal([], []))
    steps = [PlanResult(empty, [], [], [], [(0, "NOT_FOUND", str(n))], 0.5 - n) for n in range(3)]
    msg = wire(cv.plan_results_to_pb([cv.plan_result_to_pb(r, []) for r in steps]))
    assert [cv.plan_result_from_pb(m) for m in cv.plan_results_from_pb(msg)] == steps


def test_plan_clock() -> None:
    """A plan waits from the end of the one before it to its own arrival; a plan that was
    there already, or the first, waits 0."""
    clock = PlanClock()
    empty = PlanResult(StepResult([], [], [], [], Proposal([], [])), [], [], [], [])
    assert clock.run(time.perf_counter(), lambda: empty).waited_s == 0.0
    assert clock.run(time.perf_counter() - 1.0, lambda: empty).waited_s == 0.0
    assert clock.run(time.perf_counter() + 0.25, lambda: empty).waited_s >= 0.25


def continuations(step: StepResult, ks: list[int]) -> list[list[int]]:
    """What each sequence's next continuing plan verifies: its bonus token, then its drafts."""
    out, row0 = [], 0
    for k, accepted in zip(ks, step.accepted, strict=True):
        out.append([step.argmax[row0 + accepted]])
        row0 += k
    for j, i in enumerate(step.proposers):
        out[i] += step.proposal.drafts[j]
    return out


def unary_steps(model: GrpcModel, n: int) -> tuple[list[StepResult], list[list[int]], list[int]]:
    """`n` DecodeSteps of PROMPTS, each verifying the last one's continuations. -> (the
    steps, each step's rows, the final lengths)"""
    seqs = [model.alloc_sequence() for _ in PROMPTS]
    rows = [[t] for t in model.prefill(seqs, PROMPTS).argmax]
    steps, flat = [], []
    for _ in range(n):
        ks = [len(r) for r in rows]
        flat.append([t for r in rows for t in r])
        steps.append(model.decode_step(flat[-1], ks, seqs, [True] * 3, NUM_DRAFTS))
        rows = continuations(steps[-1], ks)
    lens = [s.seq_len for s in seqs]
    for s in seqs:
        model.free_sequence(s)
    return steps, flat, lens


def test_plans_sent_ahead_equal_unary_steps(client: GrpcModel) -> None:
    steps, rows, lens = unary_steps(client, 5)
    seqs = [client.alloc_sequence() for _ in PROMPTS]  # the slots the unary steps had
    first = client.prefill(seqs, PROMPTS).argmax
    stream = client.open_steps()
    try:
        stream.send(StepPlan(seqs, [False] * 3, first, [1] * 3, [True] * 3, NUM_DRAFTS))
        for _ in range(4):
            stream.send(StepPlan(seqs, [True] * 3, [], [0] * 3, [True] * 3, NUM_DRAFTS))
        results = [stream.recv() for _ in range(5)]
        assert [s.seq_len for s in seqs] == lens, "each result gave the handles their lengths"
        stream.send(StepPlan(seqs, [True] * 3, [], [0] * 3, [True] * 3, NUM_DRAFTS))
        late = stream.recv()
    finally:
        stream.close()
    assert [r.step for r in results] == steps
    assert [r.rows for r in results] == rows
    assert all(r.ran == [0, 1, 2] and not r.refused for r in results)
    # The first plan waits for none; the last one left only after the service answered the
    # one before it. How long plans sent ahead waited is the machine's to say (a loaded one
    # reads one late); test_plan_clock has the exact rule.
    assert results[0].waited_s == 0.0
    assert late.waited_s > 0
    for s in seqs:
        client.free_sequence(s)


def test_a_repeated_plan_runs_as_its_steps_sent_one_by_one(client: GrpcModel) -> None:
    steps, rows, lens = unary_steps(client, 5)
    seqs = [client.alloc_sequence() for _ in PROMPTS]
    first = client.prefill(seqs, PROMPTS).argmax
    every = ([True] * 3, [], [0] * 3, [True] * 3, NUM_DRAFTS)
    stream = client.open_steps()
    try:
        stream.send(StepPlan(seqs, [False] * 3, first, [1] * 3, [True] * 3, NUM_DRAFTS))
        stream.send(StepPlan(seqs, *every, repeat=4))
        results = [stream.recv() for _ in range(5)]
        assert [s.seq_len for s in seqs] == lens
        stream.send(StepPlan(seqs, *every, repeat=MAX_PLAN_REPEAT + 1))
        too_long = stream.recv()  # refused whole, once: it changed nothing
        stream.send(StepPlan(seqs, *every, repeat=2, then_trace=[{}, {}]))
        traced = [stream.recv(), stream.recv()]  # refused whole at each of its steps
        stream.send(StepPlan(seqs, *every, repeat=2))
        after = [stream.recv(), stream.recv()]
    finally:
        stream.close()
    assert [r.step for r in results] == steps
    assert [r.rows for r in results] == rows
    assert all(r.ran == [0, 1, 2] and not r.refused for r in results)
    assert too_long.ran == [] and [c for _, c, _ in too_long.refused] == ["INVALID_ARGUMENT"] * 3
    assert f"1 to {MAX_PLAN_REPEAT} steps" in too_long.refused[0][2]
    for r in traced:
        assert r.ran == [] and [c for _, c, _ in r.refused] == ["INVALID_ARGUMENT"] * 3
        assert "2 trace contexts for its 1 later steps" in r.refused[0][2]
    assert all(r.ran == [0, 1, 2] for r in after)
    assert after[0].rows[:1] == [results[-1].step.argmax[results[-1].step.accepted[0]]]
    for s in seqs:
        client.free_sequence(s)


def test_refusals_stay_with_their_sequence(client: GrpcModel, served: str) -> None:
    other = GrpcModel(served)
    try:
        a, b, c, d = (client.alloc_sequence() for _ in range(4))
        first = client.prefill([a, b, c, d], [[1, 2], [3, 4], [5, 6], [7, 8]]).argmax
        rows = continuations(
            client.decode_step(first, [1] * 4, [a, b, c, d], [True] * 4, 2), [1] * 4
        )
        theirs = other.alloc_sequence()
        other.decode_step(other.prefill([theirs], [[9, 10]]).argmax, [1], [theirs], [False], 0)
        client.free_sequence(a)
        client.prefill([c], [[11]])  # its last call is not a step: nothing to continue from
        plan = StepPlan(
            [a, b, SequenceHandle(UNKNOWN, 0), c, theirs, d],
            [True, False, True, True, True, True],
            rows[1][:2],  # b gives its rows
            [0, 2, 0, 0, 0, 0],
            [True] * 6,
            2,
        )
        malformed = StepPlan([b, d], [True, True], [], [0, 0], [True], 2)
        stream = client.open_steps()
        try:
            for p in (plan, malformed, StepPlan([d], [True], [], [0], [False], 0)):
                stream.send(p)
            result, refused_whole, after = (stream.recv() for _ in range(3))
        finally:
            stream.close()
        assert (result.ran, result.rows) == ([1, 5], [*rows[1][:2], *rows[3]])
        codes = [(i, code) for i, code, _ in result.refused]
        assert codes == [
            (0, "NOT_FOUND"),
            (2, "NOT_FOUND"),
            (3, "FAILED_PRECONDITION"),
            (4, "NOT_FOUND"),
        ]
        sentences = {i: sentence for i, _, sentence in result.refused}
        assert sentences[4] == sentences[2].replace(str(UNKNOWN), str(theirs.seq_id))
        assert "continue" in sentences[3]
        assert refused_whole.ran == [] and [r[:2] for r in refused_whole.refused] == [
            (0, "INVALID_ARGUMENT"),
            (1, "INVALID_ARGUMENT"),
        ]
        assert after.ran == [0], "the stream went on"
        theirs_stream = other.open_steps()
        try:
            theirs_stream.send(StepPlan([theirs], [True], [], [0], [False], 0))
            assert theirs_stream.recv().ran == [0], "the other session's sequence is untouched"
        finally:
            theirs_stream.close()
        for h in (b, c, d):
            client.free_sequence(h)
    finally:
        other.close()


def test_a_closed_stream_stops_its_plans(client: GrpcModel) -> None:
    """Plans queued behind the one running never run once their caller is gone: the unary
    step after the close finds the sequence short of them."""
    seq = client.alloc_sequence()
    stream = client.open_steps()
    stream.send(
        StepPlan([seq], [False], client.prefill([seq], [[1, 2, 3]]).argmax, [1], [False], 0)
    )
    for _ in range(200):
        stream.send(StepPlan([seq], [True], [], [0], [False], 0))  # one token each
    stream.recv()
    stream.close()
    client.decode_step([5], [1], [seq], [False], 0)
    assert seq.seq_len < 3 + 201 + 1
    client.free_sequence(seq)


# Slow: starts and kills a GPU service.
@pytest.mark.slow
def test_recv_raises_unavailable_soon_after_the_service_dies(tiny_dir: Path) -> None:
    proc, target = start_gpu_service(tiny_dir, *SERVE_ARGS)
    model = GrpcModel(target)
    try:
        seq = model.alloc_sequence()
        stream = model.open_steps()
        stream.send(
            StepPlan([seq], [False], model.prefill([seq], [[1, 2, 3]]).argmax, [1], [True], 1)
        )
        assert stream.recv().ran == [0]
        proc.kill()
        proc.wait(10)
        killed = time.monotonic()
        stream.send(StepPlan([seq], [True], [], [0], [True], 1))
        with pytest.raises(grpc.RpcError) as lost:
            stream.recv()
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - killed < 2.0
    finally:
        proc.kill()
        proc.wait(10)
        model.close()


@pytest.fixture(scope="module")
def in_process(tiny_dir: Path) -> Iterator[str]:
    """The GPU service's server, built as `serve` builds it, in this process over the tiny
    model."""
    engine = Engine(tiny_dir, TINY_SERVICE)

    with model_server(engine) as target:
        yield target


def test_a_frame_that_does_not_parse_ends_the_stream_after_the_plans_before_it(
    in_process: str,
) -> None:
    """The race of the plans sent ahead and the bad frame behind them, 300 times: each call
    gives every earlier plan's result (they ran: the sequence grew by one a plan), then
    INVALID_ARGUMENT; none is left without a status (a hang would end at the deadline)."""
    model = GrpcModel(in_process)
    channel = grpc.insecure_channel(in_process)
    raw = channel.stream_stream(
        f"/{pb.DESCRIPTOR.services_by_name['ModelService'].full_name}/StepStream"
    )
    outcomes: Counter[tuple[str, str]] = Counter()
    seq = None
    try:
        for run in range(300):
            if seq is None or seq.seq_len > TINY_SERVICE.max_context - 8:
                if seq is not None:
                    model.free_sequence(seq)
                seq = model.alloc_sequence()
                model.prefill([seq], [[1, 2, 3]])
            n = run % 4  # 0 .. 3 plans ahead of the bad frame
            plan = cv.plan_to_pb(StepPlan([seq], [False], [7], [1], [False], 0))
            frames = [plan.SerializeToString()] * n + [UNPARSED[run % 2]]
            call = raw(iter(frames), metadata=((SESSION_METADATA, model.session_id),), timeout=10)
            lens = []
            try:
                for body in call:
                    lens += [
                        r.step.seq_lens[0]
                        for r in cv.plan_results_from_pb(pb.PlanResult.FromString(body))
                    ]
            except grpc.RpcError:
                pass
            ran = lens == [seq.seq_len + i + 1 for i in range(n)]
            outcomes[("ran" if ran else f"results {lens}", call.code().name)] += 1
            seq.seq_len += len(lens)
            assert "met.v1.StepPlan" in call.details()
    finally:
        if seq is not None:
            model.free_sequence(seq)
        channel.close()
        model.close()
    assert outcomes == {("ran", "INVALID_ARGUMENT"): 300}
