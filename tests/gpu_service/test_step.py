"""`decode_step`: a greedy step in one call equals the verify, the greedy verdict and the
fused `settle_verdict` made separately, in process and over gRPC, with grammar masks on some
rows too; bad input is refused before anything runs."""

from __future__ import annotations

import pytest

from control_plane.replicas.client import GrpcModel
from gpu_service.engine.facade import Engine
from protos.model import CircuitModel, InvalidArgument, StepResult, room_to_propose
from tests.conftest import TINY_SERVICE
from tests.steps import logit_rows

PROMPTS = [[5, 9, 14, 3, 7, 7, 2], [40, 41, 42, 43], [100, 3, 100, 3, 100]]


def _greedy(rows: list[list[int]], argmax: list[int]) -> tuple[list[int], list[int]]:
    accepted, last, row = [], [], 0
    for r in rows:
        n = 0
        while n + 1 < len(r) and r[n + 1] == argmax[row + n]:
            n += 1
        accepted.append(n)
        last.append(argmax[row + n])
        row += len(r)
    return accepted, last


def _masks(model: CircuitModel, ks: list[int]) -> dict[int, bytes]:
    """Every other row allows only every third token (a grammar's mask, as the wire holds it)."""
    vocab = model.capabilities().vocab_size
    bits = bytearray(4 * -(-vocab // 32))
    for t in range(0, vocab, 3):
        bits[t // 8] |= 1 << (t % 8)
    return {r: bytes(bits) for r in range(0, sum(ks), 2)}


def _two_calls(
    model: CircuitModel, seqs, rows, want, nd, masked: bool
) -> tuple[StepResult, list[bytes]]:
    ks = [len(r) for r in rows]
    masks = _masks(model, ks) if masked else None
    verified = model.decode_verify_batched([t for r in rows for t in r], ks, seqs, masks=masks)
    argmax, logprobs = verified.argmax, verified.logprobs
    accepted, last = _greedy(rows, argmax)
    cap = TINY_SERVICE.max_context
    committed = [s.seq_len - (k - n - 1) for s, k, n in zip(seqs, ks, accepted, strict=True)]
    proposers = [i for i in range(len(seqs)) if want[i] and room_to_propose(committed[i], nd, cap)]
    proposal = model.settle_verdict(
        seqs, [n + 1 for n in accepted], ks, proposers, [last[i] for i in proposers], nd
    )
    return StepResult(argmax, logprobs, accepted, proposers, proposal), logit_rows(model)


def _drive(model: CircuitModel, fused: bool, masked: bool = False) -> list:
    """Three steps over three sequences, each step's rows [last, drafts...] from the previous
    step's result, as the scheduler would make them; `masked`: every other row under a mask."""
    seqs = [model.alloc_sequence() for _ in PROMPTS]
    try:
        argmax = model.prefill(seqs, PROMPTS).argmax
        rows = [[a] for a in argmax]
        want, nd, trace = [True, True, False], 3, []
        for _ in range(3):
            if fused:
                ks = [len(r) for r in rows]
                flat = [t for r in rows for t in r]
                masks = _masks(model, ks) if masked else None
                res = model.decode_step(flat, ks, seqs, want, nd, masks=masks)
                logits = logit_rows(model)  # the drafter's, last
            else:
                res, logits = _two_calls(model, seqs, rows, want, nd, masked)
            trace.append((res, logits, [s.seq_len for s in seqs]))
            off, nxt = 0, []
            for i, r in enumerate(rows):
                bonus = res.argmax[off + res.accepted[i]]
                drafts = res.proposal.drafts[res.proposers.index(i)] if i in res.proposers else []
                nxt.append([bonus, *drafts[: 3 - i % 2]])  # widths that differ by sequence
                off += len(r)
            rows = nxt
        return trace
    finally:
        for s in seqs:
            model.free_sequence(s)


def test_one_call_equals_the_separate_calls(engine: Engine) -> None:
    fused, separate = _drive(engine, True), _drive(engine, False)
    assert [r for r, _, _ in fused] == [r for r, _, _ in separate]
    assert [lg for _, lg, _ in fused] == [lg for _, lg, _ in separate], "same drafter logits"
    assert [n for _, _, n in fused] == [n for _, _, n in separate]
    assert all(r.proposers == [0, 1] for r, _, _ in fused), "0 and 1 want drafts, 2 not"
    assert all(len(d) == 3 for r, _, _ in fused for d in r.proposal.drafts)


def test_masked_rows_in_one_call_equal_the_separate_calls(engine: Engine) -> None:
    fused, separate = _drive(engine, True, True), _drive(engine, False, True)
    assert [r for r, _, _ in fused] == [r for r, _, _ in separate]
    assert [n for _, _, n in fused] == [n for _, _, n in separate]
    masked_rows = [
        t for r, _, _ in fused for t in r.argmax[::2]
    ]  # each step's rows 0, 2, ... were masked: only every third token may come out
    assert masked_rows and all(t % 3 == 0 for t in masked_rows)
    assert fused != _drive(engine, True), "the masks changed what the step chose"


def test_over_grpc_equals_in_process(engine: Engine, client: GrpcModel) -> None:
    assert _drive(client, True) == _drive(engine, True)
    assert _drive(client, True, True) == _drive(engine, True, True)


def test_no_drafts_without_room(engine: Engine) -> None:
    seq = engine.alloc_sequence()
    cap = TINY_SERVICE.max_context
    first = engine.prefill([seq], [[3] * (cap - 2)]).argmax[0]
    # 3 drafts would sit at positions cap - 2 .. cap: one past the context
    res = engine.decode_step([first], [1], [seq], [True], 3)
    assert res.proposers == [] and res.proposal.drafts == [] and seq.seq_len == cap - 1
    res = engine.decode_step([res.argmax[0]], [1], [seq], [True], 1)
    assert res.proposers == [0] and len(res.proposal.drafts[0]) == 1 and seq.seq_len == cap
    engine.free_sequence(seq)


def test_a_proposer_without_room_is_refused(engine: Engine) -> None:
    """The rule the scheduler asks by is the one the service checks."""
    cap = TINY_SERVICE.max_context
    assert room_to_propose(cap - 2, 3, cap) and not room_to_propose(cap - 1, 3, cap)
    seq = engine.alloc_sequence()
    try:
        first = engine.prefill([seq], [[3] * (cap - 2)]).argmax[0]
        (top,) = engine.decode_verify_batched([first], [1], [seq]).argmax
        with pytest.raises(InvalidArgument, match="3 drafts from position .* exceed the context"):
            engine.settle_verdict([seq], [1], [1], [0], [top], 3)
        engine.settle_verdict([seq], [1], [1], [], [], 0)  # nothing ran: it still settles
        assert seq.seq_len == cap - 1
    finally:
        engine.free_sequence(seq)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, s: m.decode_step([1], [1], [s], [True, False], 3), "want_drafts"),
        (lambda m, s: m.decode_step([100000], [1], [s], [False], 0), "vocabulary"),
        (lambda m, s: m.decode_step([1, 2], [1], [s], [False], 0), "token"),
        (lambda m, s: m.decode_step([1], [1], [s], [True], 99), "num_drafts"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(
    engine: Engine, client: GrpcModel, call, message: str
) -> None:
    for model in (engine, client):
        seq = model.alloc_sequence()
        model.prefill([seq], [[4, 5, 6]])
        with pytest.raises(InvalidArgument, match=message):
            call(model, seq)
        assert seq.seq_len == 3
        res = model.decode_step([7], [1], [seq], [False], 0)  # the sequence still steps
        assert res.accepted == [0] and seq.seq_len == 4
        model.free_sequence(seq)
