"""DFlash on every path: the one-call `decode_step` and step plans propose with a DFlash
drafter as `settle_verdict` does, a call may switch a sequence between the MTP head and DFlash
from one step to the next without changing a greedy token, and a drafter name the service has
none for is refused with a sentence naming it, in process and over gRPC."""

from __future__ import annotations

from pathlib import Path

import pytest

from control_plane.replicas.client import GrpcModel
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.model import (
    DFLASH,
    MTP_HEAD,
    FailedPrecondition,
    InvalidArgument,
    StepResult,
    greedy_accepted,
    room_for_block,
    room_to_propose,
)
from protos.steps import StepPlan
from tests.conftest import TINY
from tests.gpu_service.dflash.drafter import write_drafter
from tests.steps import logit_rows

SVC = ServiceConfig(verify_tiers="2:3,2:2", max_context=128, max_rows=24, max_batch=4)
PROMPTS = [[5, 9, 14, 3, 7, 7, 2], [40, 41, 42, 43], [100, 3, 100, 3, 100]]
ALLOCATED = [MTP_HEAD, DFLASH, DFLASH]
# Each step's drafter names (empty: each sequence's allocated one).
NAMES = [[], [DFLASH, MTP_HEAD, ""], ["", "", MTP_HEAD], [MTP_HEAD, DFLASH, DFLASH]]
ND = 3


@pytest.fixture(scope="module")
def engine(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    drafter = write_drafter(tmp_path_factory.mktemp("dflash"), TINY, taps=(0, 3), scale=0.2)
    return Engine(tiny_dir, SVC, "fp32", drafter=drafter)


def _caps(engine: Engine) -> tuple[int, ...]:
    return engine.capabilities().slot_verify_drafts


def _two_calls(engine: Engine, seqs, rows, want, names) -> StepResult:
    """The step as a verify and a `settle_verdict`, proposers by each drafter's room rule."""
    ks = [len(r) for r in rows]
    v = engine.decode_verify_batched([t for r in rows for t in r], ks, seqs)
    accepted, last, row = [], [], 0
    for r, k in zip(rows, ks, strict=True):
        accepted.append(greedy_accepted(r, v.argmax[row : row + k]))
        last.append(v.argmax[row + accepted[-1]])
        row += k
    chosen = [n or a for n, a in zip(names or [""] * len(seqs), ALLOCATED, strict=True)]
    block, ctx = engine.capabilities().dflash_block, SVC.max_context
    proposers = []
    for i, s in enumerate(seqs):
        committed = s.seq_len - (ks[i] - accepted[i] - 1)
        fits = (
            room_for_block(committed, block, ctx)
            if chosen[i] == DFLASH
            else room_to_propose(committed, ND, ctx)
        )
        if want[i] and fits:
            proposers.append(i)
    kept = [n + 1 for n in accepted]
    drafters = [chosen[i] for i in proposers] if names else []
    proposal = engine.settle_verdict(
        seqs, kept, ks, proposers, [last[i] for i in proposers], ND, drafters=drafters
    )
    return StepResult(v.argmax, v.logprobs, accepted, proposers, proposal)


def _next_rows(engine: Engine, seqs, rows, res: StepResult) -> list[list[int]]:
    out, off = [], 0
    for i, r in enumerate(rows):
        bonus = res.argmax[off + res.accepted[i]]
        drafts = res.proposal.drafts[res.proposers.index(i)] if i in res.proposers else []
        out.append([bonus, *drafts[: _caps(engine)[seqs[i].slot]]])
        off += len(r)
    return out


def _drive(engine: Engine, fused: bool, prompts=PROMPTS) -> list:
    seqs = [engine.alloc_sequence(drafter=d) for d in ALLOCATED]
    try:
        rows = [[a] for a in engine.prefill(seqs, prompts).argmax]
        want, trace = [True, True, False], []
        for names in NAMES:
            if fused:
                flat, ks = [t for r in rows for t in r], [len(r) for r in rows]
                res = engine.decode_step(flat, ks, seqs, want, ND, drafters=names)
            else:
                res = _two_calls(engine, seqs, rows, want, names)
            trace.append((res, logit_rows(engine), [s.seq_len for s in seqs]))
            rows = _next_rows(engine, seqs, rows, res)
        return trace
    finally:
        for s in seqs:
            engine.free_sequence(s)


def test_the_fused_step_equals_the_two_calls(engine: Engine) -> None:
    fused, separate = _drive(engine, True), _drive(engine, False)
    assert [r for r, _, _ in fused] == [r for r, _, _ in separate]
    assert [lg for _, lg, _ in fused] == [lg for _, lg, _ in separate], "same drafter logits"
    assert [n for _, _, n in fused] == [n for _, _, n in separate]
    assert all(r.proposers == [0, 1] for r, _, _ in fused), "0 and 1 want drafts, 2 not"


def test_a_block_without_room_gives_no_drafts(engine: Engine) -> None:
    """The fused step skips a DFlash sequence whose block would pass the context, as it
    skips an MTP sequence without room for its drafts."""
    seq = engine.alloc_sequence(drafter=DFLASH)
    try:
        block = engine.capabilities().dflash_block
        first = engine.prefill([seq], [[3] * (SVC.max_context - block)]).argmax[0]
        res = engine.decode_step([first], [1], [seq], [True], ND)
        assert res.proposers == [] and seq.seq_len == SVC.max_context - block + 1
        res = engine.decode_step([res.argmax[0]], [1], [seq], [True], ND, drafters=[MTP_HEAD])
        assert res.proposers == [0], "the MTP head's drafts still fit"
    finally:
        engine.free_sequence(seq)


def test_plans_equal_unary_steps(engine: Engine) -> None:
    """Plans that continue every sequence from the service's own verdict, the drafters named
    per plan, give the unary steps' results."""
    unary = [r for r, _, _ in _drive(engine, True)]
    seqs = [engine.alloc_sequence(drafter=d) for d in ALLOCATED]
    stream = engine.open_steps()
    try:
        rows = [[a] for a in engine.prefill(seqs, PROMPTS).argmax]
        caps = [_caps(engine)[s.slot] + 1 for s in seqs]
        flat, ks = [t for r in rows for t in r], [len(r) for r in rows]
        plans = []
        for j, names in enumerate(NAMES):
            given = j == 0
            plans.append(
                StepPlan(
                    seqs,
                    [not given] * 3,
                    flat if given else [],
                    ks if given else caps,
                    [True, True, False],
                    ND,
                    drafters=list(names),
                )
            )
        for plan in plans:
            stream.send(plan)
        got = [stream.recv() for _ in plans]
    finally:
        stream.close()
        for s in seqs:
            engine.free_sequence(s)
    assert all(r.refused == [] and r.ran == [0, 1, 2] for r in got)
    assert [r.step for r in got] == unary


def _reference(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """`n` tokens of plain greedy decoding, one a step."""
    seq = engine.alloc_sequence()
    try:
        out = [engine.prefill([seq], [prompt]).argmax[0]]
        while len(out) < n:
            out.append(engine.decode_step([out[-1]], [1], [seq], [False], 0).argmax[0])
        return out
    finally:
        engine.free_sequence(seq)


@pytest.mark.parametrize("allocated", [MTP_HEAD, DFLASH])
def test_switching_drafters_keeps_greedy_tokens(engine: Engine, allocated: str) -> None:
    """A sequence whose drafter changes from step to step, through the fused step and the two
    calls in turn, some of its drafts the true tokens (so that verifies keep some rows and
    reject the rest), generates exactly the tokens of plain greedy decoding."""
    prompt, n = PROMPTS[0], 40
    want = _reference(engine, prompt, n)
    pattern = [MTP_HEAD, DFLASH, DFLASH, MTP_HEAD, "", DFLASH, MTP_HEAD, MTP_HEAD]
    seq = engine.alloc_sequence(drafter=allocated)
    try:
        got = [engine.prefill([seq], [prompt]).argmax[0]]
        drafts: list[int] = []
        for j in range(n):
            if len(got) >= n:
                break
            true = want[len(got) : len(got) + j % 3]
            rows = [got[-1], *true, *drafts[len(true) : 3]]
            names = [pattern[j % len(pattern)]]
            if j % 2:
                res = engine.decode_step(rows, [len(rows)], [seq], [True], ND, drafters=names)
            else:
                res = _two_calls_one(engine, seq, rows, names)
            a = res.accepted[0]
            got += [*rows[1 : a + 1], res.argmax[a]]
            drafts = res.proposal.drafts[0] if res.proposers else []
    finally:
        engine.free_sequence(seq)
    assert got[:n] == want


def _two_calls_one(engine: Engine, seq, rows: list[int], names: list[str]) -> StepResult:
    v = engine.decode_verify_batched(rows, [len(rows)], [seq])
    a = greedy_accepted(rows, v.argmax)
    proposal = engine.settle_verdict(
        [seq], [a + 1], [len(rows)], [0], [v.argmax[a]], ND, drafters=names
    )
    return StepResult(v.argmax, v.logprobs, [a], [0], proposal)


def _bad_names(model) -> None:
    """Each refusal names the drafter, and the sequence still steps."""
    seq = model.alloc_sequence()
    try:
        model.prefill([seq], [[4, 5, 6]])
        with pytest.raises(InvalidArgument, match="'eagle' is unknown"):
            model.decode_step([7], [1], [seq], [True], 2, drafters=["eagle"])
        with pytest.raises(FailedPrecondition, match="no DFlash drafter"):
            model.decode_step([7], [1], [seq], [True], 2, drafters=[DFLASH])
        with pytest.raises(InvalidArgument, match="drafters"):
            model.decode_step([7], [1], [seq], [True], 2, drafters=[MTP_HEAD, MTP_HEAD])
        model.decode_verify_batched([7], [1], [seq])
        with pytest.raises(FailedPrecondition, match="no DFlash drafter"):
            model.settle_verdict([seq], [1], [1], [0], [8], 2, drafters=[DFLASH])
        model.settle_verdict([seq], [1], [1], [0], [8], 2, drafters=[MTP_HEAD])
        assert seq.seq_len == 4
        with pytest.raises(InvalidArgument, match="'eagle' is unknown"):
            model.run_mtp_propose_batched([8], [0], 2, [seq], drafters=["eagle"])
        res = model.decode_step([8], [1], [seq], [True], 2, drafters=[""])
        assert res.proposers == [0] and seq.seq_len == 5
    finally:
        model.free_sequence(seq)


def test_a_name_without_a_drafter_is_refused(tiny_dir: Path, client: GrpcModel) -> None:
    plain = Engine(tiny_dir, SVC)
    for model in (plain, client):
        _bad_names(model)
    with pytest.raises(FailedPrecondition, match="no DFlash drafter"):
        plain.alloc_sequence(drafter=DFLASH)


def test_a_plan_refuses_a_bad_name_alone(engine: Engine) -> None:
    seqs = [engine.alloc_sequence() for _ in range(2)]
    stream = engine.open_steps()
    try:
        firsts = engine.prefill(seqs, PROMPTS[:2]).argmax
        stream.send(
            StepPlan(
                seqs, [False, False], firsts, [1, 1], [True, True], ND, drafters=["eagle", DFLASH]
            )
        )
        r = stream.recv()
    finally:
        stream.close()
        for s in seqs:
            engine.free_sequence(s)
    assert r.ran == [1] and [(i, c) for i, c, _ in r.refused] == [(0, "INVALID_ARGUMENT")]
    assert "'eagle'" in r.refused[0][2] and r.step.proposers == [0]
