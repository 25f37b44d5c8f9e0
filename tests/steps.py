"""Scripted `CircuitModel` calls shared by the tests: one decode, one verify with its verdict."""

from __future__ import annotations

from protos.model import CircuitModel, SequenceHandle


def logit_rows(model: CircuitModel) -> list[bytes]:
    """The logits buffer split into one bytes object per row."""
    lg = model.read_logits()
    width = len(lg.data) // lg.shape[0]
    return [lg.data[i * width : (i + 1) * width] for i in range(lg.shape[0])]


def verdict(
    model: CircuitModel, seqs: list[SequenceHandle], ks: list[int], kept: list[int]
) -> None:
    model.gdn_fold_accepted(seqs, kept)
    model.commit_accepted_prefix(seqs, kept, ks)


def decode(model: CircuitModel, seq: SequenceHandle, token: int) -> tuple[int, bytes]:
    """A plain decode: a verify with k = 1, kept. Returns its argmax and logits row."""
    out = model.decode_verify_batched([token], [1], [seq]).argmax[0]
    row = logit_rows(model)[0]
    verdict(model, [seq], [1], [1])
    return out, row


def verify(
    model: CircuitModel,
    seqs: list[SequenceHandle],
    rows: list[list[int]],
    kept: list[int],
    write_on_accept: bool = True,
) -> tuple[list[int], list[bytes]]:
    """One batched verify of each sequence's rows, keeping `kept[i]` rows of sequence i."""
    ks = [len(r) for r in rows]
    out = model.decode_verify_batched(
        [t for r in rows for t in r], ks, seqs, write_on_accept
    ).argmax
    logits = logit_rows(model)
    verdict(model, seqs, ks, kept)
    return out, logits
