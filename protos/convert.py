"""Conversions between the `met.v1` messages and the `Model` dataclasses (protos/model.py): the
one place a message's layout is spelled out; the servicer and the client both call it.

A dataclass whose fields are its message's fields by name (`MESSAGES`) converts generically,
so its field list lives only in the dataclass. The layouts that differ from their dataclass
(flat draft blocks, parallel per-row lists, indexed per-sequence sampling) are written out
below, each as a `*_to_pb` / `*_from_pb` pair. Nothing here imports torch: the control plane
imports this module."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from dataclasses import fields
from typing import Any, TypeVar

from google.protobuf.message import Message

from protos.handles import ImageInput, RowDraws, ScoreAsk, Scores
from protos.met.v1 import model_pb2 as pb
from protos.model import (
    Capabilities,
    CostEntry,
    InvalidArgument,
    Logits,
    Penalties,
    Proposal,
    Sampling,
    SequenceHandle,
    StepResult,
)
from protos.steps import PlanResult, StepPlan

T = TypeVar("T")

# Each dataclass and the message that carries it field for field, under the same names.
MESSAGES: dict[type, type[Message]] = {
    Capabilities: pb.CapabilitiesReply,
    SequenceHandle: pb.SequenceHandle,
    Sampling: pb.SamplingParams,
    Penalties: pb.Penalties,
    CostEntry: pb.CostEntry,
    Logits: pb.ReadLogitsReply,
    ImageInput: pb.ImageInput,
}


def to_pb(obj: Any) -> Any:
    """A dataclass of `MESSAGES` as its message."""
    message = MESSAGES[type(obj)]
    return message(**{f.name: getattr(obj, f.name) for f in fields(obj)})


def from_pb(cls: type[T], msg: Message) -> T:
    """`to_pb` backwards; repeated fields come back as tuples, as these dataclasses hold them."""
    if not isinstance(msg, MESSAGES[cls]):
        raise TypeError(f"{cls.__name__} comes from {MESSAGES[cls].__name__}, not {type(msg)}")
    repeated = {f.name for f in msg.DESCRIPTOR.fields if f.is_repeated}
    values = {f.name: getattr(msg, f.name) for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: tuple(v) if k in repeated else v for k, v in values.items()})


# -- sequences: a request names them by id, a reply gives their new lengths -----------------


def seq_ids(seqs: Iterable[SequenceHandle]) -> list[int]:
    return [s.seq_id for s in seqs]


def handles(ids: Iterable[int]) -> list[SequenceHandle]:
    """The service's handles for a request's ids: the engine knows each slot and length, the
    wire carries only the id (slot -1 until the engine looks it up)."""
    return [SequenceHandle(int(i), -1) for i in ids]


def seq_lens(seqs: Iterable[SequenceHandle]) -> list[int]:
    return [s.seq_len for s in seqs]


def mirror_seq_lens(seqs: Sequence[SequenceHandle], lens: Sequence[int]) -> None:
    """`seq_lens` backwards: the caller's handles take the lengths the reply gives."""
    for s, n in zip(seqs, lens, strict=True):
        s.seq_len = n


# -- sampling and masks -------------------------------------------------------------------


def seq_sampling_to_pb(sampling: Iterable[tuple[int, Sampling | None]]) -> list[pb.SeqSampling]:
    """(sequence index, sampling) pairs; greedy sequences (None) are left out."""
    return [pb.SeqSampling(index=i, params=to_pb(s)) for i, s in sampling if s is not None]


def seq_sampling_from_pb(items: Iterable[pb.SeqSampling], n: int) -> list[Sampling | None]:
    """One entry per sequence of `n`, None for those the request leaves greedy."""
    out: list[Sampling | None] = [None] * n
    for item in items:
        if item.index >= n:
            raise InvalidArgument(f"sampling names sequence {item.index} of {n}")
        out[item.index] = from_pb(Sampling, item.params)
    return out


def penalties_from_pb(request: pb.AllocSequenceRequest) -> Penalties | None:
    """The request's penalties, None when unset; a repetition left at 0 is 1 (none)."""
    if not request.HasField("penalties"):
        return None
    p = from_pb(Penalties, request.penalties)
    return p if p.repetition else dataclasses.replace(p, repetition=1.0)


def row_masks_to_pb(masks: dict[int, bytes]) -> list[pb.RowMask]:
    return [pb.RowMask(row=r, bits=b) for r, b in masks.items()]


def row_masks_from_pb(items: Sequence[pb.RowMask]) -> dict[int, bytes]:
    masks = {m.row: m.bits for m in items}
    if len(masks) != len(items):
        raise InvalidArgument("two masks name the same row")
    return masks


def prefill_to_pb(
    seqs: Sequence[SequenceHandle],
    prompts: Sequence[Sequence[int]],
    masks: Sequence[bytes],
    sampling: Sequence[Sampling | None],
    scores: Sequence[ScoreAsk | None],
    tops: Sequence[int],
    images: Sequence[Sequence[ImageInput]],
) -> pb.PrefillRequest:
    """One item per sequence; an empty mask, an unset `sampling` or `score`, a `top` of 0
    and no images mean none."""
    rows = zip(seqs, prompts, masks, sampling, scores, tops, images, strict=True)
    items = [
        pb.PrefillItem(
            seq_id=s.seq_id,
            tokens=p,
            mask=m,
            sampling=to_pb(smp) if smp is not None else None,
            score=None if ask is None else pb.ScoreAsk(top=ask.top, next_token=ask.next_token),
            top=top,
            images=[to_pb(i) for i in imgs],
        )
        for s, p, m, smp, ask, top, imgs in rows
    ]
    return pb.PrefillRequest(items=items)


def prefill_from_pb(
    request: pb.PrefillRequest,
) -> tuple[
    list[SequenceHandle],
    list[list[int]],
    list[bytes],
    list[Sampling | None],
    list[ScoreAsk | None],
    list[int],
    list[list[ImageInput]],
]:
    """`prefill_to_pb` backwards: (handles, prompts, masks, sampling, scores, tops, images)."""
    items = request.items
    sampling = [from_pb(Sampling, i.sampling) if i.HasField("sampling") else None for i in items]
    scores = [_score_ask(i.score) if i.HasField("score") else None for i in items]
    prompts = [list(i.tokens) for i in items]
    masks = [i.mask for i in items]
    tops = [i.top for i in items]
    images = [[from_pb(ImageInput, m) for m in i.images] for i in items]
    return handles(i.seq_id for i in items), prompts, masks, sampling, scores, tops, images


def _score_ask(m: pb.ScoreAsk) -> ScoreAsk:
    return ScoreAsk(m.top, m.next_token if m.HasField("next_token") else None)


def scores_fields(s: Any) -> dict[str, Any]:
    """A prompt's scores (`Scores`, or anything with its fields) as the wire's fields, the
    alternatives flattened row by row: `Scores` here, the API's `PromptLogprobs`."""
    return {
        "logprobs": s.logprobs,
        "ranks": s.ranks,
        "top": len(s.top_ids[0]) if s.top_ids else 0,
        "top_ids": [t for row in s.top_ids for t in row],
        "top_logprobs": [v for row in s.top_logprobs for v in row],
    }


def scores_to_pb(scores: Sequence[Scores | None], n: int) -> list[pb.Scores]:
    """A prefill's scores, one message per item (`asked` false where none was asked)."""
    return [
        pb.Scores() if s is None else pb.Scores(asked=True, rows=len(s.top_ids), **scores_fields(s))
        for s in list(scores) or [None] * n
    ]


def scores_from_pb(replies: Sequence[pb.Scores]) -> list[Scores | None]:
    out: list[Scores | None] = []
    for r in replies:
        if not r.asked:
            out.append(None)
            continue
        ids, values, k = list(r.top_ids), list(r.top_logprobs), r.top
        out.append(
            Scores(
                list(r.logprobs),
                [ids[j * k : (j + 1) * k] for j in range(r.rows)],
                [values[j * k : (j + 1) * k] for j in range(r.rows)],
                list(r.ranks),
            )
        )
    return out


# -- per-row draws: three parallel lists, zeros on the rows of greedy sequences ------------


def draws_to_pb(draws: Sequence[RowDraws | None]) -> dict[str, list]:
    """`VerifyReply`'s draw fields, as keywords."""
    return {
        "p_next": [d.p_next if d else 0.0 for d in draws],
        "resample": [d.resample if d else 0 for d in draws],
        "sample": [d.sample if d else 0 for d in draws],
        "resample_logprobs": [d.resample_logprob if d else 0.0 for d in draws],
        "sample_logprobs": [d.sample_logprob if d else 0.0 for d in draws],
    }


def draws_from_pb(
    reply: pb.VerifyReply, ks: Sequence[int], sampled: Collection[int]
) -> list[RowDraws | None]:
    """The wire does not mark which rows sampled; the caller knows: the rows of the sequences
    in `sampled` (indexes into `ks`, the rows per sequence)."""
    rows: set[int] = set()
    off = 0
    for i, k in enumerate(ks):
        if i in sampled:
            rows.update(range(off, off + k))
        off += k
    return [
        RowDraws(
            reply.p_next[r],
            reply.resample[r],
            reply.sample[r],
            reply.resample_logprobs[r],
            reply.sample_logprobs[r],
        )
        if r in rows
        else None
        for r in range(len(reply.argmax))
    ]


# -- alternatives: per row a count of its own, flattened row by row ------------------------


def row_tops(ks: Sequence[int], tops: Sequence[int]) -> list[int]:
    """Each row's count of alternatives from its sequence's (`tops` empty: none asked)."""
    if not tops:
        return [0] * sum(ks)
    return [t for k, t in zip(ks, tops, strict=True) for _ in range(k)]


def tops_to_pb(ids: Sequence[Sequence[int]], values: Sequence[Sequence[float]]) -> dict[str, list]:
    """Rows of alternatives as a reply's flat `top_ids` and `top_logprobs`, as keywords."""
    return {
        "top_ids": [t for row in ids for t in row],
        "top_logprobs": [v for row in values for v in row],
    }


def tops_from_pb(reply: Any, counts: Sequence[int]) -> tuple[list[list[int]], list[list[float]]]:
    """`tops_to_pb` backwards, row j holding `counts[j]` alternatives (the caller's asks)."""
    ids, values = list(reply.top_ids), list(reply.top_logprobs)
    if len(ids) != sum(counts) or len(values) != len(ids):
        raise ValueError(
            f"a reply came with {len(ids)} alternative ids and {len(values)} log-probabilities "
            f"for the {sum(counts)} asked"
        )
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    rows = list(zip(starts, starts[1:], strict=False))
    return [ids[a:b] for a, b in rows], [values[a:b] for a, b in rows]


# -- proposals: row-major [sequences, num_drafts] blocks ----------------------------------


def proposal_to_pb(p: Proposal) -> dict[str, list]:
    """The drafts and confidences fields of `ProposeReply`, `VerdictReply` and `StepReply`, as
    keywords. The wire has no per-row counts, so every row must hold the same number."""
    widths = {len(r) for r in p.drafts} | {len(r) for r in p.confidences}
    if len(widths) > 1 or len(p.drafts) != len(p.confidences):
        raise ValueError(
            "a proposal crosses the wire as one [sequences, num_drafts] block; this one has "
            f"draft rows of {[len(r) for r in p.drafts]} and confidence rows of "
            f"{[len(r) for r in p.confidences]}"
        )
    return {
        "drafts": [t for row in p.drafts for t in row],
        "confidences": [c for row in p.confidences for c in row],
    }


def proposal_from_pb(reply: Any, n: int) -> Proposal:
    """`proposal_to_pb` backwards for `n` sequences (num_drafts is the block's width)."""
    flat_drafts, flat_confs = list(reply.drafts), list(reply.confidences)
    nd = len(flat_drafts) // n if n else 0
    if len(flat_drafts) != n * nd or len(flat_confs) != len(flat_drafts):
        raise ValueError(
            f"a proposal for {n} sequences came with {len(flat_drafts)} drafts and "
            f"{len(flat_confs)} confidences; expected {n} equal rows of each"
        )
    return Proposal(
        [flat_drafts[i * nd : (i + 1) * nd] for i in range(n)],
        [flat_confs[i * nd : (i + 1) * nd] for i in range(n)],
    )


def step_to_pb(r: StepResult, lens: Sequence[int]) -> pb.StepReply:
    """`lens`: each sequence's length after the commit (the reply's `seq_lens`)."""
    return pb.StepReply(
        argmax=r.argmax,
        logprobs=r.logprobs,
        accepted=r.accepted,
        seq_lens=lens,
        proposers=r.proposers,
        **proposal_to_pb(r.proposal),
    )


def step_from_pb(reply: pb.StepReply) -> StepResult:
    """`step_to_pb` backwards; the lengths stay in `reply.seq_lens` for `mirror_seq_lens`."""
    return StepResult(
        list(reply.argmax),
        list(reply.logprobs),
        list(reply.accepted),
        list(reply.proposers),
        proposal_from_pb(reply, len(reply.proposers)),
    )


# -- step streams: a plan names its sequences by id; a result carries the lengths of those
# that ran -----------------------------------------------------------------------------


def plan_to_pb(plan: StepPlan) -> pb.StepPlan:
    return pb.StepPlan(
        seq_ids=seq_ids(plan.seqs),
        continues=plan.continues,
        tokens=plan.tokens,
        ks=plan.ks,
        want_drafts=plan.want_drafts,
        num_drafts=plan.num_drafts,
        trace=plan.trace,
        repeat=plan.repeat,
        then_trace=[pb.TraceContext(fields=t) for t in plan.then_trace],
        drafters=plan.drafters,
    )


def plan_from_pb(msg: pb.StepPlan) -> StepPlan:
    """`plan_to_pb` backwards, with the service's handles (`handles`)."""
    return StepPlan(
        handles(msg.seq_ids),
        list(msg.continues),
        list(msg.tokens),
        list(msg.ks),
        list(msg.want_drafts),
        msg.num_drafts,
        dict(msg.trace),
        max(1, msg.repeat),
        [dict(t.fields) for t in msg.then_trace],
        list(msg.drafters),
    )


def plan_result_to_pb(r: PlanResult, lens: Sequence[int]) -> pb.PlanResult:
    """`lens`: the length of each sequence that ran after its commit, in `r.ran` order."""
    return pb.PlanResult(
        step=step_to_pb(r.step, lens),
        ran=r.ran,
        rows=r.rows,
        ks=r.ks,
        refused=[pb.PlanRefusal(index=i, code=c, message=m) for i, c, m in r.refused],
        waited_s=r.waited_s,
    )


def plan_results_to_pb(steps: Sequence[pb.PlanResult]) -> pb.PlanResult:
    """The results of one plan's steps as one message: the first, the later ones in `then`."""
    first = steps[0]
    first.then.extend(steps[1:])
    return first


def plan_results_from_pb(msg: pb.PlanResult) -> list[pb.PlanResult]:
    """`plan_results_to_pb` backwards: each step's message, in order."""
    return [msg, *msg.then]


def plan_result_from_pb(msg: pb.PlanResult) -> PlanResult:
    """`plan_result_to_pb` backwards; the lengths stay in `msg.step.seq_lens`, for
    `mirror_seq_lens` on the plan's sequences that ran."""
    return PlanResult(
        step_from_pb(msg.step),
        list(msg.ran),
        list(msg.rows),
        list(msg.ks),
        [(r.index, r.code, r.message) for r in msg.refused],
        msg.waited_s,
    )


# -- costs --------------------------------------------------------------------------------


def costs_to_pb(entries: Iterable[CostEntry], cached: bool) -> pb.CostReply:
    return pb.CostReply(entries=[to_pb(e) for e in entries], cached=cached)


def costs_from_pb(reply: pb.CostReply) -> tuple[list[CostEntry], bool]:
    """-> (entries, whether they came from the service's cache)"""
    return [from_pb(CostEntry, e) for e in reply.entries], reply.cached
