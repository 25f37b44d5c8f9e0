"""The drafter: primes the MTP head's KV from prompts, proposes drafts by chaining the head on
the device (draft j + 1's input is draft j's argmax, no host round trip), and trims what the
committed history no longer justifies."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gpu_service.engine.block_drafter import BlockDrafter
from gpu_service.engine.choice import Choice
from gpu_service.engine.graphs import Graphs
from gpu_service.engine.sampling import check_sampling, distribution, draw
from gpu_service.memory.sequence import IDLE, SeqState
from gpu_service.memory.slots import SlotTable
from gpu_service.model.backend import download, ints, upload
from gpu_service.model.batch import Segment, draft_batch, key_len
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.hybrid import HybridModel
from gpu_service.model.ops import ROW_TILE, padded_rows
from gpu_service.model.state import DeviceState
from kernels.attention.naive import KEY_BLOCK
from protos import checks
from protos.model import (
    DFLASH,
    FailedPrecondition,
    InvalidArgument,
    Proposal,
    Sampling,
    SequenceHandle,
    room_to_propose,
)
from protos.telemetry import traced


class Drafter:
    def __init__(
        self,
        cfg: ModelConfig,
        svc: ServiceConfig,
        model: HybridModel,
        state: DeviceState,
        slots: SlotTable,
        choice: Choice,
        blocks: BlockDrafter | None = None,
    ) -> None:
        """`blocks`: the DFlash drafter, where one is loaded; it proposes for the sequences
        allocated to it, the MTP head for the rest."""
        self.cfg, self.svc, self.model, self.state = cfg, svc, model, state
        self.slots, self.choice, self.blocks = slots, choice, blocks

    # -- priming -------------------------------------------------------------------------

    def prime(
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
        pair_tokens, sources, mtp_segs, row = [], [], [], 0
        carried = self.svc.num_slots  # sources index [carry of every slot; hidden rows]
        for s, t, sg in zip(group, toks, segs, strict=True):
            carry = self.state.mtp_carry_valid[s.slot]
            tok = t if carry else t[1:]
            src = [s.slot] if carry else []
            src += [carried + sg.row + j for j in range(len(tok) - len(src))]
            if tok:
                pair_tokens.extend(tok)
                sources.extend(src)
                mtp_segs.append(Segment(s.slot, sg.start - (1 if carry else 0), len(tok), row))
                row += len(tok)
            self.state.mtp_carry_valid[s.slot] = True
        slots, last = [s.slot for s in group], [sg.row + sg.count - 1 for sg in segs]
        tokens, src_t, slot_t, last_t = upload(hidden.device, pair_tokens, sources, slots, last)
        if mtp_segs:
            pairs = torch.cat([self.state.mtp_carry, hidden]).index_select(0, src_t)
            self.model.mtp_forward(tokens, pairs, mtp_segs, self.state, kv_only=True)
        self.state.mtp_carry[slot_t] = hidden[last_t]

    # -- propose -------------------------------------------------------------------------

    @traced("propose")
    def run_mtp_propose_batched(
        self,
        last: Sequence[int],
        stash: Sequence[int],
        num_drafts: int,
        seqs: Sequence[SequenceHandle],
        sampling: Sequence[Sampling | None] | None = None,
    ) -> Proposal:
        states = self.check_propose(last, stash, num_drafts, seqs)
        sampled = {i: s for i, s in enumerate(sampling or ()) if s is not None}
        check_sampling(sampled, {i: num_drafts for i in sampled}, len(states))
        block = [i for i, s in enumerate(states) if s.drafter == DFLASH]
        if not block:
            return self._propose_mtp(last, stash, num_drafts, states, sampled)
        head = [i for i in range(len(states)) if i not in set(block)]
        rows: list[list[int]] = [[] for _ in states]
        confs: list[list[float]] = [[] for _ in states]
        logits = []
        for group, run in ((head, self._propose_mtp), (block, self._propose_blocks)):
            if not group:
                continue
            sub = {j: sampled[i] for j, i in enumerate(group) if i in sampled}
            part = run(
                [last[i] for i in group],
                [stash[i] for i in group],
                num_drafts,
                [states[i] for i in group],
                sub,
            )
            logits.append(self.state.logits)
            for j, i in enumerate(group):
                rows[i], confs[i] = part.drafts[j], part.confidences[j]
        # The buffer's rows in the sequences' order, as one group's would be.
        order = [*head, *block]
        self.state.logits = torch.cat(logits)[
            torch.tensor([order.index(i) for i in range(len(states))])
        ]
        return Proposal(rows, confs)

    def _propose_blocks(
        self,
        last: Sequence[int],
        stash: Sequence[int],
        num_drafts: int,
        states: list[SeqState],
        sampled: dict[int, Sampling],
    ) -> Proposal:
        assert self.blocks is not None  # check_propose refuses a DFlash sequence without one
        self.slots.cover(states, [s.seq_len + self.blocks.block_size for s in states])
        drafts, confs, self.state.logits = self.blocks.propose(
            states, list(last), num_drafts, sampled
        )
        for s in states:
            s.own_drafts = []  # the block's keys are rewritten by the verify: nothing to trim
        return Proposal(drafts, confs)

    def _propose_mtp(
        self,
        last: Sequence[int],
        stash: Sequence[int],
        num_drafts: int,
        states: list[SeqState],
        sampled: dict[int, Sampling],
    ) -> Proposal:
        device = self.model.device
        self.slots.cover(states, [s.seq_len - 1 + num_drafts for s in states])
        tok, slots, pos, rows = upload(
            device, last, [s.slot for s in states], [s.seq_len - 1 for s in states], stash
        )
        hidden = self.state.stash.index_select(0, rows)
        top = max(s.seq_len - 1 for s in states)
        drafts, confs = self.chain(tok, hidden, slots, pos, top, num_drafts, sampled, states)
        host_drafts, host_confs = download(drafts, confs)
        self.own_drafts(states, num_drafts)
        return proposal_rows(host_drafts, host_confs, len(states), num_drafts)

    def own_drafts(self, states: list[SeqState], num_drafts: int) -> None:
        for s in states:
            s.own_drafts = [s.seq_len - 1 + j for j in range(1, num_drafts)]

    def chain(
        self,
        tok: torch.Tensor,
        hidden: torch.Tensor,
        slots: torch.Tensor,
        pos: torch.Tensor,
        top: int,
        num_drafts: int,
        sampled: dict[int, Sampling] | None = None,
        states: list[SeqState] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`num_drafts` drafts for n sequences, draft j of sequence i at position pos[i] + j.
        tok: [n] the tokens after the hiddens, hidden: [n, H], slots, pos: [n] on the device;
        top: the largest position on the host (keys to read). `*-serial` chains one sequence
        at a time. -> drafts [n, nd] int64, confidences [n, nd] fp32 (the draft's softmax
        probability); the last draft's logits stay in the buffer."""
        n = tok.shape[0]
        graphs = self.choice.replayed()
        if graphs is not None and not sampled:
            graphed = self._graphed(graphs, tok, hidden, slots, pos, top, num_drafts)
            if graphed is not None:
                drafts, confs, self.state.logits = graphed
                if states is not None:
                    for s in states:
                        s.draft_probs = None
                return drafts, confs
        parts = [range(i, i + 1) for i in range(n)] if self.choice.serial else [range(n)]
        out, logits = [], []
        for part in parts:
            sel = slice(part.start, part.stop)
            sub = {i - part.start: sampled[i] for i in part if sampled and i in sampled}
            subs = states[sel] if states is not None else None
            d, c, lg = self._chain(
                tok[sel], hidden[sel], slots[sel], pos[sel], top, num_drafts, sub, subs
            )
            out.append((d, c))
            logits.append(lg)
        self.state.logits = torch.cat(logits)
        return torch.cat([d for d, _ in out]), torch.cat([c for _, c in out])

    def _graphed(
        self,
        graphs: Graphs,
        tok: torch.Tensor,
        hidden: torch.Tensor,
        slots: torch.Tensor,
        pos: torch.Tensor,
        top: int,
        num_drafts: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The chain by a graph (`Graphs.chain`); `*-serial` replays it one sequence at a time,
        each result copied out before the next replay overwrites it."""
        if not self.choice.serial:
            return graphs.chain(tok, hidden, slots, pos, top, num_drafts)
        parts = []
        for i in range(tok.shape[0]):
            one = slice(i, i + 1)
            got = graphs.chain(tok[one], hidden[one], slots[one], pos[one], top, num_drafts)
            if got is None:
                return None
            parts.append([t.clone() for t in got])
        drafts, confs, logits = (torch.cat(p) for p in zip(*parts, strict=True))
        return drafts, confs, logits

    def _chain(
        self,
        tok: torch.Tensor,
        hidden: torch.Tensor,
        slots: torch.Tensor,
        pos: torch.Tensor,
        top: int,
        num_drafts: int,
        sampled: dict[int, Sampling],
        states: list[SeqState] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chain over rows padded once to a whole tile: the padding rows draft garbage
        that nothing reads, and no step pads again."""
        n = tok.shape[0]
        padded = padded_rows(n, ROW_TILE)
        (index,) = upload(tok.device, [*range(n), *[0] * (padded - n)])
        tok, hidden = tok[index], hidden[index]
        drafts: list[torch.Tensor] = []
        confs: list[torch.Tensor] = []
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in sampled}  # row -> each step's q
        for j in range(num_drafts):
            keys = min(key_len(top + j + 1, KEY_BLOCK), self.svc.max_context)
            batch = draft_batch(slots, pos + j, index, keys, KEY_BLOCK)
            out = self.model.mtp_forward(tok, hidden, batch, self.state)
            assert out is not None  # only a `kv_only` pass returns no hidden
            hidden = out
            logits = self.model.logits(hidden, ROW_TILE)
            # Only the real rows: the padding rows' drafts are never read, so they repeat
            # row 0's (a row's argmax and softmax do not depend on the other rows).
            tok, conf = self.model.draft_argmax(logits[:n])
            tok = tok[index]
            if sampled:
                tok, conf = self._sample(logits, tok, conf, sampled, qs, j)
            drafts.append(tok)
            confs.append(conf)
        if states is not None:
            for i, s in enumerate(states):
                s.draft_probs = torch.stack(qs[i]) if i in qs else None
        return torch.stack(drafts, 1)[:n], torch.stack(confs, 1)[:n], logits[:n]

    def _sample(
        self,
        logits: torch.Tensor,
        tok: torch.Tensor,
        conf: torch.Tensor,
        sampled: dict[int, Sampling],
        qs: dict[int, list[torch.Tensor]],
        j: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled sequences draw their draft from their distribution with the caller's
        uniform (on the host: sampling steps are not the device-only path)."""
        tok, conf = tok.clone(), conf.clone()
        for g, smp in sampled.items():
            q = distribution(self.model.full_logits(logits[g : g + 1]), smp)[0]
            t = draw(q, smp.uniforms[j])
            tok[g] = t
            # fp32, as the wire carries it, so both transports agree.
            conf[g] = float(np.float32(q[t]))
            qs[g].append(q)
        return tok, conf

    def check_propose(
        self,
        last: Sequence[int],
        stash: Sequence[int],
        num_drafts: int,
        seqs: Sequence[SequenceHandle],
    ) -> list[SeqState]:
        checks.same_length("run_mtp_propose_batched", seqs=seqs, last=last, stash=stash)
        states = self.slots.lookup("run_mtp_propose_batched", seqs)
        checks.within("the number of sequences", len(states), 1, self.svc.max_batch)
        checks.tokens_in_vocab(last, self.cfg.vocab_size)
        self.check_num_drafts(num_drafts)
        for s, slot in zip(states, stash, strict=True):
            checks.phase(s.seq_id, s.phase, IDLE, "propose for")
            if s.seq_len == 0:
                raise FailedPrecondition(f"sequence {s.seq_id} is empty; prefill it first")
            if s.drafter == DFLASH:
                self.check_block(s, s.seq_len, num_drafts)
                continue
            if not self.cfg.has_mtp:
                raise FailedPrecondition("this model has no MTP head; it cannot propose drafts")
            checks.within("a stash slot", slot, 0, self.svc.max_batch - 1)
            if not self.state.stash_valid[slot]:
                raise FailedPrecondition(f"stash slot {slot} holds no hidden yet")
            self.check_room(s.seq_id, s.seq_len, num_drafts)
        return states

    def check_block(self, s: SeqState, seq_len: int, num_drafts: int) -> None:
        """A DFlash sequence's propose from `seq_len` committed tokens."""
        if self.blocks is None:
            raise FailedPrecondition(
                f"sequence {s.seq_id} drafts with DFlash; this service has no DFlash drafter"
            )
        self.blocks.check(s.seq_id, seq_len, num_drafts)

    def check_num_drafts(self, num_drafts: int) -> None:
        checks.within("num_drafts", num_drafts, 1, max(self.svc.slot_verify_drafts) + 1)

    def check_room(self, seq_id: int, seq_len: int, num_drafts: int) -> None:
        """`InvalidArgument` unless `num_drafts` drafts fit after `seq_len` committed tokens."""
        if not room_to_propose(seq_len, num_drafts, self.svc.max_context):
            raise InvalidArgument(
                f"sequence {seq_id} holds {seq_len} tokens; {num_drafts} drafts from position "
                f"{seq_len - 1} exceed the context of {self.svc.max_context}"
            )

    def check_positions(self, seqs: Sequence[SequenceHandle], positions: Sequence[int]) -> None:
        """A caller's mirrored `seq_len`s, checked against the service's."""
        checks.same_length("run_mtp_propose_batched", seqs=seqs, positions=positions)
        for h, pos in zip(seqs, positions, strict=True):
            s = self.slots.get(h.seq_id)
            if pos != s.seq_len:
                raise InvalidArgument(
                    f"sequence {s.seq_id} holds {s.seq_len} tokens; the request says {pos}"
                )

    # -- trim ----------------------------------------------------------------------------

    @traced("trim")
    def trim_proposer_state(self, seqs: Sequence[SequenceHandle], keep_own: int = 0) -> None:
        states = self.slots.lookup("trim_proposer_state", seqs)
        if keep_own < 0:
            raise InvalidArgument(f"keep_own is {keep_own}; it must be at least 0")
        slots = [s.slot for s in states for _ in s.own_drafts[keep_own:]]
        positions = [p for s in states for p in s.own_drafts[keep_own:]]
        for s in states:
            s.own_drafts = s.own_drafts[:keep_own]
        if positions:
            where = self.state.kv_index(*upload(self.model.device, slots, positions))
            self.state.mtp_valid.view(-1).index_put_((where,), _false(self.model.device))
        self.slots.shrink(states)


def _false(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.bool, device=device)


def proposal_rows(drafts: list[float], confs: list[float], n: int, nd: int) -> Proposal:
    """Flat [n * nd] host lists -> per-sequence rows."""
    d = ints(drafts)
    return Proposal(
        [d[i * nd : (i + 1) * nd] for i in range(n)],
        [confs[i * nd : (i + 1) * nd] for i in range(n)],
    )
