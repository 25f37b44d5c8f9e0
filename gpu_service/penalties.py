"""Penalties and logit bias on the rows the service judges (`protos.model.Penalties`).

A row's counts are those of every token before the one it predicts: the sequence's tokens in
the cache, then the rows of the call up to and including its own (for a verify, the last
committed token and the drafts before it). So a draft is judged with the counts that decoding
one token at a time would have had in its place, and speculation keeps that output, greedy or
sampled (the rejection test reads the adjusted target). The order is vLLM's: the bias added,
then the repetition penalty over tokens of the prompt or the output, then frequency and
presence over the output. Only the columns of tokens seen or biased are touched; their counts
go to the device as one small [rows, ids] table a sequence, computed in fp32 as vLLM and
transformers compute them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from gpu_service.sequence import SeqState
from protos.model import Penalties


class Table(NamedTuple):
    """What a sequence's rows need: the token ids touched and, per row, their counts."""

    ids: np.ndarray  # [U] int64, ascending
    counts: np.ndarray  # [k, U] fp32: times the output holds each id before the row's token
    in_prompt: np.ndarray  # [k, U] bool: the prompt holds the id
    bias: np.ndarray  # [U] fp32


def _prompt_ids(seq: SeqState, base: Sequence[int], prompt_tokens: int) -> np.ndarray:
    """The distinct ids of the prompt's tokens in `base`, kept once the prompt is whole."""
    if seq.prompt_seen is not None:
        return np.asarray(seq.prompt_seen, dtype=np.int64)
    seen = np.unique(np.asarray(base[:prompt_tokens], dtype=np.int64))
    if len(base) >= prompt_tokens:
        seq.prompt_seen = tuple(seen.tolist())
    return seen


def table(seq: SeqState, pen: Penalties, base: Sequence[int], rows: Sequence[int]) -> Table:
    """Row j of `rows` predicts the token after base + rows[: j + 1]."""
    first_out = pen.prompt_tokens
    prompt = _prompt_ids(seq, base, first_out)
    out = np.asarray(base[first_out:], dtype=np.int64)
    new = np.asarray(rows, dtype=np.int64)
    bias_ids = np.asarray(pen.bias_ids, dtype=np.int64)
    ids = np.unique(np.concatenate([prompt, out, new, bias_ids]))
    width = ids.shape[0]
    counts = np.zeros((len(rows), width), dtype=np.float32)
    in_prompt = np.zeros((len(rows), width), dtype=bool)
    counts[:] = np.bincount(np.searchsorted(ids, out), minlength=width)
    in_prompt[:, np.searchsorted(ids, prompt)] = True
    for j, col in enumerate(np.searchsorted(ids, new).tolist()):
        if len(base) + j >= first_out:
            counts[j:, col] += 1
        else:  # a prefill's row still inside the prompt
            in_prompt[j:, col] = True
    bias = np.zeros(width, dtype=np.float32)
    bias[np.searchsorted(ids, bias_ids)] = np.asarray(pen.bias_values, dtype=np.float32)
    return Table(ids, counts, in_prompt, bias)


def penalize(
    logits: torch.Tensor,
    held: tuple[int, int],
    seq: SeqState,
    base: Sequence[int],
    rows: Sequence[int],
) -> None:
    """logits: [k, held width] the rows of `seq` (row j predicts the token after
    base + rows[: j + 1]), adjusted in place; `held` the token ids [lo, hi) whose columns they
    are (all of them but under tensor parallelism)."""
    pen = seq.penalties
    if pen is None or not pen.active:
        return
    t = table(seq, pen, base, rows)
    lo, hi = held
    keep = (t.ids >= lo) & (t.ids < hi)
    if not keep.any():
        return
    device = logits.device
    cols = torch.from_numpy(t.ids[keep] - lo).to(device)
    counts = torch.from_numpy(t.counts[:, keep]).to(device)
    sub = logits[:, cols].float() + torch.from_numpy(t.bias[keep]).to(device)
    if pen.repetition != 1.0:
        seen = torch.from_numpy(t.in_prompt[:, keep]).to(device) | (counts > 0)
        scaled = torch.where(sub > 0, sub / pen.repetition, sub * pen.repetition)
        sub = torch.where(seen, scaled, sub)
    sub = sub - pen.frequency * counts - pen.presence * (counts > 0).float()
    logits[:, cols] = sub.to(logits.dtype)
