"""The service's drafters behind one interface (`Drafter`), keyed by the names of
`protos.model.DRAFTERS`: the target's MTP head (`head_drafter.py`) and a DFlash block drafter
(`block_drafter.py`). The engine asks the interface what a drafter primes, whether a propose
fits, and for the drafts; `Drafters` resolves a call's names (a sequence's allocated drafter
where the call names none) and runs each drafter over its own sequences.

A call may switch a sequence's drafter from one step to the next, because every drafter is kept
for every sequence, whichever it was allocated: the MTP head's KV is primed from every prompt
and, at each of its proposes, written from the target's hidden of the last committed row (the
positions committed while another drafter proposed stay unwritten, as accepted drafts' do, and
its attention skips them); the DFlash context is written from the target's taps by every
prefill and verify row. A switch changes the drafts, never what the verify accepts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gpu_service.engine.sampling import check_sampling
from gpu_service.memory.sequence import IDLE, SeqState
from gpu_service.memory.slots import SlotTable
from gpu_service.model.batch import Segment
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.state import DeviceState
from protos import checks
from protos.model import (
    DFLASH,
    DRAFTERS,
    MTP_HEAD,
    FailedPrecondition,
    InvalidArgument,
    Proposal,
    Sampling,
    SequenceHandle,
)
from protos.telemetry import traced

# What a service lacks that has no drafter of a name of `DRAFTERS`.
MISSING = {
    MTP_HEAD: "MTP head drafter",
    DFLASH: "DFlash drafter (start it with --drafter PATH)",
}


@dataclass(frozen=True)
class StepView:
    """A `decode_step` after its verdict, before its results come back: what a drafter reads
    to propose for the step's sequences."""

    states: list[SeqState]  # the step's sequences (committed once `StepDrafts.finish` runs)
    before: list[int]  # each one's length before the verify
    ks: list[int]  # each one's verified rows
    # On the device:
    top: torch.Tensor  # [R] every row's argmax
    accepted: torch.Tensor  # [B] each one's drafts that stood
    row0: torch.Tensor  # [B] each one's first row
    slots: torch.Tensor  # [B] each one's slot
    before_t: torch.Tensor  # [B] `before`


# A drafter's proposal for some of a call's sequences: (the sequences it proposed for, as
# indexes into the call; their drafts in that order; each one's last draft's logits [n, V]).
Drafted = tuple[list[int], Proposal, torch.Tensor]


@dataclass(frozen=True)
class StepDrafts:
    """A drafter's part of a `decode_step`: `tensors` come back with the step's results, in
    its one transfer; once the step is committed, `finish(values, bonus)` (those tensors on
    the host; every sequence's bonus token) gives what it proposed."""

    tensors: list[torch.Tensor]
    finish: Callable[[list[list[float]], list[int]], Drafted]


class Drafter(Protocol):
    """One way to propose drafts, named by one of `DRAFTERS`."""

    name: str

    @property
    def available(self) -> bool:
        """Whether it can propose on this service (a model without an MTP head has none)."""
        ...

    def prime(
        self,
        group: list[SeqState],
        toks: list[list[int]],
        segs: list[Segment],
        hidden: torch.Tensor,
    ) -> None:
        """Its state from a prefill chunk of every sequence in `group` (each one's tokens
        `toks`, rows `segs`, the target's final hiddens `hidden`), whichever drafter the
        sequence was allocated."""

    def check(self, s: SeqState, seq_len: int, num_drafts: int, stash: int | None) -> None:
        """A propose of `num_drafts` for `s` from `seq_len` committed tokens, refused with a
        sentence: `FailedPrecondition` where it cannot propose at all, `InvalidArgument` for a
        count it cannot give or drafts past the context. `stash`: the stash slot the propose
        starts from (None where the call fills it)."""

    def check_count(self, num_drafts: int) -> None:
        """`InvalidArgument` for a count no propose of it can give."""

    def step_extent(self, num_drafts: int) -> int:
        """Positions past a step's verified rows its propose may write: covered before the
        verify, so that a short KV pool refuses the step before any of it runs."""

    def propose(
        self,
        states: list[SeqState],
        last: list[int],
        stash: list[int],
        num_drafts: int,
        sampled: dict[int, Sampling],
    ) -> tuple[Proposal, torch.Tensor]:
        """Drafts for committed sequences from `last` (the token after each one's history)
        -> (the proposal, each one's last draft's logits [n, V])."""

    def step_drafts(
        self, step: StepView, rows: list[int], where: torch.Tensor, num_drafts: int
    ) -> StepDrafts:
        """Its part of a `decode_step` for the sequences `rows` (indexes into the step; `where`,
        the same on the device): drafts from each one's last accepted row, for those with room
        once committed."""

    def trim(self, states: list[SeqState], keep_own: int) -> None:
        """Drop the entries its last propose built from its own outputs, keeping the first
        `keep_own`."""


class Drafters:
    """The service's drafters by name; the rest of the engine asks these for drafts."""

    def __init__(
        self,
        cfg: ModelConfig,
        svc: ServiceConfig,
        state: DeviceState,
        slots: SlotTable,
        drafters: Sequence[Drafter],
    ) -> None:
        self.cfg, self.svc, self.state, self.slots = cfg, svc, state, slots
        self.by_name = {d.name: d for d in drafters}

    @traced("propose")
    def run_mtp_propose_batched(
        self,
        last: Sequence[int],
        stash: Sequence[int],
        num_drafts: int,
        seqs: Sequence[SequenceHandle],
        sampling: Sequence[Sampling | None] | None = None,
        drafters: Sequence[str] = (),
    ) -> Proposal:
        what = "run_mtp_propose_batched"
        checks.same_length(what, seqs=seqs, last=last, stash=stash)
        states = self.slots.lookup(what, seqs)
        chosen = self.chosen(what, states, drafters)
        checks.tokens_in_vocab(last, self.cfg.vocab_size)
        self.check_propose(states, chosen, stash, num_drafts)
        sampled = {i: s for i, s in enumerate(sampling or ()) if s is not None}
        check_sampling(sampled, {i: num_drafts for i in sampled}, len(states))
        return self.propose(states, chosen, last, stash, num_drafts, sampled)

    def get(self, name: str) -> Drafter:
        """The drafter of a name; a name this service has none for is refused, naming it."""
        if name in self.by_name:
            return self.by_name[name]
        if name in DRAFTERS:
            raise FailedPrecondition(f"this service has no {MISSING[name]}")
        raise InvalidArgument(
            f"drafter {name!r} is unknown; this service drafts with {', '.join(self.by_name)}"
        )

    def chosen(self, what: str, states: Sequence[SeqState], names: Sequence[str]) -> list[Drafter]:
        """Each sequence's drafter for a call: `names[i]`, or its allocated one where that is
        empty or `names` is (no names: each sequence's own)."""
        if names:
            checks.same_length(what, sequences=states, drafters=names)
        named = list(names) or [""] * len(states)
        return [self.get(n or s.drafter) for s, n in zip(states, named, strict=True)]

    def prime(
        self,
        group: list[SeqState],
        toks: list[list[int]],
        segs: list[Segment],
        hidden: torch.Tensor,
    ) -> None:
        """Every drafter primed for every sequence: a later call may choose any of them."""
        for d in self.by_name.values():
            d.prime(group, toks, segs, hidden)

    def check_num_drafts(self, num_drafts: int) -> None:
        checks.within("num_drafts", num_drafts, 1, max(self.svc.slot_verify_drafts) + 1)

    def propose(
        self,
        states: list[SeqState],
        drafters: list[Drafter],
        last: Sequence[int],
        stash: Sequence[int],
        num_drafts: int,
        sampled: dict[int, Sampling],
    ) -> Proposal:
        """Each drafter over its own sequences; the proposal, and the logits buffer's rows
        (each sequence's last draft), in the sequences' order."""
        parts: list[Drafted] = []
        for d, rows in groups(drafters).items():
            proposal, logits = d.propose(
                [states[i] for i in rows],
                [last[i] for i in rows],
                [stash[i] for i in rows],
                num_drafts,
                {j: sampled[i] for j, i in enumerate(rows) if i in sampled},
            )
            parts.append((rows, proposal, logits))
        _, proposal = self.merge(parts)
        return proposal

    def merge(self, parts: list[Drafted]) -> tuple[list[int], Proposal]:
        """Parts of one call's proposal as one, in the order of the sequences they cover; the
        logits buffer takes their rows in that order."""
        rows = sorted(i for p in parts for i in p[0])
        at = {i: (p, j) for p in parts for j, i in enumerate(p[0])}
        drafts = [at[i][0][1].drafts[at[i][1]] for i in rows]
        confs = [at[i][0][1].confidences[at[i][1]] for i in rows]
        if len(parts) == 1:
            self.state.logits = parts[0][2]
        elif parts:
            logits = torch.cat([p[2] for p in parts])
            order = [i for p in parts for i in p[0]]
            index = torch.tensor([order.index(i) for i in rows], device=logits.device)
            self.state.logits = logits.index_select(0, index)
        return rows, Proposal(drafts, confs)

    def check_propose(
        self,
        states: list[SeqState],
        drafters: list[Drafter],
        stash: Sequence[int],
        num_drafts: int,
    ) -> None:
        """What `run_mtp_propose_batched` refuses of its sequences."""
        checks.within("the number of sequences", len(states), 1, self.svc.max_batch)
        self.check_num_drafts(num_drafts)
        for s, d, slot in zip(states, drafters, stash, strict=True):
            checks.phase(s.seq_id, s.phase, IDLE, "propose for")
            if s.seq_len == 0:
                raise FailedPrecondition(f"sequence {s.seq_id} is empty; prefill it first")
            d.check(s, s.seq_len, num_drafts, slot)

    def check_positions(self, seqs: Sequence[SequenceHandle], positions: Sequence[int]) -> None:
        """A caller's mirrored `seq_len`s, checked against the service's."""
        checks.same_length("run_mtp_propose_batched", seqs=seqs, positions=positions)
        for h, pos in zip(seqs, positions, strict=True):
            s = self.slots.get(h.seq_id)
            if pos != s.seq_len:
                raise InvalidArgument(
                    f"sequence {s.seq_id} holds {s.seq_len} tokens; the request says {pos}"
                )

    @traced("trim")
    def trim(self, states: list[SeqState], keep_own: int = 0) -> None:
        if keep_own < 0:
            raise InvalidArgument(f"keep_own is {keep_own}; it must be at least 0")
        for d in self.by_name.values():
            d.trim(states, keep_own)
        self.slots.shrink(states)


def groups(drafters: Sequence[Drafter]) -> dict[Drafter, list[int]]:
    """The indexes each drafter serves, in order; drafters in order of first use."""
    out: dict[Drafter, list[int]] = {}
    for i, d in enumerate(drafters):
        out.setdefault(d, []).append(i)
    return out
