"""The slot table: which sequence holds which state slot, and each sequence's host record."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpu_service.sequence import SeqState
from protos import checks
from protos.model import NotFound, ResourceExhausted, SequenceHandle


class SlotTable:
    def __init__(self, num_slots: int, reset: Callable[[int], None]) -> None:
        self.num_slots = num_slots
        self._reset = reset  # zeroes a slot's device state for a fresh sequence
        self._seqs: dict[int, SeqState] = {}
        self._free = set(range(num_slots))
        self._next_id = 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> SeqState:
        """A new sequence (its id never reused) on the lowest free slot."""
        if not self._free:
            raise ResourceExhausted(f"all {self.num_slots} slots are taken")
        slot = min(self._free)
        self._free.remove(slot)
        seq = SeqState(self._next_id, slot)
        self._next_id += 1
        self._seqs[seq.seq_id] = seq
        self._reset(slot)
        return seq

    def free(self, seq_id: int) -> None:
        seq = self.get(seq_id)
        del self._seqs[seq_id]
        self._free.add(seq.slot)

    def get(self, seq_id: int) -> SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise NotFound(f"sequence {seq_id} is unknown or already freed") from None

    def lookup(self, what: str, handles: Sequence[SequenceHandle]) -> list[SeqState]:
        """The sequences a call names: at least one, each once, each known."""
        checks.not_empty(what, handles)
        ids = [h.seq_id for h in handles]
        checks.distinct(what, ids)
        return [self.get(i) for i in ids]


def mirror(handles: Sequence[SequenceHandle], states: Sequence[SeqState]) -> None:
    """Every reply updates the caller's mirror of `seq_len`."""
    for h, s in zip(handles, states, strict=True):
        h.seq_len = s.seq_len
