"""The one logits pipeline on the service: what a call's logits go through before anything
reads them, in one order for prefill, verify and the fused `decode_step` (vLLM v1's
`Sampler`'s order):

1. the logit bias,
2. the repetition, frequency and presence penalties (1 and 2: `penalize`, penalties.py, which
   keeps each sequence's counts),
3. the allowed ids (`allow`): every other column at -inf,
4. the grammar masks (`mask`): each masked row at -inf outside its mask.
   `process_rows` runs 1 to 4 on a call's rows, in place; its result is the processed logits
   the greedy verdict's argmax (`HybridModel.argmax_logprob`) and every logprob read.
5. For a sampled row only, on a copy: temperature, top-k, min-p, top-p (`distribution`); the
   draws read its probabilities.
6. The fp32 log-softmax of the processed logits (`log_softmax_top`): the log-probabilities a
   response lists, of the greedy argmax and of a sampled draw alike (5 shapes which token is
   drawn, not the log-probability reported for it).

Steps 1 to 4 run on this rank's columns under tensor parallelism (`held`, the token ids
[lo, hi) the logits' columns are); 5 and 6 on every column, gathered. A prompt's scores are the
model's raw log-softmax (6 alone): they score the prompt, not a row the service chose.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gpu_service.engine.penalties import penalize
from gpu_service.memory.sequence import SeqState
from gpu_service.model.backend import upload
from protos import checks
from protos.model import InvalidArgument, Sampling


def process_rows(
    logits: torch.Tensor,
    held: tuple[int, int],
    seqs: Sequence[SeqState],
    before: Sequence[int],
    rows: Sequence[Sequence[int]],
    starts: Sequence[int],
    masks: dict[int, torch.Tensor],
) -> None:
    """Steps 1 to 4 on a call's rows, in place. logits: [R, held width]; sequence i's rows
    are starts[i] .. + len(rows[i]), row j of them predicting the token after its first
    before[i] tokens and rows[i][: j + 1]; masks: row -> allowed [held width] bool."""
    penalize(logits, held, seqs, before, rows, starts)
    allow(logits, held, seqs, rows, starts)
    mask(logits, masks)


def allow(
    logits: torch.Tensor,
    held: tuple[int, int],
    seqs: Sequence[SeqState],
    rows: Sequence[Sequence[int]],
    starts: Sequence[int],
) -> None:
    """Step 3: the rows of each sequence with allowed ids keep only the columns of those ids
    that this rank holds (vLLM's allowed_token_ids)."""
    lo, hi = held
    for i, s in enumerate(seqs):
        if s.penalties is None or not s.penalties.allowed_ids:
            continue
        keep = torch.zeros(hi - lo, dtype=torch.bool, device=logits.device)
        inside = [t - lo for t in s.penalties.allowed_ids if lo <= t < hi]
        if inside:
            keep[torch.tensor(inside, dtype=torch.long, device=logits.device)] = True
        a, b = starts[i], starts[i] + len(rows[i])
        logits[a:b] = logits[a:b].masked_fill(~keep, float("-inf"))


def mask(logits: torch.Tensor, masks: dict[int, torch.Tensor]) -> None:
    """Step 4: each masked row at -inf outside its mask. masks: row -> allowed [width] bool"""
    for row, allowed in masks.items():
        logits[row] = logits[row].masked_fill(~allowed.to(logits.device), float("-inf"))


def grammar_masks(masks: dict[int, bytes], rows: int, vocab_size: int) -> dict[int, torch.Tensor]:
    """Allowed-token bitmasks (bit t of the little-endian words: token t) as bool rows over
    every token id, checked: one per row at most, the right size, at least one token allowed."""
    words = -(-vocab_size // 32)
    out = {}
    for row, bits in masks.items():
        if not bits:
            continue
        checks.within("a masked row", row, 0, rows - 1)
        # Grammar engines may round up to whole words past the vocabulary; ignored.
        if len(bits) < 4 * words or len(bits) % 4:
            raise InvalidArgument(
                f"the mask of row {row} has {len(bits)} bytes; a vocabulary of "
                f"{vocab_size} takes {4 * words} or more, whole 32-bit words"
            )
        allowed = torch.from_numpy(
            np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")
        )[:vocab_size].bool()
        if not allowed.any():
            raise InvalidArgument(f"the mask of row {row} allows no token")
        out[row] = allowed
    return out


def distribution(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Step 5: temperature, top-k, min-p, top-p, in vLLM's order (min-p cuts before top-p
    sums). logits: [n, V] -> probabilities [n, V] in fp64 (a column at -inf stays at 0)."""
    x = logits.double() / s.temperature
    if 0 < s.top_k < x.shape[-1]:  # 0 or -1: no limit
        kth = x.topk(s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if s.min_p > 0.0:
        p = p.masked_fill(p < s.min_p * p.max(-1, keepdim=True).values, 0.0)
        p = p / p.sum(-1, keepdim=True)
    if 0.0 < s.top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(-1) - sorted_p >= s.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, order, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def log_softmax_top(
    logits: torch.Tensor, after: list[int], top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 6: the log-probabilities a response lists, fp32. logits: [n, V], every column ->
    (log-softmax [n, V], row j's of `after[j]` for the first len(after) rows [len(after)],
    each row's `top` most probable: values [n, top] and ids [n, top], most probable first)"""
    logp = torch.log_softmax(logits, -1, dtype=torch.float32)
    (index,) = upload(logp.device, after)
    chosen = logp[: len(after)].gather(-1, index[:, None])[:, 0]
    top_values, top_ids = logp.topk(top, -1)
    return logp, chosen, top_values, top_ids
