"""A mixed batch (`met circuit diff --verify-batch --mix`): one batched verify holding the rows
the scheduler sends side by side. Each sequence has a role, in turn:

- `none`: a one-row verify (its last token), no propose, as the `none` method decodes;
- `mtp`: drafts verified, then a propose with the MTP head;
- `masked`: as `mtp`, each row under an allowed-token mask, as a grammar's rows are;
- `dflash`: drafts verified, then a block propose with the DFlash drafter (only where the
  service has one).

A masked row allows the sequence's reference continuation token (so a run that stays on its
greedy path keeps it, and accepts as an unmasked one would) and a deterministic fifth of the
vocabulary; a row off that path (after a corrupted draft) mostly loses its unmasked argmax, so
the masks change argmaxes and the logits' `-inf` columns, and a forward that drops or moves a
mask shows in the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from control_plane.scheduler.verdict import offsets
from protos.model import DFLASH, MTP_HEAD

ONE_ROW, MTP, MASKED, BLOCK = "none", "mtp", "masked", "dflash"
# One masked row allows every token t with (t + salt) % MASK_STRIDE == 0, and its reference.
MASK_STRIDE = 5


def roles(n: int, dflash: bool) -> tuple[str, ...]:
    """The roles of `n` sequences, in turn; `dflash` only where the service has the drafter."""
    cycle = (ONE_ROW, MTP, MASKED, BLOCK) if dflash else (ONE_ROW, MTP, MASKED)
    return tuple(cycle[i % len(cycle)] for i in range(n))


def drafter_of(role: str) -> str:
    """The drafter a sequence of `role` is allocated with."""
    return DFLASH if role == BLOCK else MTP_HEAD


def widths(shape: Sequence[int], of: Sequence[str]) -> list[int]:
    """`shape` with every `none` sequence's verify one row."""
    return [1 if r == ONE_ROW else k for k, r in zip(shape, of, strict=True)]


def proposers(of: Sequence[str]) -> list[int]:
    """The sequences that propose after the verdict, in batch order."""
    return [i for i, r in enumerate(of) if r != ONE_ROW]


def allowed(vocab: int, keep: int, salt: int) -> bytes:
    """The bitmask (bit t of little-endian 32-bit words is token t) allowing `keep` and every
    token t with (t + salt) % MASK_STRIDE == 0."""
    bits = bytearray(4 * -(-vocab // 32))
    for t in [*range(-salt % MASK_STRIDE, vocab, MASK_STRIDE), keep]:
        bits[t // 8] |= 1 << (t % 8)
    return bytes(bits)


def row_masks(
    of: Sequence[str],
    ks: Sequence[int],
    greedy: Sequence[Sequence[int]],
    pos: Sequence[int],
    step: int,
    vocab: int,
) -> dict[int, bytes]:
    """Row -> allowed tokens for every row of the masked sequences at `step`: row j of
    sequence i predicts the token after position `pos[i] + j` of its greedy continuation,
    which its mask allows."""
    out = {}
    for i, (role, k, row) in enumerate(zip(of, ks, offsets(list(ks))[:-1], strict=True)):
        if role != MASKED:
            continue
        for j in range(k):
            out[row + j] = allowed(vocab, greedy[i][pos[i] + j + 1], 3 * step + 7 * i + j)
    return out
