"""The slot table: which sequence holds which state slot, and each sequence's host record; and
the session table: which client session owns which sequence (the servicer's, over gRPC)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence

from gpu_service.memory.kv_blocks import KvBlocks
from gpu_service.memory.sequence import SeqState
from protos import checks
from protos.model import MTP_HEAD, NotFound, Penalties, ResourceExhausted, SequenceHandle


class SlotTable:
    def __init__(self, num_slots: int, reset: Callable[[int], None], blocks: KvBlocks) -> None:
        self.num_slots = num_slots
        self._reset = reset  # zeroes a slot's device state for a fresh sequence
        self.blocks = blocks  # the KV blocks each slot holds
        self._seqs: dict[int, SeqState] = {}
        self._free = set(range(num_slots))
        self._next_id = 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, penalties: Penalties | None = None, drafter: str = MTP_HEAD) -> SeqState:
        """A new sequence (its id never reused) on the lowest free slot."""
        if not self._free:
            raise ResourceExhausted(f"all {self.num_slots} slots are taken")
        slot = min(self._free)
        self._free.remove(slot)
        seq = SeqState(self._next_id, slot, penalties=penalties, drafter=drafter)
        self._next_id += 1
        self._seqs[seq.seq_id] = seq
        self._reset(slot)
        return seq

    def free(self, seq_id: int) -> None:
        seq = self.get(seq_id)
        del self._seqs[seq_id]
        self.blocks.release(seq.slot)
        self._free.add(seq.slot)

    def renew(self, s: SeqState) -> None:
        """The sequence back to fresh: no tokens, no blocks, zero state."""
        self.blocks.release(s.slot)
        self._reset(s.slot)
        s.tokens.clear()
        s.images = ()

    def cover(self, states: Sequence[SeqState], ends: Sequence[int]) -> None:
        """KV blocks for each sequence's positions below its end, before a call writes them
        (`ResourceExhausted`, with none taken, when the pool is short)."""
        self.blocks.cover([(s.slot, end) for s, end in zip(states, ends, strict=True)])

    def shrink(self, states: Sequence[SeqState]) -> None:
        """Give back each sequence's blocks past what it keeps: its tokens, and the drafter's
        own entries after them (until they are trimmed)."""
        for s in states:
            end = max(s.seq_len, s.own_drafts[-1] + 1 if s.own_drafts else 0)
            self.blocks.keep(s.slot, end)

    def get(self, seq_id: int) -> SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise unknown_sequence(seq_id) from None

    def lookup(self, what: str, handles: Sequence[SequenceHandle]) -> list[SeqState]:
        """The sequences a call names: at least one, each once, each known. The call moves
        their state on, so what their last step left to continue from is dropped."""
        checks.not_empty(what, handles)
        ids = [h.seq_id for h in handles]
        checks.distinct(what, ids)
        states = [self.get(i) for i in ids]
        for s in states:
            s.continuation = None
        return states


def unknown_sequence(seq_id: int) -> NotFound:
    """The refusal of a sequence the caller may not name: unknown, freed, or another
    session's (the same sentence, so that an id reveals nothing of other sessions)."""
    return NotFound(f"sequence {seq_id} is unknown or already freed")


class SessionTable:
    """Live sessions and the sequences each allocated. Pure bookkeeping: the servicer keeps
    it on its event loop and frees an ended session's sequences through the engine."""

    def __init__(self) -> None:
        self._seqs: dict[str, set[int]] = {}  # live session -> its sequence ids
        self._owner: dict[int, str] = {}  # sequence id -> its session
        self._snap_owner: dict[int, str] = {}  # prefix snapshot id -> its session
        self._claims: dict[str, int] = {}  # live session -> its allocations in flight

    @property
    def num_live(self) -> int:
        return len(self._seqs)

    def open(self) -> str:
        """A new session; its id is unguessable, since naming it is all a call needs."""
        session = secrets.token_urlsafe(16)
        self._seqs[session] = set()
        return session

    def is_live(self, session: str) -> bool:
        return session in self._seqs

    def claim(self, session: str, most: int) -> None:
        """Room for one more sequence of the session, kept until `unclaim`; `ResourceExhausted`
        when it holds (or is allocating) `most` already."""
        if len(self._seqs[session]) + self._claims.get(session, 0) >= most:
            raise ResourceExhausted(
                f"this session holds {most} sequences, the most one session may hold at once "
                f"(the GPU service's --max-slots-per-session); free one first"
            )
        self._claims[session] = self._claims.get(session, 0) + 1

    def unclaim(self, session: str) -> None:
        if self._claims.get(session, 0) > 1:
            self._claims[session] -= 1
        else:
            self._claims.pop(session, None)

    def own(self, session: str, seq_id: int) -> None:
        self._seqs[session].add(seq_id)
        self._owner[seq_id] = session

    def disown(self, seq_id: int) -> None:
        session = self._owner.pop(seq_id, None)
        if session is not None:
            self._seqs[session].discard(seq_id)

    def check(self, session: str, seq_ids: Iterable[int]) -> None:
        """`NotFound` for the first id the session does not own."""
        for seq_id in seq_ids:
            if self._owner.get(seq_id) != session:
                raise unknown_sequence(seq_id)

    def own_snapshots(self, session: str, snap_ids: Iterable[int]) -> None:
        for snap_id in snap_ids:
            self._snap_owner[snap_id] = session

    def check_snapshots(self, session: str, snap_ids: Iterable[int]) -> None:
        """`NotFound` for the first prefix snapshot the session does not own."""
        for snap_id in snap_ids:
            if self._snap_owner.get(snap_id) != session:
                raise unknown_snapshot(snap_id)

    def disown_snapshots(self, snap_ids: Iterable[int]) -> None:
        for snap_id in snap_ids:
            self._snap_owner.pop(snap_id, None)

    def close_snapshots(self, session: str) -> list[int]:
        """The session's prefix snapshots, disowned, for the caller to drop."""
        ids = sorted(i for i, owner in self._snap_owner.items() if owner == session)
        self.disown_snapshots(ids)
        return ids

    def close(self, session: str) -> list[int]:
        """End the session. -> the sequences it still owned, for the caller to free."""
        seq_ids = sorted(self._seqs.pop(session, ()))
        self._claims.pop(session, None)
        for seq_id in seq_ids:
            del self._owner[seq_id]
        return seq_ids


def unknown_snapshot(snap_id: int) -> NotFound:
    """The refusal of a prefix snapshot the caller may not name (as `unknown_sequence`)."""
    return NotFound(f"prefix snapshot {snap_id} is unknown or already dropped")


def mirror(handles: Sequence[SequenceHandle], states: Sequence[SeqState]) -> None:
    """Every reply updates the caller's mirror of `seq_len`."""
    for h, s in zip(handles, states, strict=True):
        h.seq_len = s.seq_len
