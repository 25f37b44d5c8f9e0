"""The fused verdicts: `settle_verdict` (stash, fold, commit, propose, trim in one call) and
`decode_step` (a greedy step: verify, the greedy verdict, settle), composed from the verifier
and the drafter. `decode_step` keeps everything on the device between its parts and brings
its results back in one transfer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from gpu_service.engine.drafter import Drafter, proposal_rows
from gpu_service.engine.verifier import Verifier, check_pending
from gpu_service.memory.sequence import VERIFIED, SeqState
from gpu_service.memory.slots import mirror
from gpu_service.model.backend import download, ints, upload
from gpu_service.model.config import ServiceConfig
from protos import checks
from protos.model import (
    DFLASH,
    FailedPrecondition,
    Proposal,
    Sampling,
    SequenceHandle,
    StepResult,
    room_to_propose,
)
from protos.telemetry import span, traced, tracer

_TRACER = tracer("met.engine")


class Steps:
    def __init__(self, svc: ServiceConfig, verifier: Verifier, drafter: Drafter) -> None:
        self.svc, self.verifier, self.drafter = svc, verifier, drafter

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
    ) -> Proposal:
        v = self.verifier
        states = self._check_verdict(seqs, kept_rows, ks, proposers, last, num_drafts)
        sampled = {i: s for i, s in enumerate(sampling or ()) if s is not None}
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
        checks.within("the number of sampling entries", len(sampled), 0, len(proposers))
        chosen = [seqs[p] for p in proposers]
        proposal = self.drafter.run_mtp_propose_batched(
            last, range(len(chosen)), num_drafts, chosen, sampling
        )
        self.drafter.trim_proposer_state(chosen)
        return proposal

    def _check_verdict(
        self,
        seqs: Sequence[SequenceHandle],
        kept_rows: Sequence[int],
        ks: Sequence[int],
        proposers: Sequence[int],
        last: Sequence[int],
        num_drafts: int,
    ) -> list[SeqState]:
        """Everything the fused steps would refuse, refused before the first of them runs."""
        checks.same_length("settle_verdict", seqs=seqs, kept_rows=kept_rows, ks=ks)
        checks.same_length("settle_verdict", proposers=proposers, last=last)
        states = self.verifier.slots.lookup("settle_verdict", seqs)
        checks.distinct("settle_verdict's proposers", proposers)
        for s, kept, k in zip(states, kept_rows, ks, strict=True):
            checks.phase(s.seq_id, s.phase, VERIFIED, "settle")
            check_pending(s, k)
            checks.within(f"kept_rows of sequence {s.seq_id}", kept, 1, k)
        if not proposers:
            return states
        head = any(states[p].drafter != DFLASH for p in proposers if 0 <= p < len(states))
        if head and not self.verifier.cfg.has_mtp:
            raise FailedPrecondition("this model has no MTP head; it cannot propose drafts")
        checks.within("the number of proposers", len(proposers), 1, self.svc.max_batch)
        checks.tokens_in_vocab(last, self.verifier.cfg.vocab_size)
        self.drafter.check_num_drafts(num_drafts)
        for p in proposers:
            checks.within("a proposer index", p, 0, len(states) - 1)
            s = states[p]
            if s.verify_call != self.verifier.verify_calls:
                raise FailedPrecondition(
                    f"sequence {s.seq_id}'s verify is no longer the last one, so its hidden "
                    "rows are gone; settle each verify before the next"
                )
            committed = s.seq_len - (s.pending_k - kept_rows[p])
            if s.drafter == DFLASH:
                self.drafter.check_block(s, committed, num_drafts)
            else:
                self.drafter.check_room(s.seq_id, committed, num_drafts)
        return states

    @traced("engine.step")
    def decode_step(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceHandle],
        want_drafts: Sequence[bool],
        num_drafts: int,
    ) -> StepResult:
        v, d = self.verifier, self.drafter
        checks.same_length("decode_step", seqs=seqs, want_drafts=want_drafts)
        wanted = [i for i, w in enumerate(want_drafts) if w and v.cfg.has_mtp]
        if any(want_drafts):
            d.check_num_drafts(num_drafts)
        states = v.check_verify(tokens, ks, seqs)
        for i in wanted:
            if states[i].drafter == DFLASH:
                raise FailedPrecondition(
                    f"sequence {states[i].seq_id} drafts with DFlash; decode_step proposes with "
                    f"the MTP head only (verify, then settle_verdict)"
                )
        tokens, ks = list(tokens), list(ks)
        before = [s.seq_len for s in states]
        # The drafts start from the last accepted row, at most the last verified one.
        extra = [num_drafts - 1 if i in wanted else 0 for i in range(len(states))]
        v.slots.cover(states, [b + k + e for b, k, e in zip(before, ks, extra, strict=True)])
        meta = _verdict_meta(tokens, ks, states, wanted, v.model.device)
        with span(_TRACER, "engine.verify"):
            top, logprob = v.model.argmax_logprob(v.verify_logits(states, tokens, ks))
        with span(_TRACER, "engine.verdict"):
            accepted = _greedy_accepted(top, meta["drafts"], meta["pred"])
            with span(_TRACER, "fold"):
                v.fold(states, meta["slots"], accepted)
            results = [top, logprob, accepted]
            if wanted:
                results += self._draft(top, accepted, meta, before, ks, wanted, num_drafts)
            host = download(*results)
            with span(_TRACER, "commit"):
                return self._settle(states, seqs, ks, wanted, num_drafts, before, host)

    def _draft(
        self,
        top: torch.Tensor,
        accepted: torch.Tensor,
        meta: dict[str, torch.Tensor],
        before: list[int],
        ks: list[int],
        wanted: list[int],
        num_drafts: int,
    ) -> list[torch.Tensor]:
        """Drafts for every sequence that wants them, from its last accepted row; one without
        room for them drafts into the pad slot, and the host drops its drafts."""
        state = self.verifier.state
        acc = accepted[meta["wanted"]]
        last_rows = meta["row0"][meta["wanted"]] + acc
        pos = meta["before"] + acc  # the first draft's position: the last accepted row's
        # The rule is plain arithmetic, so it applies elementwise to a tensor of lengths.
        fits = room_to_propose(cast(int, pos + 1), num_drafts, self.svc.max_context)
        room = cast(torch.Tensor, fits)  # [n] bool
        slots = torch.where(room, meta["slots"][meta["wanted"]], state.pad_slot)
        pos = torch.where(room, pos, 0)
        hidden = state.verify_hidden[last_rows]
        n = len(wanted)
        with span(_TRACER, "stash"):
            state.stash[:n] = hidden
            state.stash_valid[:n] = [True] * n
        top_pos = max(before[i] + ks[i] - 1 for i in wanted)
        with span(_TRACER, "propose"):
            drafts, confs = self.drafter.chain(
                top[last_rows], hidden, slots, pos, top_pos, num_drafts
            )
        with span(_TRACER, "trim"):  # only entries from the target's hidden stay
            own = pos[:, None] + torch.arange(1, num_drafts, device=pos.device)
            where = state.kv_index(slots[:, None], own)
            state.mtp_valid.view(-1).index_put_(
                (where,), torch.zeros((), dtype=torch.bool, device=pos.device)
            )
        return [drafts, confs]

    def _settle(
        self,
        states: list[SeqState],
        seqs: Sequence[SequenceHandle],
        ks: list[int],
        wanted: list[int],
        num_drafts: int,
        before: list[int],
        host: list[list[float]],
    ) -> StepResult:
        """The host's bookkeeping once the step's results are back."""
        argmax, logprobs, accepted = ints(host[0]), host[1], ints(host[2])
        kept = [a + 1 for a in accepted]
        for s, k in zip(states, kept, strict=True):
            s.folded_rows = k
        self.verifier.commit(states, kept)
        mirror(seqs, states)
        ctx = self.svc.max_context
        proposers = [i for i in wanted if room_to_propose(before[i] + kept[i], num_drafts, ctx)]
        proposal = Proposal([], [])
        if wanted:
            full = proposal_rows(host[3], host[4], len(wanted), num_drafts)
            keep = [wanted.index(i) for i in proposers]
            proposal = Proposal([full.drafts[j] for j in keep], [full.confidences[j] for j in keep])
            for s in states:
                s.own_drafts = []
            self.verifier.slots.shrink(states)
        row0 = 0
        for s, k, a in zip(states, ks, accepted, strict=True):
            s.continuation = [argmax[row0 + a]]
            row0 += k
        for i, drafts in zip(proposers, proposal.drafts, strict=True):
            states[i].continuation = [*(states[i].continuation or []), *drafts]
        return StepResult(argmax, logprobs, accepted, proposers, proposal)


def _verdict_meta(
    tokens: list[int],
    ks: list[int],
    states: list[SeqState],
    wanted: list[int],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The greedy verdict's inputs, in one copy: each sequence's drafts in a [B, K - 1] grid
    (-1 past its own, never an argmax) and the rows whose argmax they must equal."""
    width = max(ks) - 1
    drafts, pred, row0, row = [], [], [], 0
    for k in ks:
        drafts += tokens[row + 1 : row + k] + [-1] * (width - k + 1)
        pred += [row + j for j in range(k - 1)] + [0] * (width - k + 1)
        row0.append(row)
        row += k
    names = ["drafts", "pred", "row0", "slots", "wanted", "before"]
    lists = [drafts, pred, row0, [s.slot for s in states], wanted]
    lists.append([states[i].seq_len for i in wanted])
    meta = dict(zip(names, upload(device, *lists), strict=True))
    meta["drafts"] = meta["drafts"].view(len(ks), width)
    meta["pred"] = meta["pred"].view(len(ks), width)
    return meta


def _greedy_accepted(top: torch.Tensor, drafts: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """Per sequence, how many drafts in a row equal the argmax of the row before: the greedy
    rule of `greedy_accepted`, on the device. -> [B] int64"""
    return (drafts == top[pred]).long().cumprod(1).sum(1)
