"""Attention of a sequence's new rows over its KV cache, plain torch, in fixed tiles.

Queries go in tiles of `QUERY_TILE` rows and keys in blocks of `KEY_BLOCK`, so every matmul
has one shape whatever the row count or cache length; blocks past the last key are masked
and contribute exact zeros. A row's output is then the same bytes whether it is verified
with other rows or decoded alone."""

from __future__ import annotations

import torch

from kernels.attention.format import KEY_BLOCK
from kernels.common import exp

QUERY_TILE = 16


def tiled_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_pos: torch.Tensor,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention, grouped KV heads, scale `d ** -0.5`.

    q: [T, Hq, d] rows at positions q_pos: [T]; keys, values: [L, Hkv, d] with L a multiple of
    KEY_BLOCK (the cache, position j at row j); key_valid: [L] bool or None (all valid).
    Row t sees key j when j <= q_pos[t] and key_valid[j]. -> [T, Hq, d]
    """
    rows, heads, dim = q.shape
    length, kv_heads = keys.shape[0], keys.shape[1]
    if length % KEY_BLOCK:
        raise ValueError(f"the cache length {length} is not a multiple of {KEY_BLOCK}")
    group = heads // kv_heads
    padded = -(-rows // QUERY_TILE) * QUERY_TILE
    qp = q.new_zeros(padded, heads, dim)
    qp[:rows] = q * dim**-0.5
    nq, nb = padded // QUERY_TILE, length // KEY_BLOCK
    # [Hq, nq, 1, Tq, d] @ [Hq, 1, nb, d, Kb] -> [Hq, nq, nb, Tq, Kb]
    qt = qp.permute(1, 0, 2).reshape(heads, nq, 1, QUERY_TILE, dim)
    kt = keys.repeat_interleave(group, dim=1).permute(1, 0, 2).reshape(heads, 1, nb, KEY_BLOCK, dim)
    vt = (
        values.repeat_interleave(group, dim=1)
        .permute(1, 0, 2)
        .reshape(heads, 1, nb, KEY_BLOCK, dim)
    )
    scores = (qt @ kt.transpose(-1, -2)).float()
    pos = torch.full((padded,), -1, dtype=torch.long, device=q.device)
    pos[:rows] = q_pos
    key_pos = torch.arange(length, device=q.device)
    visible = key_pos[None, :] <= pos[:, None]  # [padded, L]
    if key_valid is not None:
        visible = visible & key_valid[None, :]
    # [padded, L] -> [1, nq, nb, Tq, Kb], aligned with scores.
    visible = visible.view(nq, QUERY_TILE, nb, KEY_BLOCK).permute(0, 2, 1, 3).unsqueeze(0)
    scores = scores.masked_fill(~visible, float("-inf"))
    peak = scores.amax(dim=(2, 4), keepdim=True).clamp_min(-1e30)  # rows that see nothing
    probs = exp(scores - peak)
    denom = probs.sum(dim=4, keepdim=True).sum(dim=2, keepdim=True).clamp_min(1e-30)
    probs = (probs / denom).to(q.dtype)
    out = (probs @ vt).sum(dim=2)  # [Hq, nq, Tq, d]
    return out.reshape(heads, padded, dim).permute(1, 0, 2)[:rows]


def pool_index(table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Where positions of slots lie in a paged pool viewed as [blocks * KEY_BLOCK, ...]:
    table: [slots, blocks a sequence], position p of slot s in block table[s, p // KEY_BLOCK]
    -> int64, `positions`' shape broadcast against `slots`'."""
    block = table[slots, positions // KEY_BLOCK].long()
    return block * KEY_BLOCK + positions % KEY_BLOCK


def key_rows(table: torch.Tensor, tile_slot: torch.Tensor, key_len: int) -> torch.Tensor:
    """Where each tile's first `key_len` keys lie in a pool viewed as [blocks * KEY_BLOCK,
    ...]: [nt * key_len] int64, tile by tile, position by position (whole blocks in order)."""
    blocks = table.index_select(0, tile_slot)[:, : key_len // KEY_BLOCK].long()
    offsets = torch.arange(KEY_BLOCK, device=table.device)
    return (blocks[:, :, None] * KEY_BLOCK + offsets).view(-1)


def flat_table(slots: int, context: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The block table of a flat cache [slots, context, ...] seen as a pool of KEY_BLOCK-row
    blocks: slot s's blocks in order, after slot s - 1's."""
    per_slot = context // KEY_BLOCK
    table = torch.arange(slots * per_slot, dtype=torch.int32, device=device)
    return table.view(slots, per_slot)


def varlen_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key_len: int,
    key_valid: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence of a batched call at once, grouped KV heads: rows go
    in query tiles of one sequence each, and every tile reads the first `key_len` keys of its
    slot (a multiple of KEY_BLOCK).

    q: [P, Hq, d], already scaled by `d ** -0.5`; k_cache, v_cache: paged pools [blocks,
    KEY_BLOCK, Hkv, d] read through `table` [slots, blocks a sequence] (`pool_index`), or with
    no table flat caches [slots, ctx, Hkv, d] (`rows`, where given, is `key_rows` of the table,
    computed once for every layer of a call); tiles = (tile_row [nt * QT], tile_pos [nt * QT]
    (-1: padding), tile_slot [nt], row_tile [P]); key_valid: the pools' [blocks, KEY_BLOCK]
    (flat: [slots, ctx]) bool or None. -> [P, Hq, d]

    A tile entry sees key j when j <= its position and key_valid[j]. Every reduction over the
    keys has one shape whatever `key_len`: the exponentials are `kernels.common.exp` (no
    length-dependent vector tail), each key block's sums run over its own KEY_BLOCK keys, and
    the blocks are added in order by a sequential scan (`cumsum`), so the blocks past a tile's
    own length, masked, add exact zeros after its last one. A row's bytes therefore depend on
    neither `key_len` nor the other tiles (tests/kernels/test_attention.py pins it at lengths
    where a single softmax and product over all the keys did not: from about 192 keys on)."""
    tile_row, tile_pos, tile_slot, row_tile = tiles
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, nt = k_cache.shape[2], tile_slot.shape[0]
    group, qt = heads // kv_heads, tile_row.shape[0] // nt
    nb = key_len // KEY_BLOCK
    # [nt, QT, Hkv, G, d] -> [nt, Hkv, G * QT, d]: a kv head's query heads as extra rows.
    qs = q.index_select(0, tile_row).view(nt, qt, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    qs = qs.reshape(nt, kv_heads, group * qt, dim)
    if rows is None:  # [nt * L]: each tile's keys in the pool (`key_rows`)
        if table is None:
            table = flat_table(k_cache.shape[0], k_cache.shape[1], q.device)
        rows = key_rows(table, tile_slot, key_len)
    # Gathered head-major, so that the products below read them in place, with no copy.
    keys = _gathered(k_cache, rows, nt, key_len)  # [nt, Hkv, L, d]
    values = _gathered(v_cache, rows, nt, key_len)
    scores = (qs @ keys.transpose(-1, -2)).float().view(nt, kv_heads, group, qt, key_len)
    visible = torch.arange(key_len, device=q.device) <= tile_pos.view(nt, 1, 1, qt, 1)
    if key_valid is not None:
        valid = key_valid.reshape(-1).index_select(0, rows)
        visible = visible & valid.view(nt, 1, 1, 1, key_len)
    scores = scores.masked_fill(~visible, -torch.inf)
    peak = scores.amax(-1, keepdim=True).clamp_min(-1e30)  # a padding entry sees nothing
    probs = exp(scores - peak).view(nt, kv_heads, group, qt, nb, KEY_BLOCK)
    denom = probs.sum(-1).cumsum(-1)[..., -1:].clamp_min(1e-30)  # [nt, Hkv, G, QT, 1]
    probs = (probs / denom[..., None]).to(q.dtype)
    # Each key block's product with its values: [nt, Hkv, nb, G * QT, KB] @ [.., KB, d]
    blocks = probs.view(nt, kv_heads, group * qt, nb, KEY_BLOCK).transpose(2, 3)
    partial = blocks @ values.view(nt, kv_heads, nb, KEY_BLOCK, dim)
    out = partial.cumsum(2)[:, :, -1]  # [nt, Hkv, G * QT, d]
    # [nt, Hkv, G, QT, d] -> [nt * QT, Hq, d]
    out = out.view(nt, kv_heads, group, qt, dim).permute(0, 3, 1, 2, 4).reshape(-1, heads, dim)
    return out[row_tile]


def _gathered(pool: torch.Tensor, rows: torch.Tensor, tiles: int, key_len: int) -> torch.Tensor:
    """A pool's rows [tiles * L] as [tiles, Hkv, L, d], contiguous head-major."""
    flat = pool.reshape(-1, *pool.shape[-2:]).index_select(0, rows)
    return flat.view(tiles, key_len, *pool.shape[-2:]).transpose(1, 2).contiguous()
