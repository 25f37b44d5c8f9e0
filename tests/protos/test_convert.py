"""protos/convert.py: every dataclass that crosses the wire comes back equal after a trip
through its serialized message. Float values are exact in float32 (0.5, 0.25, ...), because
temperature, top_p, confidences and logprobs travel as `float`."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from protos import convert as cv
from protos.handles import ImageInput, RowDraws, ScoreAsk, Scores
from protos.met.v1 import model_pb2 as pb
from protos.model import (
    Capabilities,
    CostEntry,
    InvalidArgument,
    Logits,
    Proposal,
    Sampling,
    SequenceHandle,
    StepResult,
)

CAPS = Capabilities(
    model_name="tiny",
    vocab_size=320,
    num_slots=4,
    free_slots=3,
    slot_verify_drafts=(3, 3, 2, 1),
    max_rows=24,
    forwards=("eager", "triton"),
    current_forward="eager",
    device="cpu",
    max_context=256,
    dtype="float32",
    hidden_size=64,
    eos_token_ids=(257, 258),
    has_mtp=True,
    max_batch=8,
    max_prefill_tokens=512,
    model_digest="0123456789abcdef",
    graphs=True,
)

SAME_NAMED = [
    CAPS,
    dataclasses.replace(
        CAPS, slot_verify_drafts=(), forwards=(), eos_token_ids=(), has_mtp=False, graphs=False
    ),
    SequenceHandle(seq_id=2**40, slot=3, seq_len=17),
    SequenceHandle(seq_id=0, slot=0),
    Sampling(0.5, top_k=40, top_p=0.75, uniforms=(0.1, 0.9, 1e-12)),
    Sampling(1.0),
    CostEntry(width=4, depth=0, verify_ms=1.25, propose_ms=0.0),
    Logits(data=b"\x00\x01\x02\x03" * 6, dtype="bfloat16", shape=(3, 4)),
    Logits(data=b"", dtype="float32", shape=(0, 320)),
]


def wire(msg: Any) -> Any:
    """The message as the other process parses it."""
    return type(msg).FromString(msg.SerializeToString())


@pytest.mark.parametrize("cls", list(cv.MESSAGES), ids=lambda c: c.__name__)
def test_same_named_fields(cls: type) -> None:
    ours = [f.name for f in dataclasses.fields(cls)]
    theirs = [f.name for f in cv.MESSAGES[cls].DESCRIPTOR.fields]
    assert sorted(ours) == sorted(theirs), f"{cls.__name__} and its message differ"


@pytest.mark.parametrize("obj", SAME_NAMED, ids=lambda o: type(o).__name__)
def test_same_named_round_trip(obj: Any) -> None:
    assert cv.from_pb(type(obj), wire(cv.to_pb(obj))) == obj


def test_from_pb_refuses_another_message() -> None:
    with pytest.raises(TypeError, match="CapabilitiesReply"):
        cv.from_pb(Capabilities, pb.SequenceHandle())


def test_sequences_by_id_and_length() -> None:
    seqs = [SequenceHandle(5, 1, 12), SequenceHandle(9, 0, 3)]
    request = wire(pb.FoldRequest(seq_ids=cv.seq_ids(seqs)))
    theirs = cv.handles(request.seq_ids)
    assert [s.seq_id for s in theirs] == [5, 9]
    for s, n in zip(theirs, (12, 3), strict=True):
        s.seq_len = n
    ours = [SequenceHandle(5, 1), SequenceHandle(9, 0)]
    cv.mirror_seq_lens(ours, wire(pb.CommitReply(seq_lens=cv.seq_lens(theirs))).seq_lens)
    assert ours == seqs


@pytest.mark.parametrize(
    "sampling",
    [[Sampling(0.5, 3, 0.5, (0.25,)), None, Sampling(2.0)], [None, None], []],
    ids=["mixed", "all-greedy", "none"],
)
def test_seq_sampling_round_trip(sampling: list[Sampling | None]) -> None:
    request = wire(pb.ProposeRequest(sampling=cv.seq_sampling_to_pb(enumerate(sampling))))
    assert cv.seq_sampling_from_pb(request.sampling, len(sampling)) == sampling


def test_seq_sampling_outside_the_request() -> None:
    items = cv.seq_sampling_to_pb([(2, Sampling(1.0))])
    with pytest.raises(InvalidArgument, match="sequence 2 of 2"):
        cv.seq_sampling_from_pb(items, 2)


@pytest.mark.parametrize("masks", [{0: b"\xff" * 4, 5: b"\x01\x00\x00\x00"}, {}])
def test_row_masks_round_trip(masks: dict[int, bytes]) -> None:
    request = wire(pb.VerifyRequest(masks=cv.row_masks_to_pb(masks)))
    assert cv.row_masks_from_pb(request.masks) == masks


def test_row_masks_twice_on_one_row() -> None:
    with pytest.raises(InvalidArgument, match="same row"):
        cv.row_masks_from_pb([pb.RowMask(row=1), pb.RowMask(row=1, bits=b"\x01")])


def test_prefill_round_trip() -> None:
    seqs = [SequenceHandle(1, 0), SequenceHandle(2, 1), SequenceHandle(3, 2)]
    prompts = [[1, 2, 3], [7], [0] * 5]
    masks = [b"", b"\x0f\x00\x00\x00", b""]
    sampling = [None, Sampling(0.5, uniforms=(0.5,)), Sampling(1.0, top_k=2)]
    scores = [ScoreAsk(3, 9), None, ScoreAsk(0)]
    tops = [0, 5, 20]
    image = ImageInput(b"\x00\x00\x80\x3f" * 6, (1, 2, 3), b"\x01" * 32)
    images = [[image, ImageInput(b"", (1, 2, 2))], [], [image]]
    sent = cv.prefill_to_pb(seqs, prompts, masks, sampling, scores, tops, images)
    got = cv.prefill_from_pb(wire(sent))
    assert got == (cv.handles([1, 2, 3]), prompts, masks, sampling, scores, tops, images)


def test_scores_round_trip() -> None:
    # Values a float holds exactly: the wire's logprobs are fp32.
    scores = [
        Scores([-0.5, -1.5], [[4, 5], [6, 7], [8, 9]], [[-0.25, -0.5], [-1, -2], [-4, -8]], [2, 1]),
        None,
        Scores([], [[]], [[]], []),  # one row, no alternatives, no next token
    ]
    assert (
        cv.scores_from_pb(wire(pb.PrefillReply(scores=cv.scores_to_pb(scores, 3))).scores) == scores
    )


@pytest.mark.parametrize(
    "ks, sampled",
    [([2, 1, 3], {0, 2}), ([2, 1, 3], set()), ([1, 1], {0, 1}), ([], set())],
    ids=["some", "greedy", "all", "no-rows"],
)
def test_draws_round_trip(ks: list[int], sampled: set[int]) -> None:
    draws: list[RowDraws | None] = []
    for i, k in enumerate(ks):
        draws += [
            RowDraws(0.25 * j, 10 + j, 20 + j, -0.5 * j, -0.25 * j) if i in sampled else None
            for j in range(k)
        ]
    reply = wire(pb.VerifyReply(argmax=[0] * len(draws), **cv.draws_to_pb(draws)))
    assert cv.draws_from_pb(reply, ks, sampled) == draws


@pytest.mark.parametrize(
    "ks, tops",
    [([2, 1, 3], [3, 0, 1]), ([2, 1], []), ([1, 1], [0, 0]), ([], [])],
    ids=["some", "none-asked", "zeros", "no-rows"],
)
def test_alternatives_round_trip(ks: list[int], tops: list[int]) -> None:
    """Each row's alternatives come back in rows of its sequence's count."""
    counts = cv.row_tops(ks, tops)
    ids = [[100 * r + j for j in range(n)] for r, n in enumerate(counts)]
    values = [[-0.5 - j for j in range(n)] for n in counts]
    reply = wire(pb.VerifyReply(**cv.tops_to_pb(ids, values)))
    assert cv.tops_from_pb(reply, counts) == (ids, values)
    if sum(counts):
        with pytest.raises(ValueError, match="alternative ids"):
            cv.tops_from_pb(reply, [n + 1 for n in counts])


PROPOSALS = {
    "two-by-three": Proposal([[1, 2, 3], [4, 5, 6]], [[0.5, 0.25, 1.0], [0.125, 0.5, 0.0]]),
    "no-drafts": Proposal([[], [], []], [[], [], []]),
    "no-sequences": Proposal([], []),
}


@pytest.mark.parametrize("proposal", PROPOSALS.values(), ids=PROPOSALS.keys())
def test_proposal_round_trip(proposal: Proposal) -> None:
    reply = wire(pb.ProposeReply(**cv.proposal_to_pb(proposal)))
    assert cv.proposal_from_pb(reply, len(proposal.drafts)) == proposal


@pytest.mark.parametrize(
    "proposal",
    [
        Proposal([[1, 2], [], [3, 4]], [[0.5, 0.5], [], [0.5, 0.5]]),
        Proposal([[1, 2]], [[0.5]]),
        Proposal([[1]], []),
    ],
    ids=["zero-among-two", "confidence-short", "confidences-missing"],
)
def test_ragged_proposal_is_refused(proposal: Proposal) -> None:
    with pytest.raises(ValueError, match=r"\[sequences, num_drafts\] block"):
        cv.proposal_to_pb(proposal)


def test_proposal_reply_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="3 sequences came with 4 drafts"):
        cv.proposal_from_pb(pb.ProposeReply(drafts=[1] * 4, confidences=[0.5] * 4), 3)


STEPS = {
    # Sequence 1 takes no drafts among the proposers 0 and 2.
    "a-gap": StepResult(
        argmax=[5, 6, 7, 8, 9],
        logprobs=[-0.5, -1.0, 0.0, -2.0, -0.25],
        accepted=[1, 0, 0],
        proposers=[0, 2],
        proposal=Proposal([[11, 12], [13, 14]], [[0.5, 0.5], [1.0, 0.25]]),
    ),
    "no-proposers": StepResult([5], [-0.5], [0], [], Proposal([], [])),
    "zero-drafts": StepResult([5, 6], [0.0, 0.0], [0, 0], [0, 1], Proposal([[], []], [[], []])),
}


@pytest.mark.parametrize("step", STEPS.values(), ids=STEPS.keys())
def test_step_round_trip(step: StepResult) -> None:
    lens = [10 + i for i in range(len(step.accepted))]
    reply = wire(cv.step_to_pb(step, lens))
    assert cv.step_from_pb(reply) == step
    assert list(reply.seq_lens) == lens


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("n", [0, 2])
def test_costs_round_trip(cached: bool, n: int) -> None:
    entries = [CostEntry(w, w - 1, 0.5 * w, 0.25 * w) for w in range(1, n + 1)]
    assert cv.costs_from_pb(wire(cv.costs_to_pb(entries, cached))) == (entries, cached)


def test_the_control_plane_side_stays_torch_free() -> None:
    probe = (
        "import sys, protos.convert, control_plane.replicas.client; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
