"""Prefix snapshots: what a new sequence needs to go on from a prefix another one computed, so
that it prefills only the rest of its prompt.

A snapshot of a sequence at L tokens (L a whole number of KV blocks, the chunked GDN kernel's
chunk: a prefill cut there gives the same bytes as one that is not) holds
- its KV blocks below position L - 1, shared: the snapshot and every sequence made from it hold
  them (`KvBlocks` counts holders), and none writes them again, since a sequence writes only at
  its length - 1 (the drafter's entry pairing its last token with the next) and past it;
- a copy of the block holding position L - 1, without the drafter's entry there (that entry
  pairs token L - 1 with the token after it, which each sequence made from the snapshot has of
  its own): each such sequence gets its own copy of it;
- every GDN layer's state and conv window, and the drafter's carry (the target's hidden at
  L - 1, which the drafter pairs with token L): copies, in `DeviceState`'s snapshot rows.
So a sequence made from it, then given the rest of the prompt, holds what one prefill of the
whole prompt would have left, byte for byte, the drafter's entries included: it drafts from its
first step. Snapshots are taken only of an idle sequence right after a prefill: never mid-verify,
so a speculative row is never part of one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpu_service.memory.sequence import IDLE, SeqState
from gpu_service.memory.slots import SlotTable, unknown_snapshot
from gpu_service.model.mrope import SeqImage, shift_after
from gpu_service.model.state import DeviceState
from kernels.attention.format import KEY_BLOCK
from protos import checks
from protos.model import FailedPrecondition, InvalidArgument, ResourceExhausted


@dataclass(frozen=True)
class Snapshot:
    tokens: tuple[int, ...]
    # Its images (`SeqState.images`): the embeddings of one whose tokens run on past the
    # snapshot are held with it, so that a sequence made from it prefills the rest.
    images: tuple[SeqImage, ...]
    shared: tuple[int, ...]  # the blocks below the last position, held by the snapshot
    last: int  # its own copy of the block holding the last position
    row: int  # its row in the snapshot storage


class Prefixes:
    def __init__(self, state: DeviceState, slots: SlotTable, capacity: int, has_mtp: bool) -> None:
        self.state, self.slots = state, slots
        self.capacity, self.has_mtp = capacity, has_mtp
        self._rows = list(range(capacity))  # free snapshot rows, lowest last
        self._rows.reverse()
        self._snaps: dict[int, Snapshot] = {}
        self._next_id = 1

    @property
    def num_held(self) -> int:
        return len(self._snaps)

    def snapshot(self, s: SeqState) -> int:
        """A snapshot of the sequence as it stands -> its id (never reused)."""
        self._check_snapshot(s)
        blocks = self.slots.blocks
        held = blocks.held(s.slot)
        last_block = (s.seq_len - 1) // KEY_BLOCK
        shared = tuple(held[:last_block])
        last = blocks.copy(held[last_block], (s.seq_len - 1) % KEY_BLOCK)
        blocks.hold(shared)
        row = self._rows.pop()
        st = self.state
        st.snap_gdn[:, row] = st.gdn[:, s.slot]
        st.snap_conv[:, row] = st.conv[:, s.slot]
        st.snap_carry[row] = st.mtp_carry[s.slot]
        snap_id = self._next_id
        self._next_id += 1
        self._snaps[snap_id] = Snapshot(tuple(s.tokens), s.images, shared, last, row)
        return snap_id

    def _check_snapshot(self, s: SeqState) -> None:
        if not self._rows:
            raise ResourceExhausted(
                f"all {self.capacity} prefix snapshots are held; drop one first "
                "(or raise --prefix-snapshots)"
            )
        if s.phase != IDLE:
            raise FailedPrecondition(
                f"sequence {s.seq_id} has a verify pending; a snapshot holds committed tokens only"
            )
        if not s.seq_len or s.seq_len % KEY_BLOCK:
            raise InvalidArgument(
                f"sequence {s.seq_id} holds {s.seq_len} tokens; a snapshot is taken at a whole "
                f"number of {KEY_BLOCK}-token blocks (prefill up to one, then snapshot)"
            )
        if self.has_mtp and not self.state.mtp_carry_valid[s.slot]:
            raise FailedPrecondition(
                f"sequence {s.seq_id}'s last call was not a prefill; a snapshot is taken right "
                "after one, when the drafter's carry is the hidden of its last token"
            )

    def restore(self, s: SeqState, snap_id: int) -> None:
        """The fresh sequence `s` goes on from the snapshot: its tokens, blocks and state."""
        snap = self.get(snap_id)
        if s.seq_len or s.phase != IDLE:
            raise FailedPrecondition(
                f"sequence {s.seq_id} holds {s.seq_len} tokens; a snapshot restores into a "
                "fresh sequence"
            )
        blocks = self.slots.blocks
        own = blocks.copy(snap.last, KEY_BLOCK)
        blocks.adopt(s.slot, [*snap.shared, own])
        blocks.let_go([own])  # adopted: the slot is its one holder
        st = self.state
        st.gdn[:, s.slot] = st.snap_gdn[:, snap.row]
        st.conv[:, s.slot] = st.snap_conv[:, snap.row]
        st.mtp_carry[s.slot] = st.snap_carry[snap.row]
        st.mtp_carry_valid[s.slot] = True
        st.rope_shift[s.slot] = shift_after(snap.images)
        s.tokens[:] = snap.tokens
        s.images = snap.images

    def drop(self, snap_ids: Sequence[int]) -> None:
        """Let the snapshots go: their rows, and their blocks that no sequence holds."""
        checks.distinct("drop_prefixes", list(snap_ids), "a snapshot")
        for snap_id in snap_ids:
            self.get(snap_id)
        for snap_id in snap_ids:
            snap = self._snaps.pop(snap_id)
            self.slots.blocks.let_go([*snap.shared, snap.last])
            self._rows.append(snap.row)

    def get(self, snap_id: int) -> Snapshot:
        try:
            return self._snaps[snap_id]
        except KeyError:
            raise unknown_snapshot(snap_id) from None
