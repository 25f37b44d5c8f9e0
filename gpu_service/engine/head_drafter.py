"""The MTP head's drafter: primes the head's KV from prompts, proposes drafts by chaining the
head on the device (draft j + 1's input is draft j's argmax, no host round trip), inside a
`decode_step` too, and trims what the committed history no longer justifies."""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from gpu_service.engine.choice import Choice
from gpu_service.engine.drafters import Drafted, StepDrafts, StepView
from gpu_service.engine.graphs import Graphs
from gpu_service.engine.logits import distribution
from gpu_service.engine.sampling import draw
from gpu_service.memory.sequence import SeqState
from gpu_service.memory.slots import SlotTable
from gpu_service.model.backend import download, ints, upload
from gpu_service.model.batch import Segment, draft_batch, key_len
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.hybrid import HybridModel
from gpu_service.model.mrope import positions
from gpu_service.model.ops import ROW_TILE, padded_rows
from gpu_service.model.state import DeviceState
from kernels.attention.naive import KEY_BLOCK
from protos import checks
from protos.model import (
    MTP_HEAD,
    FailedPrecondition,
    InvalidArgument,
    Proposal,
    Sampling,
    room_to_propose,
)
from protos.telemetry import span, tracer

_TRACER = tracer("met.engine")


class HeadDrafter:
    """The target's MTP head as a `Drafter`: drafts chained from the stash slot's hidden (the
    target's final hidden of the last committed row), one head pass a draft."""

    name = MTP_HEAD

    def __init__(
        self,
        cfg: ModelConfig,
        svc: ServiceConfig,
        model: HybridModel,
        state: DeviceState,
        slots: SlotTable,
        choice: Choice,
    ) -> None:
        self.cfg, self.svc, self.model, self.state = cfg, svc, model, state
        self.slots, self.choice = slots, choice

    @property
    def available(self) -> bool:
        return self.cfg.has_mtp

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
            rope = self._image_rope(group, mtp_segs)
            self.model.mtp_forward(tokens, pairs, mtp_segs, self.state, True, rope)
        self.state.mtp_carry[slot_t] = hidden[last_t]

    def _image_rope(self, group: list[SeqState], segs: list[Segment]) -> torch.Tensor | None:
        """The entries' RoPE where a sequence has images: an entry takes its hidden row's
        position (the target's row before its token), as vLLM's MTP does; None for text."""
        if not any(s.images for s in group):
            return None
        by_slot = {s.slot: s.images for s in group}
        where = [positions(by_slot[g.slot], range(g.start, g.start + g.count)) for g in segs]
        return self.model.image_rope(torch.from_numpy(np.concatenate(where, 1)))

    # -- propose -------------------------------------------------------------------------

    def propose(
        self,
        states: list[SeqState],
        last: list[int],
        stash: list[int],
        num_drafts: int,
        sampled: dict[int, Sampling],
    ) -> tuple[Proposal, torch.Tensor]:
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
        proposal = proposal_rows(host_drafts, host_confs, len(states), num_drafts)
        return proposal, self.state.logits

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

    def check(self, s: SeqState, seq_len: int, num_drafts: int, stash: int | None) -> None:
        if not self.cfg.has_mtp:
            raise FailedPrecondition("this model has no MTP head; it cannot propose drafts")
        if stash is not None:
            checks.within("a stash slot", stash, 0, self.svc.max_batch - 1)
            if not self.state.stash_valid[stash]:
                raise FailedPrecondition(f"stash slot {stash} holds no hidden yet")
        if not room_to_propose(seq_len, num_drafts, self.svc.max_context):
            raise InvalidArgument(
                f"sequence {s.seq_id} holds {seq_len} tokens; {num_drafts} drafts from position "
                f"{seq_len - 1} exceed the context of {self.svc.max_context}"
            )

    def check_count(self, num_drafts: int) -> None:
        """Any count the slots can verify (the caller checks that bound)."""

    def step_extent(self, num_drafts: int) -> int:
        # The chain's entries run from the last accepted row to num_drafts - 1 past it.
        return num_drafts - 1

    # -- inside a decode step ------------------------------------------------------------

    def step_drafts(
        self, step: StepView, rows: list[int], where: torch.Tensor, num_drafts: int
    ) -> StepDrafts:
        """Drafts on the device from each sequence's last accepted row, before the host knows
        which it is; one without room for them drafts into the pad slot, and `finish` drops
        its drafts. Its own entries are trimmed here, on the device."""
        state = self.state
        acc = step.accepted[where]
        last_rows = step.row0[where] + acc
        pos = step.before_t[where] + acc  # the first draft's position: the last accepted row's
        # The rule is plain arithmetic, so it applies elementwise to a tensor of lengths.
        fits = room_to_propose(cast(int, pos + 1), num_drafts, self.svc.max_context)
        room = cast(torch.Tensor, fits)  # [n] bool
        slots = torch.where(room, step.slots[where], state.pad_slot)
        pos = torch.where(room, pos, 0)
        hidden = state.verify_hidden[last_rows]
        n = len(rows)
        with span(_TRACER, "stash"):
            state.stash[:n] = hidden
            state.stash_valid[:n] = [True] * n
        top_pos = max(step.before[i] + step.ks[i] - 1 for i in rows)  # the verify's last position
        with span(_TRACER, "propose"):
            drafts, confs = self.chain(step.top[last_rows], hidden, slots, pos, top_pos, num_drafts)
        logits = state.logits
        with span(_TRACER, "trim"):  # only entries from the target's hidden stay
            own = pos[:, None] + torch.arange(1, num_drafts, device=pos.device)
            state.mtp_valid.view(-1).index_put_(
                (state.kv_index(slots[:, None], own),), _false(pos.device)
            )

        def finish(values: list[list[float]], bonus: list[int]) -> Drafted:
            full = proposal_rows(values[0], values[1], n, num_drafts)
            ctx = self.svc.max_context
            keep = [
                j
                for j, i in enumerate(rows)
                if room_to_propose(step.states[i].seq_len, num_drafts, ctx)
            ]
            index = torch.tensor(keep, dtype=torch.long, device=logits.device)
            return (
                [rows[j] for j in keep],
                Proposal([full.drafts[j] for j in keep], [full.confidences[j] for j in keep]),
                logits.index_select(0, index),
            )

        return StepDrafts([drafts, confs], finish)

    # -- trim ----------------------------------------------------------------------------

    def trim(self, states: list[SeqState], keep_own: int) -> None:
        slots = [s.slot for s in states for _ in s.own_drafts[keep_own:]]
        positions = [p for s in states for p in s.own_drafts[keep_own:]]
        for s in states:
            s.own_drafts = s.own_drafts[:keep_own]
        if positions:
            where = self.state.kv_index(*upload(self.model.device, slots, positions))
            self.state.mtp_valid.view(-1).index_put_((where,), _false(self.model.device))


def _false(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.bool, device=device)


def proposal_rows(drafts: list[float], confs: list[float], n: int, nd: int) -> Proposal:
    """Flat [n * nd] host lists -> per-sequence rows."""
    d = ints(drafts)
    return Proposal(
        [d[i * nd : (i + 1) * nd] for i in range(n)],
        [confs[i * nd : (i + 1) * nd] for i in range(n)],
    )
