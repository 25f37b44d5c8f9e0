"""Qwen3-Next's routed experts in plain torch: the router's top-k, and each expert's SwiGLU MLP
over only the rows routed to it, the eager forward's path and the reference of the fused Triton
kernel beside it.

Pairs (row, expert) are stably sorted by expert; each expert that was hit runs one GEMM over its
rows, padded to `ROW_TILE` (the CPU GEMM then gives a row the same bytes whatever rows share the
call); a row's contributions are then added in increasing expert-index order, so a row's bytes
depend on neither its batch nor the other rows' experts. Adding the experts a row did not choose
would add exact zeros: this is the dense sum over every expert, byte for byte.
"""

from __future__ import annotations

import torch

from kernels.common import ROW_TILE, pad_rows, silu


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [P, E] fp32 -> (weights [P, k] fp32, experts [P, k] int64): softmax, the k most
    probable experts, renormalised to sum to 1 when asked (in the top-k's order), then each
    row's experts sorted by increasing index, their weights alike."""
    probs = torch.softmax(logits, -1)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    experts, order = experts.sort(-1)
    return weights.gather(-1, order), experts


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU. x: [M, H] (M a multiple of ROW_TILE), w13: [H, 2I] (gate columns,
    then up), w2: [I, H] -> [M, H]"""
    gate_up = torch.mm(x, w13)
    inner = w2.shape[0]
    return torch.mm(silu(gate_up)[:, :inner] * gate_up[:, inner:], w2)


def sum_in_expert_order(contributions: torch.Tensor) -> torch.Tensor:
    """contributions: [P, k, H], each row's in increasing expert index -> [P, H]: k adds in the
    contributions' dtype, in that order."""
    out = torch.zeros_like(contributions[:, 0])
    for j in range(contributions.shape[1]):
        out = out + contributions[:, j]
    return out


def routed_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """x: [P, H], w13: [E, H, 2I], w2: [E, I, H], experts: [P, k] int64 (sorted per row),
    weights: [P, k] in x's dtype -> [P, H]: sum over j of weights[:, j] * MLP_experts[:, j](x)."""
    rows, top_k = experts.shape
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # [P k]: pairs by expert, rows ascending
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    contributions = x.new_zeros(rows * top_k, x.shape[1])
    scale = weights.reshape(-1, 1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        y = expert_mlp(pad_rows(x.index_select(0, pairs // top_k), ROW_TILE), w13[e], w2[e])
        contributions.index_copy_(0, pairs, y[:n] * scale.index_select(0, pairs))
    return sum_in_expert_order(contributions.view(rows, top_k, -1))


def dense_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The same sum with every expert run over every row, weighted by zero where it was not
    chosen: what the engine computed before routing, kept as the routed path's byte-exact
    reference. Same arguments as `routed_moe`."""
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=x.dtype, device=x.device)
    dense.scatter_(1, experts, weights)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        out = out + expert_mlp(x, w13[e], w2[e]) * dense[:, e : e + 1]
    return out
