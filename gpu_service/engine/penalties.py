"""Logit bias and penalties on the rows the service judges (`protos.model.Penalties`): steps 1
and 2 of the logits pipeline (`logits.py`, which states the order and runs them).

A row's counts are those of every token before the one it predicts: the sequence's tokens in
the cache, then the rows of the call up to and including its own (for a verify, the last
committed token and the drafts before it). So a draft is judged with the counts that decoding
one token at a time would have had in its place, and speculation keeps that output, greedy or
sampled (the rejection test reads the adjusted target). As vLLM's: the bias added, then the
repetition penalty over tokens of the prompt or the output, then frequency and presence over
the output, in fp32 as vLLM and transformers compute them.

Each penalized sequence keeps its output's count of every id and the ids its prompt or output
holds (`Counts`, over this rank's columns under tensor parallelism), brought up to date with
only the tokens committed since its last call, so a long output costs no more a step than a
short one. A call adjusts every penalized sequence's rows at once, with no read back, in one of
two ways that round alike: on a GPU over every column (`_dense`, vLLM's way: the counts live
on the device, and the work is the vocabulary's width whatever was seen); on the CPU over only
the columns some row has seen or biases (`_sparse`: the counts live in host memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_service.memory.sequence import Counts, SeqState
from protos.model import Penalties


def _empty(pen: Penalties, held: tuple[int, int], device: torch.device) -> Counts:
    lo, hi = held
    bias = torch.zeros(hi - lo, dtype=torch.float32)
    for t, b in zip(pen.bias_ids, pen.bias_values, strict=True):
        if lo <= t < hi:
            bias[t - lo] = b
    out = torch.zeros(hi - lo, dtype=torch.float32, device=device)
    return Counts(0, out, torch.zeros_like(out, dtype=torch.bool), bias.to(device))


def _sync(
    seq: SeqState, pen: Penalties, held: tuple[int, int], n: int, device: torch.device
) -> Counts:
    """`seq`'s counts over its first `n` tokens: only those past the last call's added (fewer
    than counted, or another device, start them again)."""
    c = seq.counts
    if c is None or n < c.synced or c.out.device != device:
        c = seq.counts = _empty(pen, held, device)
    lo, hi = held
    fresh = np.asarray(seq.tokens[c.synced : n], dtype=np.int64)
    inside = (fresh >= lo) & (fresh < hi)
    out = fresh[inside & (np.arange(c.synced, n) >= pen.prompt_tokens)] - lo
    if inside.any():
        out_t = torch.from_numpy(out).to(device)
        c.out.index_add_(0, out_t, torch.ones(len(out), device=device))
        c.seen[torch.from_numpy(fresh[inside] - lo).to(device)] = True
    c.synced = n
    return c


# On a GPU: the bytes a penalized sequence keeps a held token id (its counts fp32, the ids seen
# bool, its bias fp32), and the most fp32 [rows, held ids] tensors `_dense` holds at once (the
# counts and repetition factors of its rows, the logits, the bias, and the formula's steps).
COUNTS_BYTES = 9
DENSE_COPIES = 8


def device_bytes(width: int, slots: int, rows: int) -> tuple[int, int]:
    """What penalties take on a GPU over `width` held token ids: (every slot's counts, one
    call's transient, for `rows` rows)."""
    return slots * width * COUNTS_BYTES, DENSE_COPIES * rows * width * 4


@dataclass(frozen=True)
class Rows:
    """The penalized rows of one call, on the host: where they sit, whose they are, and which
    of the call's own tokens each counts."""

    index: np.ndarray  # [R] the logits rows
    owner: np.ndarray  # [R] each row's sequence, an index into `counts`
    counts: list[Counts]
    scalars: np.ndarray  # [R, 3] fp32: repetition, frequency, presence
    later: np.ndarray  # [T] a row that counts one of the call's tokens
    token: np.ndarray  # [T] that token (a held column)
    is_out: np.ndarray  # [T] bool: it is output (else still prompt)


def penalize(
    logits: torch.Tensor,
    held: tuple[int, int],
    seqs: Sequence[SeqState],
    before: Sequence[int],
    rows: Sequence[Sequence[int]],
    starts: Sequence[int],
    dense: bool | None = None,
) -> None:
    """logits: [R, held width], adjusted in place for every penalized sequence among `seqs`:
    sequence i's rows are starts[i] .. + len(rows[i]), and row j of them predicts the token
    after its first before[i] tokens and rows[i][: j + 1]; `held` the token ids [lo, hi)
    whose columns they are (all of them but under tensor parallelism). `dense`: over every
    column (None: off the CPU)."""
    chosen = [i for i, s in enumerate(seqs) if s.penalties is not None and s.penalties.active]
    if not chosen:
        return
    dense = logits.device.type != "cpu" if dense is None else dense
    home = logits.device if dense else torch.device("cpu")
    pens = [_pen(seqs[i]) for i in chosen]
    counts = [_sync(seqs[i], p, held, before[i], home) for i, p in zip(chosen, pens, strict=True)]
    ks = [len(rows[i]) for i in chosen]
    owner = np.repeat(np.arange(len(chosen)), ks)
    index = np.concatenate([np.arange(k) + starts[i] for i, k in zip(chosen, ks, strict=True)])
    tokens = np.concatenate([np.asarray(rows[i], dtype=np.int64) for i in chosen]) - held[0]
    place = np.concatenate([np.arange(k) + before[i] for i, k in zip(chosen, ks, strict=True)])
    firsts = np.asarray([p.prompt_tokens for p in pens])[owner]
    ok = np.flatnonzero((tokens >= 0) & (tokens < held[1] - held[0]))
    # Row r's token is counted by rows r .. its sequence's last.
    reach = np.cumsum(ks)[owner][ok] - ok
    later = (
        np.repeat(ok, reach) + np.arange(reach.sum()) - np.repeat(np.cumsum(reach) - reach, reach)
    )
    scalars = np.asarray([[p.repetition, p.frequency, p.presence] for p in pens], np.float32)
    plan = Rows(
        index,
        owner,
        counts,
        scalars[owner],
        later,
        np.repeat(tokens[ok], reach),
        np.repeat(place[ok] >= firsts[ok], reach),
    )
    (_dense if dense else _sparse)(logits, plan)


def _pen(seq: SeqState) -> Penalties:
    assert seq.penalties is not None
    return seq.penalties


def _dense(logits: torch.Tensor, p: Rows) -> None:
    """Every column of the rows, from counts on the device; at most `DENSE_COPIES` fp32
    [rows, width] tensors live at once."""
    device = logits.device
    # Chosen on the host: a mask applied on the device would read its count back.
    counted = (p.later[p.is_out], p.token[p.is_out])
    index, later, token, out_rows, out_tokens = (
        torch.from_numpy(a).to(device) for a in (p.index, p.later, p.token, *counted)
    )
    owners = [p.counts[o] for o in p.owner.tolist()]
    out = torch.stack([c.out for c in owners])
    out.index_put_((out_rows, out_tokens), torch.ones((), device=device), accumulate=True)
    seen = torch.stack([c.seen for c in owners])
    seen[later, token] = True
    rep, freq, pres = torch.from_numpy(p.scalars).to(device).T[:, :, None]
    rep = torch.where(seen, rep, 1.0)
    del seen
    x = logits[index].float()
    x += torch.stack([c.bias for c in owners])
    x = torch.where(x > 0, x / rep, x * rep)
    del rep
    x -= freq * out
    x -= pres * (out > 0).float()
    logits[index] = x.to(logits.dtype)


def _sparse(logits: torch.Tensor, p: Rows) -> None:
    """Only the columns some row has seen or biases, from counts in host memory; the products
    in fp32 here (rounded as the device would round them), the sums there."""
    width = logits.shape[1]
    touched = np.zeros(width, dtype=bool)
    for c in p.counts:
        touched |= c.seen.numpy() | (c.bias.numpy() != 0)
    touched[p.token] = True
    cols = np.flatnonzero(touched)
    out = np.stack([c.out.numpy()[cols] for c in p.counts])[p.owner]
    seen = np.stack([c.seen.numpy()[cols] for c in p.counts])[p.owner]
    bias = np.stack([c.bias.numpy()[cols] for c in p.counts])[p.owner]
    at = np.searchsorted(cols, p.token)
    np.add.at(out, (p.later[p.is_out], at[p.is_out]), 1.0)
    seen[p.later, at] = True
    rep, freq, pres = p.scalars.T[:, :, None]
    rep = np.where(seen, rep, np.float32(1))
    minus = freq * out, pres * (out > 0).astype(np.float32)
    flat = (p.index[:, None] * width + cols[None, :]).reshape(-1)
    device = logits.device
    flat_t, bias_t, rep_t, freq_t, pres_t = (
        torch.from_numpy(a).to(device) for a in (flat, bias, rep, *minus)
    )
    view = logits.view(-1)
    x = view.index_select(0, flat_t).view(bias.shape).float() + bias_t
    if (rep != 1).any():
        x = torch.where(x > 0, x / rep_t, x * rep_t)
    view.index_copy_(0, flat_t, (x - freq_t - pres_t).to(logits.dtype).view(-1))
