"""The diff's inputs: batch shapes, slots and their caps, prompts, greedy continuations and
the drafts taken from them."""

from __future__ import annotations

from collections.abc import Sequence

from protos.handles import ImageInput
from protos.model import CircuitModel, SequenceHandle


def batch_shapes(n: int, ks: list[int]) -> list[list[int]]:
    """Every width in `ks` uniform over `n` sequences, deepest first; then, with several widths
    and `n` at least their count, one ragged mix splitting `n` as evenly as possible, deepest
    first (the order `verify_batch_permutation` gives a ragged batch)."""
    widths = sorted(set(ks), reverse=True)
    out = [[k] * n for k in widths]
    if len(widths) > 1 and n >= len(widths):
        per, extra = divmod(n, len(widths))
        out.append([k for i, k in enumerate(widths) for _ in range(per + (i < extra))])
    return out


def slot_of(i: int, n: int, fragment: bool) -> int:
    """The slot sequence `i` of `n` takes: slots are handed out from 0, and `fragment` holds
    a spare one before sequence `n / 2`."""
    return i + int(fragment and i >= n // 2)


def slot_caps(
    slot_verify_drafts: tuple[int, ...], n: int, fragment: bool, num_drafts: int
) -> list[int]:
    """Each of `n` sequences' widest verify: the drafts its slot can verify, clamped to
    `num_drafts` as the scheduler clamps a step's drafts, plus the row of its last token."""
    return [min(slot_verify_drafts[slot_of(i, n, fragment)], num_drafts) + 1 for i in range(n)]


def capped(shape: list[int], cap: list[int]) -> list[int]:
    """Each sequence's width capped at `cap[i]` (from `slot_caps`)."""
    return [min(k, c) for k, c in zip(shape, cap, strict=True)]


def dedup(shapes: list[list[int]]) -> list[list[int]]:
    """Adjacent duplicates dropped (capping can make neighbours equal)."""
    return [s for i, s in enumerate(shapes) if i == 0 or s != shapes[i - 1]]


def batch_prompts(n: int, vocab: int, length: int = 12, long: int = 0) -> list[list[int]]:
    """`n` distinct prompts drawn deterministically from the vocabulary (no randomness: the
    same on every run and machine); with `long`, the first is `long` tokens and the others
    half that, so that each shares its batches with a sequence whose keys reach blocks past
    its own."""
    if long:
        length = long // 2
    return [
        [(7919 * (i + 1) + 104729 * j * (j + i + 3)) % vocab for j in range(n_tokens)]
        for i in range(n)
        for n_tokens in [long if i == 0 and long else length + i]
    ]


def corrupted_draft(step: int, seq: int, k: int) -> int | None:
    """Which draft of sequence `seq` at `step` is corrupted: none when `step + seq` is even
    or there are no drafts; else draft `((step + seq) // 2) % (k - 1)`, so the first rejection
    moves across positions from step to step."""
    if (step + seq) % 2 == 0 or k < 2:
        return None
    return ((step + seq) // 2) % (k - 1)


def drafts(greedy: list[int], pos: int, step: int, seq: int, k: int, vocab: int) -> list[int]:
    """The `k - 1` drafts after position `pos` of the greedy continuation, one of them
    replaced by `(t + 1) % vocab` as `corrupted_draft` says."""
    out = list(greedy[pos + 1 : pos + k])
    bad = corrupted_draft(step, seq, k)
    if bad is not None:
        out[bad] = (out[bad] + 1) % vocab
    return out


def continuation(
    model: CircuitModel, prompt: list[int], length: int, images: Sequence[ImageInput] = ()
) -> list[int]:
    """The greedy continuation of `prompt` (with its `images`), `length` tokens, one-token
    decodes."""
    seq = model.alloc_sequence()
    try:
        out = [prefill_one(model, seq, prompt, list(images))]
        while len(out) < length:
            out.append(model.decode_verify_batched([out[-1]], [1], [seq]).argmax[0])
            model.settle_verdict([seq], [1], [1], [], [], 0)
        return out
    finally:
        model.free_sequence(seq)


def snapshot_prefix(prompt: list[int], block: int) -> int:
    """The prefix a snapshot case restores: the prompt's whole blocks, leaving a token."""
    return (len(prompt) - 1) // block * block


def prefill_one(
    model: CircuitModel, seq: SequenceHandle, tokens: list[int], images: list[ImageInput]
) -> int:
    """`tokens` prefilled into `seq` with the images they start -> the argmax."""
    if images:
        return model.prefill([seq], [tokens], images=[images]).argmax[0]
    return model.prefill([seq], [tokens]).argmax[0]
