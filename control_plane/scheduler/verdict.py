"""After a verify: how many drafts stand, what each sequence gains, and the one fused call
that makes it so on the service (stash, fold, commit, then the next drafts and the trim).
Shared by every verify path."""

from __future__ import annotations

import itertools
import math

from opentelemetry.util.types import AttributeValue

from control_plane.scheduler.seq import ActiveSeq
from protos.handles import RowDraws
from protos.model import (
    ModelError,
    Proposal,
    Sampling,
    ServingModel,
    StepResult,
    Verified,
)
from protos.model import greedy_accepted as accepted
from protos.telemetry import span, tracer

TRACER = tracer("met.control_plane")


def offsets(ks: list[int]) -> list[int]:
    """Each sequence's first row, then the total."""
    out = [0]
    for k in ks:
        out.append(out[-1] + k)
    return out


def verify_and_settle(
    model: ServingModel,
    seqs: list[ActiveSeq],
    rows: list[list[int]],
    step_nd: int,
    mode: str,
    fused: bool,
) -> None:
    """One verify call over `rows[i]` of `seqs[i]`, its verdict, and the next drafts.
    `mode` (bootstrap, batched or serial) names the path in the trace. With the `fused_step`
    lever on, greedy rows, masked or not, take one `decode_step` round trip; sampled rows,
    rows asking alternatives, or the lever off, take a verify call and a verdict call.

    A refusal ends the sequence it concerns alone: a refused batch is retried one sequence
    per call to find it (the service checks a call whole before any of it runs, and a
    sequence's rows are batch invariant, so the others' tokens are those of the batch)."""
    try:
        _verify(model, seqs, rows, step_nd, mode, fused)
    except ModelError as e:
        if len(seqs) == 1:
            seqs[0].refuse(e.code, str(e))
            return
        for a, r in zip(seqs, rows, strict=True):
            verify_and_settle(model, [a], [r], step_nd, mode, fused)


def _verify(
    model: ServingModel,
    seqs: list[ActiveSeq],
    rows: list[list[int]],
    step_nd: int,
    mode: str,
    fused: bool,
) -> None:
    masks = _row_masks(seqs, rows)
    sampling = {
        i: a.sampling(len(r)) for i, (a, r) in enumerate(zip(seqs, rows, strict=True)) if a.samples
    }
    # `decode_step` lists no alternatives.
    tops = any(a.req.top_logprobs for a in seqs)
    if fused and not sampling and not tops:
        _fused_step(model, seqs, rows, step_nd, mode, masks)
    else:
        _two_calls(model, seqs, rows, step_nd, mode, masks, sampling)


def _two_calls(
    model: ServingModel,
    seqs: list[ActiveSeq],
    rows: list[list[int]],
    step_nd: int,
    mode: str,
    masks: dict[int, bytes],
    sampling: dict[int, Sampling],
) -> None:
    ks = [len(r) for r in rows]
    handles = [a.live_handle for a in seqs]
    q = [a.pending_conf[: k - 1] for a, k in zip(seqs, ks, strict=True)]
    attrs: dict[str, AttributeValue] = {"met.verify.mode": mode, "met.verify.ks": ks}
    top = [a.req.top_logprobs for a in seqs]
    with span(TRACER, "verify", **attrs):
        verified = model.decode_verify_batched(
            [t for r in rows for t in r],
            ks,
            handles,
            masks=masks or None,
            sampling=sampling or None,
            top=top if any(top) else None,
        )
    na = []
    for i, (a, at) in enumerate(zip(seqs, itertools.pairwise(offsets(ks)), strict=True)):
        n, gained = _gained(a, rows[i], q[i], verified, at, i in sampling)
        a.pending_drafts, a.pending_conf = [], []
        a.record_verify(ks[i] - 1, n)
        a.gain(*gained)
        na.append(n)
    proposers = [i for i, a in enumerate(seqs) if _can_propose(a, ks[i] - na[i] - 1, step_nd)]
    attrs = {"met.accepted": na, "met.proposers": len(proposers)}
    with span(TRACER, "verdict", **attrs):
        proposal = model.settle_verdict(
            handles,
            [n + 1 for n in na],
            ks,
            proposers,
            [seqs[i].last_token for i in proposers],
            step_nd if proposers else 0,
            [seqs[i].sampling(step_nd) if seqs[i].samples else None for i in proposers],
            drafter_names([seqs[i] for i in proposers]),
        )
    _take_drafts(seqs, proposers, proposal, step_nd)


def _fused_step(
    model: ServingModel,
    seqs: list[ActiveSeq],
    rows: list[list[int]],
    step_nd: int,
    mode: str,
    masks: dict[int, bytes],
) -> None:
    ks = [len(r) for r in rows]
    want = [step_nd >= 1 and a.wants_drafts for a in seqs]
    attrs: dict[str, AttributeValue] = {
        "met.verify.mode": mode,
        "met.verify.ks": ks,
        "met.fused": True,
    }
    with span(TRACER, "verify", **attrs) as sp:
        result = model.decode_step(
            [t for r in rows for t in r],
            ks,
            [a.live_handle for a in seqs],
            want,
            step_nd,
            drafter_names(seqs),
            masks or None,
        )
        sp.set_attribute("met.accepted", result.accepted)
        sp.set_attribute("met.proposers", len(result.proposers))
    apply_step(seqs, rows, result, step_nd)


def drafter_names(seqs: list[ActiveSeq]) -> list[str]:
    """The service's drafter of each sequence's method this step, whatever it was allocated
    ("" for a method that drafts nothing: the call then asks it for none)."""
    return [a.method.drafter or "" for a in seqs]


def apply_step(
    seqs: list[ActiveSeq], rows: list[list[int]], result: StepResult, step_nd: int
) -> None:
    """A greedy step's result on its sequences: what each gains, its verify's statistics,
    and its next drafts."""
    off = offsets([len(r) for r in rows])
    for i, a in enumerate(seqs):
        na = result.accepted[i]
        a.pending_drafts, a.pending_conf = [], []
        a.record_verify(len(rows[i]) - 1, na)
        bonus = result.argmax[off[i] + na]
        a.gain([*rows[i][1 : na + 1], bonus], result.logprobs[off[i] : off[i] + na + 1])
    _take_drafts(seqs, result.proposers, result.proposal, step_nd)


def _take_drafts(
    seqs: list[ActiveSeq], proposers: list[int], proposal: Proposal, step_nd: int
) -> None:
    """The proposers' new drafts, cut to what each may still use (none for a sequence the
    verdict finished: the one-call step asks for drafts before it knows)."""
    for i, drafts, conf in zip(proposers, proposal.drafts, proposal.confidences, strict=True):
        a = seqs[i]
        if not a.wants_drafts:
            continue
        cap = min(
            step_nd, a.remaining - 1, a.req.num_drafts if a.req.num_drafts is not None else step_nd
        )
        a.pending_drafts, a.pending_conf = drafts[:cap], conf[:cap]
        a.drafted_by = a.method.name
        if a.draft_stop is not None:
            stop = next(
                (j for j, c in enumerate(a.pending_conf) if c <= 0 or math.log(c) < a.draft_stop),
                len(a.pending_conf),
            )
            del a.pending_drafts[stop:]
            del a.pending_conf[stop:]


# What a verdict gives a sequence: its tokens, each one's own log-probability, and each one's
# row's alternatives (ids, log-probabilities).
Gain = tuple[list[int], list[float], tuple[list[list[int]], list[list[float]]]]


def _gained(
    a: ActiveSeq, rows: list[int], q: list[float], v: Verified, at: tuple[int, int], samples: bool
) -> tuple[int, Gain]:
    """A sequence's verdict on its rows `at` (first, past the last) of the verify -> (drafts
    that stood, what it gains: the token after them is the argmax, or a draw for a sampling
    sequence; an accepted draft's log-probability is its row's, the argmax's or the next
    row's token's)."""
    lo, hi = at
    if samples:
        n, token, own = _rejection(a, rows, q, v.draws[lo:hi])
        logprobs = [*v.next_logprobs[lo : lo + n], own]
    else:
        n = accepted(rows, v.argmax[lo:hi])
        token, logprobs = v.argmax[lo + n], v.logprobs[lo : lo + n + 1]
    end = lo + n + 1
    return n, ([*rows[1 : n + 1], token], logprobs, (v.top_ids[lo:end], v.top_logprobs[lo:end]))


def _rejection(
    a: ActiveSeq, rows: list[int], q: list[float], draws: list[RowDraws | None]
) -> tuple[int, int, float]:
    """Speculative sampling's verdict: draft j + 1 stands with probability min(1, p / q);
    the first one that falls is replaced by a draw from the residual; with every draft
    standing, the bonus is a draw from the target. -> (accepted drafts, the token after, its
    log-probability)"""
    for j in range(len(rows) - 1):
        d = draws[j]
        assert d is not None, "a sampling sequence's row came back without its draws"
        # A q rounded to 0 on the wire is a draft the drafter could not have drawn: keep it.
        ratio = d.p_next / q[j] if q[j] > 0 else 1.0
        if a.rng.random() >= min(1.0, ratio):
            return j, d.resample, d.resample_logprob
    d = draws[-1]
    assert d is not None, "a sampling sequence's row came back without its draws"
    return len(rows) - 1, d.sample, d.sample_logprob


def _row_masks(seqs: list[ActiveSeq], rows: list[list[int]]) -> dict[int, bytes]:
    """Row -> allowed tokens (grammars, min_new_tokens): row j of a sequence predicts the
    token after its drafts 1..j."""
    masks, row = {}, 0
    for a, r in zip(seqs, rows, strict=True):
        for j in range(len(r)):
            bits = a.row_mask(r[1 : j + 1])
            if bits:
                masks[row + j] = bits
        row += len(r)
    return masks


def _can_propose(a: ActiveSeq, rejected: int, step_nd: int) -> bool:
    """Whether the sequence takes drafts after this verdict: it drafts, goes on, and its
    drafts fit the context once the rejected rows are rewound."""
    if step_nd < 1 or not a.wants_drafts:
        return False
    assert a.handle is not None
    return a.method.room(a.handle.seq_len - rejected, step_nd, a.facts)
