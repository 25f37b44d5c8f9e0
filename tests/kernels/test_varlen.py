"""The eager forward's batched forms (every sequence of a call at once) against the
one-sequence references beside them, ragged batches with odd sizes."""

from __future__ import annotations

import pytest
import torch

from gpu_service.model.batch import Layout, Segment, build
from kernels.attention.naive import KEY_BLOCK, tiled_attention, varlen_attention
from kernels.causal_conv1d.naive import causal_conv1d_update, varlen_causal_conv1d
from kernels.gated_delta_rule.naive import (
    chunk_gated_delta_rule,
    prepare_qk_pair,
    recurrent_gated_delta_rule,
    varlen_chunk_gated_delta_rule,
    varlen_recurrent_gated_delta_rule,
)

ATOL = 1e-5  # fp32: the batched forms sum in other orders (matmuls) than the references


def _segs(counts: list[int], starts: list[int]) -> list[Segment]:
    segs, row = [], 0
    for slot, (n, start) in enumerate(zip(counts, starts, strict=True)):
        segs.append(Segment(slot, start, n, row))
        row += n
    return segs


def _batch(segs: list[Segment], query_tile: int = 4, chunk: int = 0):  # noqa: ANN202
    layout = Layout(query_tile=query_tile, key_block=KEY_BLOCK, conv_width=4, chunk=chunk)
    return build(segs, layout, 4, torch.device("cpu"))


@pytest.mark.parametrize(
    ("counts", "starts", "tile"),
    [([1, 4, 3], [5, 70, 0], 4), ([17, 2], [0, 130], 16), ([1], [63], 4)],
    ids=["B3-verify", "B2-prefill-tile16", "B1"],
)
def test_varlen_attention_matches_tiled(counts: list[int], starts: list[int], tile: int) -> None:
    gen = torch.Generator().manual_seed(0)
    segs = _segs(counts, starts)
    batch = _batch(segs, tile)
    heads, kv_heads, dim, ctx = 4, 2, 16, 256
    k_cache = torch.randn(len(segs), ctx, kv_heads, dim, generator=gen)
    v_cache = torch.randn(len(segs), ctx, kv_heads, dim, generator=gen)
    q = torch.randn(batch.padded, heads, dim, generator=gen)
    tiles = (batch.tile_row, batch.tile_pos, batch.tile_slot, batch.row_tile)
    out = varlen_attention(q * dim**-0.5, k_cache, v_cache, tiles, batch.key_len)
    for s in segs:
        end = -(-(s.start + s.count) // KEY_BLOCK) * KEY_BLOCK
        pos = torch.arange(s.start, s.start + s.count)
        rows = slice(s.row, s.row + s.count)
        ref = tiled_attention(q[rows], k_cache[s.slot, :end], v_cache[s.slot, :end], pos)
        torch.testing.assert_close(out[rows], ref, atol=ATOL, rtol=0)


def test_varlen_conv_matches_the_update_form() -> None:
    gen = torch.Generator().manual_seed(1)
    segs = _segs([3, 1, 5], [4, 9, 0])
    batch = _batch(segs)
    channels = 40
    windows = torch.randn(len(segs), 3, channels, generator=gen)
    weight = torch.randn(channels, 4, generator=gen)
    x = torch.randn(batch.padded, channels, generator=gen)
    out, after = varlen_causal_conv1d(x, windows, weight, batch.conv_src)
    for b, s in enumerate(segs):
        rows = slice(s.row, s.row + s.count)
        ref, ref_after = causal_conv1d_update(x[rows], windows[b], weight)
        torch.testing.assert_close(out[rows], ref, atol=ATOL, rtol=0)
        assert torch.equal(after[rows], ref_after), "the windows are copies, exactly"


@pytest.mark.parametrize("chunked", [False, True], ids=["recurrent", "chunked"])
def test_varlen_gated_delta_rule_matches_one_sequence(chunked: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    counts, hk, hv, dk, dv = [3, 1, 70], 2, 4, 16, 8
    batch_size = len(counts)
    steps = 128 if chunked else max(counts)
    q, k = (torch.randn(steps, batch_size, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(steps, batch_size, hv, dv, generator=gen)
    g = -torch.rand(steps, batch_size, hv, generator=gen)
    beta = torch.rand(steps, batch_size, hv, generator=gen)
    state = torch.randn(batch_size, hv, dk, dv, generator=gen)
    valid = (torch.arange(steps)[:, None] < torch.tensor(counts)).float()[..., None]
    qk = torch.cat([q, k], 2).view(steps * batch_size, 2 * hk, dk)
    qq, kk = (t.view(steps, batch_size, hv, dk) for t in prepare_qk_pair(qk, hv))
    if chunked:
        out, final = varlen_chunk_gated_delta_rule(qq, kk, v, g * valid, beta * valid, state)
    else:
        out, states = varlen_recurrent_gated_delta_rule(qq, kk, v, g, beta, state)
    for b, n in enumerate(counts):
        args = (q[:n, b], k[:n, b], v[:n, b], g[:n, b], beta[:n, b], state[b])
        if chunked:
            ref, ref_final = chunk_gated_delta_rule(*args)
            torch.testing.assert_close(final[b], ref_final, atol=ATOL, rtol=0)
        else:
            ref, ref_states = recurrent_gated_delta_rule(*args)
            torch.testing.assert_close(states[:n, b], ref_states, atol=ATOL, rtol=0)
        torch.testing.assert_close(out[:n, b], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("start", [150, 190, 300])
def test_varlen_attention_bytes_do_not_depend_on_the_key_length(start: int) -> None:
    """A tile's rows over its own keys give the same bytes whatever key length the call reads
    (the longest sequence's, in a batch): the blocks past its own are masked and add exact
    zeros. One softmax and one product over every key did not, from about 192 keys on (a
    sequence verified beside a longer one read other bytes than alone)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, ctx, rows = 4, 2, 32, 512, 4
    k_cache, v_cache = (torch.randn(2, ctx, kv_heads, dim, generator=gen) for _ in range(2))
    q = torch.randn(rows, heads, dim, generator=gen)
    tiles = (
        torch.arange(rows),
        torch.arange(start, start + rows),
        torch.tensor([0]),
        torch.arange(rows),
    )
    own = -(-(start + rows) // KEY_BLOCK) * KEY_BLOCK
    expected = varlen_attention(q, k_cache, v_cache, tiles, own)
    for key_len in range(own + KEY_BLOCK, ctx + 1, KEY_BLOCK):
        got = varlen_attention(q, k_cache, v_cache, tiles, key_len)
        assert torch.equal(got, expected), key_len


def test_one_sequence_of_one_head_has_its_bytes_in_a_batch() -> None:
    """A tensor-parallel rank may hold one value head: a sequence verified alone is then one
    matrix, whose products torch multiplies by another kernel unless the rule keeps it among
    two; its outputs and states are the bytes it has beside two others."""
    gen = torch.Generator().manual_seed(4)
    steps, batch_size, dk, dv = 2, 3, 128, 128
    q, k = (torch.randn(steps, batch_size, 1, dk, generator=gen) for _ in range(2))
    v = torch.randn(steps, batch_size, 1, dv, generator=gen)
    g, beta = -torch.rand(steps, batch_size, 1, generator=gen), torch.rand(steps, batch_size, 1)
    state = torch.randn(batch_size, 1, dk, dv, generator=gen)
    out, states = varlen_recurrent_gated_delta_rule(q, k, v, g, beta, state)
    alone = [t[:, :1] for t in (q, k, v, g, beta)]
    one, one_states = varlen_recurrent_gated_delta_rule(*alone, state[:1])
    assert torch.equal(one, out[:, :1]) and torch.equal(one_states, states[:, :1])
