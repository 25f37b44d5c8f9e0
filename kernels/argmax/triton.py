"""Row argmax and its softmax probability in one pass over the vocabulary (online max and
normaliser), a block of rows per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS, VOCAB_BLOCK = 16, 1024


@triton.jit
def _argmax_kernel(x_ptr, top_ptr, conf_ptr, n_rows, vocab, BM: tl.constexpr, BV: tl.constexpr):
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_m = o_m < n_rows
    b_best = tl.full([BM], float("-inf"), tl.float32)
    b_arg = tl.zeros([BM], tl.int32)
    b_den = tl.zeros([BM], tl.float32)
    for v0 in range(0, vocab, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < vocab
        b_x = tl.load(
            x_ptr + o_m[:, None] * vocab + o_v[None, :],
            mask=m_m[:, None] & m_v[None, :],
            other=float("-inf"),
        ).to(tl.float32)
        b_max = tl.max(b_x, axis=1)
        b_idx = tl.min(tl.where(b_x == b_max[:, None], o_v[None, :], vocab), axis=1)
        b_new = tl.maximum(b_best, b_max)
        b_safe = tl.where(b_new == float("-inf"), 0.0, b_new)
        b_den = b_den * tl.exp(b_best - b_safe) + tl.sum(tl.exp(b_x - b_safe[:, None]), axis=1)
        b_arg = tl.where(b_max > b_best, b_idx, b_arg)
        b_best = b_new
    tl.store(top_ptr + o_m, b_arg, mask=m_m)
    tl.store(conf_ptr + o_m, 1.0 / tl.maximum(b_den, 1e-30), mask=m_m)


def argmax_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [n, V] -> (argmax [n] int64, probability of it [n] fp32)"""
    if logits.dim() != 2:
        raise ValueError(f"argmax_confidence takes [rows, vocab] logits, got {logits.dim()} dims")
    x = logits.contiguous()
    rows, vocab = x.shape
    top = torch.empty(rows, dtype=torch.int32, device=x.device)
    conf = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _argmax_kernel[(triton.cdiv(rows, ROWS),)](
            x, top, conf, rows, vocab, BM=ROWS, BV=min(VOCAB_BLOCK, triton.next_power_of_2(vocab))
        )
    return top.long(), conf
