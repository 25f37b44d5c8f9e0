"""Bad input gets the right status and a sentence; other sequences are left untouched.
Every case runs in process and over a real socket."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from protos.model import (
    CircuitModel,
    FailedPrecondition,
    InvalidArgument,
    ModelError,
    NotFound,
    ResourceExhausted,
    SequenceHandle,
)
from tests.steps import decode

PROMPT = [5, 17, 99, 3, 250, 42, 7]
Case = Callable[[CircuitModel, SequenceHandle, SequenceHandle], object]


def _exhaust(model: CircuitModel, b: SequenceHandle, v: SequenceHandle) -> None:
    taken = []
    try:
        for _ in range(model.capabilities().free_slots):
            taken.append(model.alloc_sequence())
        model.alloc_sequence()
    finally:
        for s in taken:
            model.free_sequence(s)


def _freed(model: CircuitModel, b: SequenceHandle, v: SequenceHandle) -> None:
    model.free_sequence(v)
    model.decode_verify_batched([1, 2], [1, 1], [b, v])


def _fold_outside(model: CircuitModel, b: SequenceHandle, v: SequenceHandle) -> None:
    model.decode_verify_batched([1, 2], [2], [v])
    try:
        model.gdn_fold_accepted([v], [3])
    finally:
        model.gdn_fold_accepted([v], [1])
        model.commit_accepted_prefix([v], [1], [2])


CASES: dict[str, tuple[type[ModelError], Case]] = {
    "verify-token-outside-vocab": (
        InvalidArgument,
        lambda m, b, v: m.decode_verify_batched([1, 100000], [1, 1], [b, v]),
    ),
    "prefill-token-outside-vocab": (InvalidArgument, lambda m, b, v: m.prefill([v], [[1, 320]])),
    "propose-token-outside-vocab": (
        InvalidArgument,
        lambda m, b, v: m.run_mtp_propose_batched([999], [0], 2, [v]),
    ),
    "k-zero": (InvalidArgument, lambda m, b, v: m.decode_verify_batched([1], [1, 0], [b, v])),
    "k-over-capacity": (
        InvalidArgument,
        lambda m, b, v: m.decode_verify_batched([1] * 6, [1, 5], [b, v]),
    ),
    "tokens-ks-mismatch": (
        InvalidArgument,
        lambda m, b, v: m.decode_verify_batched([1, 2, 3], [1, 1], [b, v]),
    ),
    "ks-seqs-mismatch": (
        InvalidArgument,
        lambda m, b, v: m.decode_verify_batched([1, 2], [1, 1], [b]),
    ),
    "same-sequence-twice": (
        InvalidArgument,
        lambda m, b, v: m.decode_verify_batched([1, 2], [1, 1], [v, v]),
    ),
    "unknown-sequence": (
        NotFound,
        lambda m, b, v: m.decode_verify_batched([1], [1], [SequenceHandle(10**9, 0)]),
    ),
    "freed-sequence": (NotFound, _freed),
    "free-twice": (NotFound, lambda m, b, v: (m.free_sequence(v), m.free_sequence(v))),
    "no-free-slot": (ResourceExhausted, _exhaust),
    "empty-prompt": (InvalidArgument, lambda m, b, v: m.prefill([b, v], [[1], []])),
    "prompt-past-context": (InvalidArgument, lambda m, b, v: m.prefill([v], [[1] * 300])),
    "fold-row-outside-verify": (InvalidArgument, _fold_outside),
    "fold-without-verify": (FailedPrecondition, lambda m, b, v: m.gdn_fold_accepted([v], [1])),
    "commit-without-verify": (
        FailedPrecondition,
        lambda m, b, v: m.commit_accepted_prefix([v], [1], [1]),
    ),
    "commit-before-fold": (
        FailedPrecondition,
        lambda m, b, v: (
            m.decode_verify_batched([1], [1], [v]),
            m.commit_accepted_prefix([v], [1], [1]),
        ),
    ),
    "unknown-forward": (InvalidArgument, lambda m, b, v: m.set_forward("cuda-graphs")),
    "stash-row-outside-verify": (
        InvalidArgument,
        lambda m, b, v: (
            m.decode_verify_batched([1], [1], [v]),
            m.stash_verify_hidden_rows([0, 1]),
        ),
    ),
}


@pytest.fixture(params=["in-process", "grpc"])
def model(request: pytest.FixtureRequest) -> CircuitModel:
    return request.getfixturevalue("engine" if request.param == "in-process" else "client")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_and_harmless(model: CircuitModel, case: str) -> None:
    error, call = CASES[case]
    bystander, control, victim = (model.alloc_sequence() for _ in range(3))
    model.prefill([bystander, control, victim], [PROMPT, PROMPT, PROMPT])
    with pytest.raises(error) as caught:
        call(model, bystander, victim)
    message = str(caught.value)
    assert len(message.split()) >= 4, f"not a sentence: {message!r}"
    assert bystander.seq_len == control.seq_len == len(PROMPT)
    assert decode(model, bystander, 11) == decode(model, control, 11)
    for s in (bystander, control, victim):
        try:
            model.free_sequence(s)
        except NotFound:
            pass
    assert model.capabilities().free_slots == model.capabilities().num_slots
