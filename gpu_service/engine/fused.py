"""The fused verdicts: `settle_verdict` (stash, fold, commit, propose, trim in one call) and
`decode_step` (a greedy step: verify, the greedy verdict, settle), composed from the verifier
and the drafters (`drafters.py`), each sequence's chosen per call. `decode_step` keeps
everything on the device between its parts and brings its results back in one transfer; a
drafter that lays its rows out on the host (a DFlash block) proposes after that transfer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_service.engine.drafters import Drafter, Drafters, StepDrafts, StepView, groups
from gpu_service.engine.sampling import check_sampling
from gpu_service.engine.verifier import Verifier, check_pending
from gpu_service.memory.sequence import VERIFIED, SeqState
from gpu_service.memory.slots import mirror
from gpu_service.model.backend import download, ints, upload
from gpu_service.model.config import ServiceConfig
from protos import checks
from protos.model import (
    FailedPrecondition,
    Proposal,
    Sampling,
    SequenceHandle,
    StepResult,
)
from protos.telemetry import span, traced, tracer

_TRACER = tracer("met.engine")


class Steps:
    def __init__(self, svc: ServiceConfig, verifier: Verifier, drafters: Drafters) -> None:
        self.svc, self.verifier, self.drafters = svc, verifier, drafters

    @traced("engine.verdict")
    def settle_verdict(
        self,
        seqs: Sequence[SequenceHandle],
        kept_rows: Sequence[int],
        ks: Sequence[int],
        proposers: Sequence[int],
        last: Sequence[int],
        num_drafts: int,
        sampling: Sequence[Sampling | None] | None = None,
        drafters: Sequence[str] = (),
    ) -> Proposal:
        v = self.verifier
        sampled = {i: s for i, s in enumerate(sampling or ()) if s is not None}
        states, chosen = self._check_verdict(
            seqs, kept_rows, ks, proposers, last, num_drafts, sampled, drafters
        )
        v_rows = [states[p].verify_row + kept_rows[p] - 1 for p in proposers]
        slots, kept, rows = upload(v.model.device, [s.slot for s in states], kept_rows, v_rows)
        if proposers:
            with span(_TRACER, "stash"):
                v.stash(rows)
        with span(_TRACER, "fold"):
            v.fold(states, slots, kept - 1)
        with span(_TRACER, "commit"):
            v.commit(states, kept_rows)
        mirror(seqs, states)
        if not proposers:
            return Proposal([], [])
        chosen_states = [states[p] for p in proposers]
        stash = list(range(len(proposers)))
        with span(_TRACER, "propose"):
            proposal = self.drafters.propose(
                chosen_states, chosen, last, stash, num_drafts, sampled
            )
        self.drafters.trim(chosen_states)
        return proposal

    def _check_verdict(
        self,
        seqs: Sequence[SequenceHandle],
        kept_rows: Sequence[int],
        ks: Sequence[int],
        proposers: Sequence[int],
        last: Sequence[int],
        num_drafts: int,
        sampled: dict[int, Sampling],
        drafters: Sequence[str],
    ) -> tuple[list[SeqState], list[Drafter]]:
        """Everything the fused steps would refuse, refused before the first of them runs.
        -> the sequences, and each proposer's drafter"""
        checks.same_length("settle_verdict", seqs=seqs, kept_rows=kept_rows, ks=ks)
        checks.same_length("settle_verdict", proposers=proposers, last=last)
        states = self.verifier.slots.lookup("settle_verdict", seqs)
        checks.distinct("settle_verdict's proposers", proposers)
        for s, kept, k in zip(states, kept_rows, ks, strict=True):
            checks.phase(s.seq_id, s.phase, VERIFIED, "settle")
            check_pending(s, k)
            checks.within(f"kept_rows of sequence {s.seq_id}", kept, 1, k)
        if not proposers:
            return states, []
        checks.within("the number of proposers", len(proposers), 1, self.svc.max_batch)
        for p in proposers:
            checks.within("a proposer index", p, 0, len(states) - 1)
        chosen = self.drafters.chosen("settle_verdict", [states[p] for p in proposers], drafters)
        checks.tokens_in_vocab(last, self.verifier.cfg.vocab_size)
        self.drafters.check_num_drafts(num_drafts)
        checks.within("the number of sampling entries", len(sampled), 0, len(proposers))
        check_sampling(sampled, {i: num_drafts for i in sampled}, len(proposers))
        for p, d in zip(proposers, chosen, strict=True):
            s = states[p]
            if s.verify_call != self.verifier.verify_calls:
                raise FailedPrecondition(
                    f"sequence {s.seq_id}'s verify is no longer the last one, so its hidden "
                    "rows are gone; settle each verify before the next"
                )
            d.check(s, s.seq_len - (s.pending_k - kept_rows[p]), num_drafts, None)
        return states, chosen

    @traced("engine.step")
    def decode_step(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceHandle],
        want_drafts: Sequence[bool],
        num_drafts: int,
        drafters: Sequence[str] = (),
        masks: dict[int, bytes] | None = None,
    ) -> StepResult:
        v = self.verifier
        checks.same_length("decode_step", seqs=seqs, want_drafts=want_drafts)
        for name in drafters:  # a name no sequence could draft with, before anything
            if name:
                self.drafters.get(name)
        if any(want_drafts):
            self.drafters.check_num_drafts(num_drafts)
        states = v.check_verify(tokens, ks, seqs)
        row_masks = v.masks(masks or {}, sum(ks))
        chosen = self.drafters.chosen("decode_step", states, drafters)
        wanted = [i for i, w in enumerate(want_drafts) if w and chosen[i].available]
        for i in wanted:
            chosen[i].check_count(num_drafts)
        tokens, ks = list(tokens), list(ks)
        before = [s.seq_len for s in states]
        parts = groups([chosen[i] for i in wanted])
        rows = {d: [wanted[j] for j in at] for d, at in parts.items()}
        extent = {i: d.step_extent(num_drafts) for d, r in rows.items() for i in r}
        ends = [b + k + extent.get(i, 0) for i, (b, k) in enumerate(zip(before, ks, strict=True))]
        v.slots.cover(states, [min(e, self.svc.max_context) for e in ends])
        order = [i for r in rows.values() for i in r]
        meta = _verdict_meta(tokens, ks, states, order, v.model.device)
        with span(_TRACER, "engine.verify"):
            logits = v.verify_logits(states, tokens, ks, row_masks=row_masks)
            top, logprob = v.model.argmax_logprob(logits)
        with span(_TRACER, "engine.verdict"):
            accepted = _greedy_accepted(top, meta["drafts"], meta["pred"])
            with span(_TRACER, "fold"):
                v.fold(states, meta["slots"], accepted)
            step = StepView(
                states, before, ks, top, accepted, meta["row0"], meta["slots"], meta["before"]
            )
            pending, at = [], 0
            for d, r in rows.items():
                where = meta["wanted"][at : at + len(r)]
                pending.append(d.step_drafts(step, r, where, num_drafts))
                at += len(r)
            host = download(top, logprob, accepted, *[t for p in pending for t in p.tensors])
            with span(_TRACER, "commit"):
                return self._settle(states, seqs, ks, bool(wanted), pending, host)

    def _settle(
        self,
        states: list[SeqState],
        seqs: Sequence[SequenceHandle],
        ks: list[int],
        drafted: bool,
        pending: list[StepDrafts],
        host: list[list[float]],
    ) -> StepResult:
        """The host's bookkeeping once the step's results are back; then the drafts of the
        drafters that propose from the committed sequences."""
        argmax, logprobs, accepted = ints(host[0]), host[1], ints(host[2])
        kept = [a + 1 for a in accepted]
        for s, k in zip(states, kept, strict=True):
            s.folded_rows = k
        self.verifier.commit(states, kept)
        mirror(seqs, states)
        bonus, row0 = [], 0
        for k, a in zip(ks, accepted, strict=True):
            bonus.append(argmax[row0 + a])
            row0 += k
        parts, at = [], 3
        for p in pending:
            parts.append(p.finish(host[at : at + len(p.tensors)], bonus))
            at += len(p.tensors)
        proposers, proposal = self.drafters.merge(parts)
        if drafted:
            for s in states:
                s.own_drafts = []  # each drafter trimmed its own entries
            self.verifier.slots.shrink(states)
        for s, b in zip(states, bonus, strict=True):
            s.continuation = [b]
        for i, drafts in zip(proposers, proposal.drafts, strict=True):
            states[i].continuation = [bonus[i], *drafts]
        return StepResult(argmax, logprobs, accepted, proposers, proposal)


def _verdict_meta(
    tokens: list[int],
    ks: list[int],
    states: list[SeqState],
    wanted: list[int],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The greedy verdict's inputs, in one copy: each sequence's drafts in a [B, K - 1] grid
    (-1 past its own, never an argmax) and the rows whose argmax they must equal; its first
    row, slot and length; and `wanted`, the sequences that draft, by drafter."""
    width = max(ks) - 1
    drafts, pred, row0, row = [], [], [], 0
    for k in ks:
        drafts += tokens[row + 1 : row + k] + [-1] * (width - k + 1)
        pred += [row + j for j in range(k - 1)] + [0] * (width - k + 1)
        row0.append(row)
        row += k
    names = ["drafts", "pred", "row0", "slots", "wanted", "before"]
    lists = [drafts, pred, row0, [s.slot for s in states], wanted, [s.seq_len for s in states]]
    meta = dict(zip(names, upload(device, *lists), strict=True))
    meta["drafts"] = meta["drafts"].view(len(ks), width)
    meta["pred"] = meta["pred"].view(len(ks), width)
    return meta


def _greedy_accepted(top: torch.Tensor, drafts: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """Per sequence, how many drafts in a row equal the argmax of the row before: the greedy
    rule of `greedy_accepted`, on the device. -> [B] int64"""
    return (drafts == top[pred]).long().cumprod(1).sum(1)
