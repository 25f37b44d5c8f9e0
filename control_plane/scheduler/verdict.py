"""After a verify: how many drafts stand, and the calls that make it so (stash, fold, commit),
then the next drafts (batched propose, trim). Shared by every verify path."""

from __future__ import annotations

from control_plane.scheduler.seq import ActiveSeq
from gpu_service.interface import Model


def accepted(rows: list[int], argmax: list[int]) -> int:
    """rows = [last, d1 .. d_{k-1}]: draft j + 1 stands while it equals the argmax of row j."""
    n = 0
    while n + 1 < len(rows) and rows[n + 1] == argmax[n]:
        n += 1
    return n


def offsets(ks: list[int]) -> list[int]:
    """Each sequence's first row, then the total."""
    out = [0]
    for k in ks:
        out.append(out[-1] + k)
    return out


def verify_and_settle(
    model: Model, seqs: list[ActiveSeq], rows: list[list[int]], step_nd: int
) -> None:
    """One verify call over `rows[i]` of `seqs[i]`, its verdict, and the next drafts."""
    ks = [len(r) for r in rows]
    handles = [a.handle for a in seqs]
    argmax = model.decode_verify_batched([t for r in rows for t in r], ks, handles)
    logprobs = model.last_logprobs()
    off = offsets(ks)
    na = [accepted(r, argmax[off[i] : off[i + 1]]) for i, r in enumerate(rows)]
    # Stash slot j holds the last accepted row of candidate j.
    candidates = [i for i, a in enumerate(seqs) if _can_propose(a, na[i], ks[i], step_nd)]
    if candidates:
        model.stash_verify_hidden_rows([off[i] + na[i] for i in candidates])
    model.gdn_fold_accepted(handles, [n + 1 for n in na])
    model.commit_accepted_prefix(handles, [n + 1 for n in na], ks)
    for i, a in enumerate(seqs):
        a.pending_drafts, a.pending_conf = [], []
        a.stats.record(ks[i] - 1, na[i])
        a.gain(
            [*rows[i][1 : na[i] + 1], argmax[off[i] + na[i]]], logprobs[off[i] : off[i] + na[i] + 1]
        )
    still = [(j, seqs[i]) for j, i in enumerate(candidates) if seqs[i].wants_drafts]
    if still:
        propose(model, [a for _, a in still], step_nd, [j for j, _ in still])


def _can_propose(a: ActiveSeq, na: int, k: int, step_nd: int) -> bool:
    """Whether the sequence may take drafts after this verdict, judged before its new tokens
    are known (one that then stops is left out of the propose)."""
    if step_nd < 1 or not a.wants_drafts:
        return False
    assert a.handle is not None
    seq_len = a.handle.seq_len - (k - na - 1)
    return seq_len - 1 + step_nd <= a.max_context


def propose(model: Model, seqs: list[ActiveSeq], nd: int, stash: list[int]) -> None:
    """The next drafts of every sequence in one call, then the drafter trimmed back to what
    the target's hiddens justify."""
    handles = [a.handle for a in seqs]
    p = model.run_mtp_propose_batched([a.last for a in seqs], stash, nd, handles)
    model.trim_proposer_state(handles)
    for a, drafts, conf in zip(seqs, p.drafts, p.confidences, strict=True):
        cap = min(nd, a.remaining - 1, a.req.num_drafts if a.req.num_drafts is not None else nd)
        a.pending_drafts, a.pending_conf = drafts[:cap], conf[:cap]
