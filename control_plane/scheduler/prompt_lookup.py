"""Prompt lookup: drafts copied from the sequence's own history.

The last `n` tokens of the history (prompt, then generated, ending with the token about to be
verified) are looked up at their most recent earlier occurrence, for `n` in `NGRAM_SIZES`,
longest first; the tokens that followed it are the copy, at most `max_len` of them (1..3,
within the slot's capacity). A copy replaces the MTP chain for one step: it stays out of
D-Cut, joins the batch at its own depth, picks its serial arm by its own length, and the
propose after its verdict still uses the step's width. `prompt_lookup` requests draft only
copies and decode plainly when none matches.
"""

from __future__ import annotations

from control_plane.scheduler.seq import ActiveSeq

NGRAM_SIZES = (3, 2)
MAX_COPY = 3


def find_copy(history: list[int], max_len: int) -> list[int]:
    for n in NGRAM_SIZES:
        if len(history) <= n:
            continue
        key = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == key:
                return history[start + n : start + n + max_len]
    return []


def offer_copy(a: ActiveSeq, capacity: int) -> bool:
    """Give the sequence a copy as its drafts for this step, when its history repeats."""
    room = min(MAX_COPY, capacity, a.remaining - 1)
    # Copies are point masses, which the service's residuals do not model: greedy only.
    if room < 1 or a.grammar is not None or a.samples:
        return False
    copy = find_copy([*a.req.prompt_ids, *a.generated], room)
    if not copy:
        return False
    a.pending_drafts, a.pending_conf, a.copy = copy, [1.0] * len(copy), len(copy)
    return True


def settle_copies(active: list[ActiveSeq]) -> None:
    for a in active:
        a.copy = 0
