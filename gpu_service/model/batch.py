"""A batched call's metadata: built once on the host from its segments, copied to the device in
one transfer, and read by every layer as index tensors, so the forward has no per-sequence
loop and its operator count does not grow with the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_service.model.ops import padded_rows


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a batched call: rows `row .. row + count - 1` of the batch sit at
    positions `start .. start + count - 1` of the sequence on `slot`."""

    slot: int
    start: int
    count: int
    row: int


@dataclass(frozen=True)
class Layout:
    """What the host knows of a call's shape; everything else is derived from segments."""

    query_tile: int  # attention query rows per tile
    key_block: int  # attention keys per block; the key length is a multiple of it
    conv_width: int  # the GDN conv's kernel width W
    chunk: int  # GDN chunk length of the chunked (prefill) form; 0: the recurrent form
    verify_offset: tuple[int, ...] = ()  # per slot, its first row in the verify pool
    pad_vrow: int = 0  # a verify-pool row no slot owns, where padding entries write
    # False: each sequence's rows form one block that sees itself whole (a DFlash block):
    # every row sees the keys up to its sequence's last row, not only up to its own.
    causal: bool = True


@dataclass(frozen=True)
class Batch:
    """Index tensors of one call (int64, on the device). B sequences, R rows padded to P,
    GDN grid of T x B entries (T: rows per sequence, padded to whole chunks when chunked)."""

    segs: tuple[Segment, ...]
    rows: int  # R
    padded: int  # P
    steps: int  # T
    key_len: int  # keys every attention tile reads, a multiple of the key block
    chunk: int  # GDN chunk length of the chunked form (0: the recurrent form)
    row_slot: torch.Tensor  # [R] slot of each row
    row_vrow: torch.Tensor  # [R] verify-pool row of each row (verify calls)
    row_pos: torch.Tensor  # [P] position of each row (0 for padding)
    seq_slot: torch.Tensor  # [B]
    last_row: torch.Tensor  # [B] each sequence's last row
    tile_row: torch.Tensor  # [nt * QT] row of each tile entry (0 for padding)
    tile_pos: torch.Tensor  # [nt * QT] its position (-1 for padding: it sees no key)
    tile_slot: torch.Tensor  # [nt]
    row_tile: torch.Tensor  # [P] each row's tile entry
    conv_src: torch.Tensor  # [P * W] conv input of each row's taps, oldest first
    grid_row: torch.Tensor  # [T * B] row of each grid entry, time-major (0 for padding)
    grid_valid: torch.Tensor  # [T * B] 1 for a real row, 0 for padding
    row_grid: torch.Tensor  # [P] each row's grid entry
    grid_last: torch.Tensor  # [B] each sequence's last real grid entry
    grid_vrow: torch.Tensor  # [T * B] verify-pool row of each grid entry (pad_vrow: padding)
    key_block: int
    causal: bool = True  # `Layout.causal`
    # For the Triton kernels (None in a draft batch: one row per sequence, see `draft_batch`)
    cu_seqlens: torch.Tensor | None = None  # [B + 1] int32
    seq_slot32: torch.Tensor | None = None  # [B] int32
    seq_start32: torch.Tensor | None = None  # [B] int32
    seq_vrow32: torch.Tensor | None = None  # [B] int32, each sequence's first verify-pool row

    @property
    def num_seqs(self) -> int:
        return len(self.segs)


def _blocks(length: int, block: int) -> int:
    return -(-length // block)


def key_len(length: int, block: int) -> int:
    """Keys an attention tile reads to see `length` positions: whole blocks."""
    return _blocks(length, block) * block


@dataclass(frozen=True)
class HostBatch:
    """A call's metadata on the host: the int64 index lists by `Batch` field, then the int32
    lists of the Triton kernels (`cu_seqlens`, `seq_slot32`, `seq_start32`, `seq_vrow32`)."""

    segs: tuple[Segment, ...]
    rows: int
    padded: int
    steps: int
    chunk: int
    key_len: int
    key_block: int
    parts: dict[str, list[int]]
    small: dict[str, list[int]]
    causal: bool = True


def host_batch(segs: list[Segment], layout: Layout, row_tile: int) -> HostBatch:
    """Every index list of a call, on the host."""
    rows = segs[-1].row + segs[-1].count
    padded = padded_rows(rows, row_tile)
    chunk = layout.chunk
    longest = max(s.count for s in segs)
    steps = _blocks(longest, chunk) * chunk if chunk else longest
    parts = {
        "row_slot": [s.slot for s in segs for _ in range(s.count)],
        "row_vrow": [
            v + t for s, v in zip(segs, _vrows(segs, layout), strict=True) for t in range(s.count)
        ],
        "row_pos": _row_pos(segs, padded),
        "seq_slot": [s.slot for s in segs],
        "last_row": [s.row + s.count - 1 for s in segs],
        **_tiles(segs, padded, layout.query_tile, layout.causal),
        "conv_src": _conv_src(segs, padded, layout.conv_width),
        **_grid(segs, padded, steps, layout),
    }
    small = {
        "cu_seqlens": [s.row for s in segs] + [rows],
        "seq_slot32": [s.slot for s in segs],
        "seq_start32": [s.start for s in segs],
        "seq_vrow32": _vrows(segs, layout),
    }
    return HostBatch(
        segs=tuple(segs),
        rows=rows,
        padded=padded,
        steps=steps,
        chunk=chunk,
        key_len=key_len(max(s.start + s.count for s in segs), layout.key_block),
        key_block=layout.key_block,
        parts=parts,
        small=small,
        causal=layout.causal,
    )


def on_device(host: HostBatch, flat: torch.Tensor, small: torch.Tensor) -> Batch:
    """The `Batch` whose index tensors are views of `flat` (int64, the parts in order) and
    `small` (int32, the Triton kernels' lists in order)."""
    views = dict(zip(host.parts, flat.split([len(v) for v in host.parts.values()]), strict=True))
    smalls = dict(zip(host.small, small.split([len(v) for v in host.small.values()]), strict=True))
    return Batch(
        segs=host.segs,
        rows=host.rows,
        padded=host.padded,
        steps=host.steps,
        chunk=host.chunk,
        key_len=host.key_len,
        key_block=host.key_block,
        causal=host.causal,
        **views,
        **smalls,
    )


def build(segs: list[Segment], layout: Layout, row_tile: int, device: torch.device) -> Batch:
    """Every index tensor of a call, in one host-to-device copy per dtype."""
    host = host_batch(segs, layout, row_tile)
    flat = torch.tensor(
        [x for v in host.parts.values() for x in v], dtype=torch.long, device=device
    )
    small = torch.tensor(
        [x for v in host.small.values() for x in v], dtype=torch.int32, device=device
    )
    return on_device(host, flat, small)


def _row_pos(segs: list[Segment], padded: int) -> list[int]:
    pos = [p for s in segs for p in range(s.start, s.start + s.count)]
    return pos + [0] * (padded - len(pos))


def _tiles(segs: list[Segment], padded: int, tile: int, causal: bool) -> dict[str, list[int]]:
    """Each sequence's rows in query tiles of its own: a tile attends to one slot's keys, each
    entry up to its position (`causal`) or up to its sequence's last row's."""
    tile_row: list[int] = []
    tile_pos: list[int] = []
    tile_slot: list[int] = []
    row_tile = [0] * padded
    for s in segs:
        for first in range(0, s.count, tile):
            tile_slot.append(s.slot)
            for j in range(tile):
                t = first + j
                if t < s.count:
                    row_tile[s.row + t] = len(tile_row)
                tile_row.append(s.row + t if t < s.count else 0)
                seen = t if causal else s.count - 1
                tile_pos.append(s.start + seen if t < s.count else -1)
    return {
        "tile_row": tile_row,
        "tile_pos": tile_pos,
        "tile_slot": tile_slot,
        "row_tile": row_tile,
    }


def _conv_src(segs: list[Segment], padded: int, width: int) -> list[int]:
    """Indices into [the sequences' windows (B x (W - 1) rows, oldest first); the call's rows]:
    row t of sequence b reads inputs t - W + 1 .. t of its own stream."""
    n_win = len(segs) * (width - 1)
    src = [0] * (padded * width)
    for b, s in enumerate(segs):
        for t in range(s.count):
            for j in range(width):
                u = t + j - (width - 1)
                at = b * (width - 1) + (width - 1) + u if u < 0 else n_win + s.row + u
                src[(s.row + t) * width + j] = at
    return src


def _grid(segs: list[Segment], padded: int, steps: int, layout: Layout) -> dict[str, list[int]]:
    """The GDN grid, time-major: entry (t, b) at t * B + b, so that a step over every
    sequence reads one contiguous block."""
    n = len(segs)
    size = steps * n
    grid_row, grid_valid = [0] * size, [0] * size
    grid_vrow, row_grid = [layout.pad_vrow] * size, [0] * padded
    for b, s in enumerate(segs):
        base = layout.verify_offset[s.slot] if layout.verify_offset else 0
        for t in range(s.count):
            at = t * n + b
            grid_row[at], grid_valid[at], row_grid[s.row + t] = s.row + t, 1, at
            if layout.verify_offset:
                grid_vrow[at] = base + t
    return {
        "grid_row": grid_row,
        "grid_valid": grid_valid,
        "row_grid": row_grid,
        "grid_last": [(s.count - 1) * n + b for b, s in enumerate(segs)],
        "grid_vrow": grid_vrow,
    }


def _vrows(segs: list[Segment], layout: Layout) -> list[int]:
    return [layout.verify_offset[s.slot] if layout.verify_offset else 0 for s in segs]


def draft_batch(
    slots: torch.Tensor, pos: torch.Tensor, index: torch.Tensor, key_len: int, key_block: int
) -> Batch:
    """One row per sequence at positions known only on the device (the drafter's chain), each
    row a query tile of its own. slots, pos: [n]; index: [P] = 0 .. n - 1, then zeros."""
    rows, padded = slots.shape[0], index.shape[0]
    empty = slots[:0]
    return Batch(
        segs=(),
        rows=rows,
        padded=padded,
        steps=1,
        chunk=0,
        key_len=key_len,
        key_block=key_block,
        row_slot=slots,
        row_vrow=empty,
        row_pos=torch.nn.functional.pad(pos, (0, padded - rows)),
        seq_slot=slots,
        last_row=index[:rows],
        tile_row=index[:rows],
        tile_pos=pos,
        tile_slot=slots,
        row_tile=index,
        conv_src=empty,
        grid_row=empty,
        grid_valid=empty,
        row_grid=empty,
        grid_last=empty,
        grid_vrow=empty,
    )
