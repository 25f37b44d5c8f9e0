"""Qwen's multimodal RoPE positions (transformers' `get_rope_index` for Qwen3.5) over a
sequence's text and image tokens, and the RoPE rows they give.

A position has three streams (time, height, width). A text token's are equal; an image's
tokens, laid out t x h x w (h and w in merged tokens), start where the text before it left
off: token (i, r, c) sits at (start + i, start + r, start + c), and the text after the image
goes on from start + max(h, w). So the text after images sits at its sequence position plus a
shift (negative), which the sequence keeps for its decode, verify and drafts; a text-only
sequence's shift is 0 and its positions are its sequence positions, as before.

The rotary frequencies are split among the streams as transformers' Qwen3.5 interleaves them:
frequency j follows the height stream when j % 3 == 1 and j < 3 * mrope_section[1], the width
stream when j % 3 == 2 and j < 3 * mrope_section[2], the time stream otherwise."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SeqImage:
    """One image's tokens in a sequence."""

    first: int  # the sequence position of its first image token
    grid: tuple[int, int, int]  # (t, h, w) in image tokens: the patch grid's h, w merged
    start: int  # the RoPE position its first token takes in every stream
    # Its tokens' embeddings [count, hidden] from the tower, kept while some of its tokens
    # are not prefilled yet (a chunk may end inside an image); None once they all are.
    embeds: torch.Tensor | None = None

    @property
    def count(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def end(self) -> int:
        """The sequence position after its last token."""
        return self.first + self.count

    @property
    def shift(self) -> int:
        """RoPE position minus sequence position of the text after it."""
        return self.start + max(self.grid[1], self.grid[2]) - self.end


def shift_after(spans: Sequence[SeqImage]) -> int:
    """The RoPE shift of the text after every span (0 without one)."""
    return spans[-1].shift if spans else 0


def positions(spans: Sequence[SeqImage], where: Sequence[int]) -> np.ndarray:
    """The RoPE positions [3, n] (time, height, width) of sequence positions `where`."""
    p = np.asarray(where, dtype=np.int64)
    out = np.broadcast_to(p, (3, len(p))).copy()
    for s in spans:
        after = p >= s.end
        out[:, after] = p[after] + s.shift
        inside = (p >= s.first) & ~after
        j = p[inside] - s.first
        _, h, w = s.grid
        out[0, inside] = s.start + j // (h * w)
        out[1, inside] = s.start + (j // w) % h
        out[2, inside] = s.start + j % w
    return out


def streams(section: Sequence[int], rotary_dim: int) -> torch.Tensor:
    """The stream (0 time, 1 height, 2 width) of each rotary column: [rotary_dim] int64, the
    half's frequencies repeated (rotate-half)."""
    j = torch.arange(rotary_dim // 2)
    h = (j % 3 == 1) & (j < 3 * section[1])
    w = (j % 3 == 2) & (j < 3 * section[2])
    half = torch.where(h, 1, torch.where(w, 2, 0))
    return torch.cat([half, half])


def rope_rows(table: torch.Tensor, pos: torch.Tensor, column_streams: torch.Tensor) -> torch.Tensor:
    """table: [ctx, 2, rot] (cos, signed sin by position), pos: [3, P] -> [P, 2, rot]: each
    column's value at its stream's position (a text row's bytes are its table row's)."""
    rows = table[pos]  # [3, P, 2, rot]
    col = column_streams.to(table.device)
    return torch.where(col == 1, rows[1], torch.where(col == 2, rows[2], rows[0]))


@dataclass(frozen=True)
class ImageRows:
    """What a call's images change in its forward: every row's RoPE [P, 2, rot] (from its
    three position streams), and the rows that are image tokens [M] with their embeddings
    [M, H], which replace the image token's embedding (none in a drafter's pass)."""

    rope: torch.Tensor
    rows: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
