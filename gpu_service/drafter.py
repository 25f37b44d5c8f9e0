"""The drafter's operations (propose, trim, the prompt priming) and the fused verdict, as a
mixin of the engine: they share its lock, state and checks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gpu_service import checks
from gpu_service.interface import (
    FailedPrecondition,
    InvalidArgument,
    Proposal,
    Sampling,
    SequenceHandle,
    StepResult,
    greedy_accepted,
)
from gpu_service.model.hybrid import DRAFT_LOGITS_TILE, Segment
from gpu_service.sampling import check_sampling, distribution, draw
from gpu_service.sequence import IDLE, VERIFIED, SeqState
from gpu_service.telemetry import traced


class DrafterOps:
    def _prime_drafter(
        self,
        group: list[SeqState],
        toks: list[list[int]],
        segs: list[Segment],
        hidden: torch.Tensor,
    ) -> None:
        """The drafter's entries for a prompt chunk: token j + 1 with the target's hidden of
        position j, starting from the previous chunk's last hidden when there is one."""
        if not self.cfg.has_mtp:
            return
        pair_tokens, pair_hidden, mtp_segs, row = [], [], [], 0
        for s, t, sg in zip(group, toks, segs, strict=True):
            carry = self.state.mtp_carry_valid[s.slot]
            hid = hidden[sg.rows]
            tok = t[1:]
            if carry:
                tok = t
                hid = torch.cat([self.state.mtp_carry[s.slot][None], hid])
            count = len(tok)
            if count:
                pair_tokens.extend(tok)
                pair_hidden.append(hid[:count])
                mtp_segs.append(Segment(s.slot, sg.start - (1 if carry else 0), count, row))
                row += count
            self.state.mtp_carry[s.slot] = hidden[sg.row + sg.count - 1]
            self.state.mtp_carry_valid[s.slot] = True
        if mtp_segs:
            self.model.mtp_forward(
                torch.tensor(pair_tokens), torch.cat(pair_hidden), mtp_segs, self.state
            )

    @traced("propose")
    def run_mtp_propose_batched(
        self,
        last: Sequence[int],
        stash: Sequence[int],
        num_drafts: int,
        seqs: Sequence[SequenceHandle],
        sampling: Sequence[Sampling | None] | None = None,
    ) -> Proposal:
        with self._lock:
            states = self._check_propose(last, stash, num_drafts, seqs)
            sampled = {i: s for i, s in enumerate(sampling or ()) if s is not None}
            check_sampling(sampled, {i: num_drafts for i in sampled}, len(states))
            qs: dict[int, list[torch.Tensor]] = {i: [] for i in sampled}

            def run(idx: list[int]) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
                group = [states[i] for i in idx]
                tok = torch.tensor([last[i] for i in idx])
                hidden = self.state.stash[[stash[i] for i in idx]]
                drafts, confs = [], []
                for j in range(num_drafts):
                    segs = self._segments(
                        group, [1] * len(group), [s.seq_len - 1 + j for s in group]
                    )
                    hidden = self.model.mtp_forward(tok, hidden, segs, self.state)[: len(group)]
                    logits = self.model.logits(hidden, DRAFT_LOGITS_TILE)
                    tok, conf = self._argmax(logits)
                    tok, conf = tok.tolist(), conf.tolist()
                    for g, i in enumerate(idx):
                        if i in sampled:
                            q = distribution(logits[g : g + 1], sampled[i])[0]
                            tok[g] = draw(q, sampled[i].uniforms[j])
                            # fp32, as the wire carries it, so both transports agree.
                            conf[g] = float(np.float32(q[tok[g]]))
                            qs[i].append(q)
                    drafts.append(tok)
                    confs.append(conf)
                    tok = torch.tensor(tok, device=logits.device)
                return drafts, confs, logits

            parts = (
                [run([i]) for i in range(len(states))]
                if self.forward_name.endswith("-serial")
                else [run(list(range(len(states))))]
            )
            drafts = [list(col) for d, _, _ in parts for col in zip(*d, strict=True)]
            confs = [list(col) for _, c, _ in parts for col in zip(*c, strict=True)]
            self.state.logits = torch.cat([lg for _, _, lg in parts])
            for i, s in enumerate(states):
                s.own_drafts = [s.seq_len - 1 + j for j in range(1, num_drafts)]
                s.draft_probs = torch.stack(qs[i]) if i in qs else None
            return Proposal(drafts, confs)

    def _check_propose(
        self,
        last: Sequence[int],
        stash: Sequence[int],
        num_drafts: int,
        seqs: Sequence[SequenceHandle],
    ) -> list[SeqState]:
        if not self.cfg.has_mtp:
            raise FailedPrecondition("this model has no MTP head; it cannot propose drafts")
        checks.same_length("run_mtp_propose_batched", seqs=seqs, last=last, stash=stash)
        states = self._lookup("run_mtp_propose_batched", seqs)
        checks.within("the number of sequences", len(states), 1, self.svc.max_batch)
        checks.tokens_in_vocab(last, self.cfg.vocab_size)
        checks.within("num_drafts", num_drafts, 1, max(self.svc.slot_verify_drafts) + 1)
        for s, slot in zip(states, stash, strict=True):
            checks.within("a stash slot", slot, 0, self.svc.max_batch - 1)
            if not self.state.stash_valid[slot]:
                raise FailedPrecondition(f"stash slot {slot} holds no hidden yet")
            checks.phase(s.seq_id, s.phase, IDLE, "propose for")
            if s.seq_len == 0:
                raise FailedPrecondition(f"sequence {s.seq_id} is empty; prefill it first")
            checks.fits_context(s.seq_id, s.seq_len - 1, num_drafts, self.svc.max_context)
        return states

    def check_positions(self, seqs: Sequence[SequenceHandle], positions: Sequence[int]) -> None:
        """A caller's mirrored `seq_len`s, checked against the service's."""
        checks.same_length("run_mtp_propose_batched", seqs=seqs, positions=positions)
        for h, pos in zip(seqs, positions, strict=True):
            s = self._get(h.seq_id)
            if pos != s.seq_len:
                raise InvalidArgument(
                    f"sequence {s.seq_id} holds {s.seq_len} tokens; the request says {pos}"
                )

    @traced("trim")
    def trim_proposer_state(self, seqs: Sequence[SequenceHandle], keep_own: int = 0) -> None:
        with self._lock:
            states = self._lookup("trim_proposer_state", seqs)
            if keep_own < 0:
                raise InvalidArgument(f"keep_own is {keep_own}; it must be at least 0")
            for s in states:
                for pos in s.own_drafts[keep_own:]:
                    self.state.mtp_valid[s.slot, pos] = False
                s.own_drafts = s.own_drafts[:keep_own]

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
        with self._lock:
            states = self._check_verdict(seqs, kept_rows, ks, proposers, last, num_drafts)
            sampled = {i: s for i, s in enumerate(sampling or ()) if s is not None}
            check_sampling(sampled, {i: num_drafts for i in sampled}, max(len(proposers), 1))
            if proposers:
                rows = [states[p].verify_row + kept_rows[p] - 1 for p in proposers]
                self.stash_verify_hidden_rows(rows)
            self.gdn_fold_accepted(seqs, kept_rows)
            self.commit_accepted_prefix(seqs, kept_rows, ks)
            if not proposers:
                return Proposal([], [])
            chosen = [seqs[p] for p in proposers]
            proposal = self.run_mtp_propose_batched(
                last, range(len(chosen)), num_drafts, chosen, sampling
            )
            self.trim_proposer_state(chosen)
            return proposal

    @traced("engine.step")
    def decode_step(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceHandle],
        want_drafts: Sequence[bool],
        num_drafts: int,
    ) -> StepResult:
        with self._lock:
            checks.same_length("decode_step", seqs=seqs, want_drafts=want_drafts)
            if any(want_drafts):
                checks.within("num_drafts", num_drafts, 1, max(self.svc.slot_verify_drafts) + 1)
            argmax = self.decode_verify_batched(tokens, ks, seqs)
            logprobs = self.last_logprobs()
            states = self._lookup("decode_step", seqs)
            accepted, last, row = [], [], 0
            for k in ks:
                n = greedy_accepted(tokens[row : row + k], argmax[row : row + k])
                accepted.append(n)
                last.append(argmax[row + n])
                row += k
            proposers = [
                i
                for i, s in enumerate(states)
                if want_drafts[i]
                and self.cfg.has_mtp
                and s.seq_len - (ks[i] - accepted[i] - 1) - 1 + num_drafts <= self.svc.max_context
            ]
            proposal = self.settle_verdict(
                seqs,
                [n + 1 for n in accepted],
                ks,
                proposers,
                [last[i] for i in proposers],
                num_drafts if proposers else 0,
            )
            return StepResult(argmax, logprobs, accepted, proposers, proposal)

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
        states = self._lookup("settle_verdict", seqs)
        checks.distinct("settle_verdict's proposers", proposers)
        for s, kept, k in zip(states, kept_rows, ks, strict=True):
            checks.phase(s.seq_id, s.phase, VERIFIED, "settle")
            if k != s.pending_k:
                raise InvalidArgument(
                    f"sequence {s.seq_id}'s last verify had {s.pending_k} rows, not {k}"
                )
            checks.within(f"kept_rows of sequence {s.seq_id}", kept, 1, k)
        if not proposers:
            return states
        if not self.cfg.has_mtp:
            raise FailedPrecondition("this model has no MTP head; it cannot propose drafts")
        checks.within("the number of proposers", len(proposers), 1, self.svc.max_batch)
        checks.tokens_in_vocab(last, self.cfg.vocab_size)
        checks.within("num_drafts", num_drafts, 1, max(self.svc.slot_verify_drafts) + 1)
        for p in proposers:
            checks.within("a proposer index", p, 0, len(states) - 1)
            s = states[p]
            if s.verify_call != self._verify_calls:
                raise FailedPrecondition(
                    f"sequence {s.seq_id}'s verify is no longer the last one, so its hidden "
                    "rows are gone; settle each verify before the next"
                )
            after = s.seq_len - (s.pending_k - kept_rows[p])
            checks.fits_context(s.seq_id, after - 1, num_drafts, self.svc.max_context)
        return states
