"""The chunked gated delta rule over a batch of equal-length sequences from a zero state, with
autograd: the form the trainer runs. Same math as `naive.chunk_gated_delta_rule`; the
within-chunk inverse `(I + L)^-1` is a unit-lower triangular solve instead of the row loop,
so its backward is one call too."""

from __future__ import annotations

import torch

from kernels.gated_delta_rule.naive import prepare_qk


def chunk_gated_delta_rule_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv]; g, beta: [B, T, Hv] -> o [B, T, Hv, dv] fp32"""
    batch, length, heads = v.shape[0], v.shape[1], v.shape[2]
    q, k = prepare_qk(q.flatten(0, 1), k.flatten(0, 1), heads)
    q, k = q.unflatten(0, (batch, length)), k.unflatten(0, (batch, length))
    pad = (-length) % chunk_size

    # [B, T, H, ...] -> [B, H, N, C, ...]
    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x.float(), (0, 0) * (x.dim() - 3) + (0, 0, 0, pad))
        return x.transpose(1, 2).reshape(batch, heads, -1, chunk_size, *x.shape[3:])

    q, k, v = chunks(q), chunks(k), chunks(v)
    g = chunks(g.unsqueeze(-1))[..., 0].cumsum(-1)  # [B, H, N, C]
    beta = chunks(beta.unsqueeze(-1))[..., 0]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    lower = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device))
    strict = torch.tril(lower, diagonal=-1)
    gap = (g[..., :, None] - g[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = gap.exp()
    eye = torch.eye(chunk_size, device=q.device)
    unit_lower = eye + (k_beta @ k.transpose(-1, -2) * decay).masked_fill(~strict, 0)
    inv = torch.linalg.solve_triangular(unit_lower, eye, upper=False, unitriangular=True)
    u = inv @ v_beta  # [B, H, N, C, dv]
    w = inv @ (k_beta * g.exp()[..., None])  # [B, H, N, C, dk]
    s = q.new_zeros(batch, heads, q.shape[-1], v.shape[-1])
    outs = []
    for n in range(q.shape[2]):
        qn, kn, gn = q[:, :, n], k[:, :, n], g[:, :, n]
        attn = (qn @ kn.transpose(-1, -2) * decay[:, :, n]).masked_fill(~lower, 0)
        v_new = u[:, :, n] - w[:, :, n] @ s
        outs.append((qn * gn.exp()[..., None]) @ s + attn @ v_new)
        tail = (gn[..., -1:] - gn).exp()[..., None]
        s = s * gn[..., -1].exp()[..., None, None] + (kn * tail).transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(batch, heads, -1, v.shape[-1])[:, :, :length]
    return o.transpose(1, 2)
