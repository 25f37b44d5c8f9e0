"""The paged KV pool's bookkeeping: which blocks each slot holds, in position order, and which
are free. The host decides; the device sees it only through `DeviceState.block_table`.

A slot holds the blocks that back the positions its sequence may still read: its tokens, and
the drafter's entries past them that no trim has dropped. Blocks are taken before a call
writes past what a slot holds (all of a call's at once, or none), and given back as soon as a
commit, a trim or a free leaves them wholly past what is kept: the rows of a verify that its
commit rejects give their blocks back in that commit."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from gpu_service.model.state import DeviceState
from kernels.attention.format import KEY_BLOCK
from protos.model import ResourceExhausted


def blocks_for(positions: int) -> int:
    """Blocks that back positions 0 .. positions - 1."""
    return -(-positions // KEY_BLOCK)


class KvBlocks:
    def __init__(self, state: DeviceState) -> None:
        self.state = state
        self.num_blocks = state.num_blocks
        self._free = list(range(self.num_blocks))  # a heap: the lowest block is taken first
        self._held: dict[int, list[int]] = {}  # slot -> its blocks, by position
        # Holders of each block: the slots whose tables name it and the prefix snapshots that
        # keep it. A block goes back to the pool when its last holder lets it go; a block with
        # more than one holder is never written (`gpu_service/memory/prefixes.py` sees to it).
        self._refs = [0] * self.num_blocks

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def held(self, slot: int) -> list[int]:
        return list(self._held.get(slot, ()))

    def cover(self, ends: Sequence[tuple[int, int]]) -> None:
        """Each (slot, end): back the slot's positions below `end` with blocks, taking what it
        lacks. All or nothing: `ResourceExhausted` before any is taken when the pool is short."""
        need: dict[int, int] = {}
        for slot, end in ends:
            need[slot] = max(need.get(slot, 0), blocks_for(end))
        lacking = {s: n - len(self._held.get(s, ())) for s, n in need.items()}
        self._check_free(sum(n for n in lacking.values() if n > 0))
        for slot, n in lacking.items():
            if n > 0:
                self._take(slot, n)

    def keep(self, slot: int, end: int) -> None:
        """Give back the slot's blocks wholly at or past position `end`."""
        held = self._held.get(slot, [])
        keep = blocks_for(end)
        if len(held) <= keep:
            return
        dropped = held[keep:]
        del held[keep:]
        self.let_go(dropped)
        self.state.block_table[slot, keep : keep + len(dropped)] = self.state.pad_block

    def release(self, slot: int) -> None:
        """Every block of the slot back to the pool (its sequence was freed)."""
        self.keep(slot, 0)
        self._held.pop(slot, None)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def hold(self, blocks: Sequence[int]) -> None:
        """One more holder of each block (a snapshot keeping them, a slot sharing them)."""
        for b in blocks:
            self._refs[b] += 1

    def let_go(self, blocks: Sequence[int]) -> None:
        """One holder fewer of each block; a block none holds goes back to the pool."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                heapq.heappush(self._free, b)

    def copy(self, src: int, valid_until: int) -> int:
        """A new block (one holder: the caller) with `src`'s keys and values in every layer,
        target and drafter, and its drafter marks at offsets below `valid_until`."""
        self._check_free(1)
        (dst,) = self._fresh(1)
        st = self.state
        for pool in (st.k_cache, st.v_cache):
            pool[:, dst] = pool[:, src]
        st.mtp_k[dst], st.mtp_v[dst] = st.mtp_k[src], st.mtp_v[src]
        st.mtp_valid[dst, :valid_until] = st.mtp_valid[src, :valid_until]
        return dst

    def adopt(self, slot: int, blocks: Sequence[int]) -> None:
        """A slot that holds none starts with `blocks`, which it now holds too."""
        assert not self._held.get(slot), "adopt: the slot holds blocks already"
        self.hold(blocks)
        self._held[slot] = list(blocks)
        device = self.state.block_table.device
        table = torch.tensor(list(blocks), dtype=torch.int32, device=device)
        self.state.block_table[slot, : len(blocks)] = table

    def _check_free(self, n: int) -> None:
        if n > len(self._free):
            raise ResourceExhausted(
                f"the KV pool has {len(self._free)} free blocks of {KEY_BLOCK} positions; this "
                f"call needs {n} more (raise --kv-blocks, or send fewer or shorter sequences)"
            )

    def _fresh(self, n: int) -> list[int]:
        """n blocks from the pool, one holder each, their drafter marks cleared (a freed
        sequence's are none of the new holder's)."""
        taken = [heapq.heappop(self._free) for _ in range(n)]
        for b in taken:
            self._refs[b] = 1
        index = torch.tensor(taken, dtype=torch.long, device=self.state.mtp_valid.device)
        self.state.mtp_valid[index] = False
        return taken

    def _take(self, slot: int, n: int) -> None:
        taken = self._fresh(n)
        held = self._held.setdefault(slot, [])
        start = len(held)
        held.extend(taken)
        device = self.state.block_table.device
        blocks = torch.tensor(taken, dtype=torch.int32, device=device)
        self.state.block_table[slot, start : start + n] = blocks
