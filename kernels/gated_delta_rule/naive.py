"""Gated delta rule, plain torch: the recurrent form (verify and decode) and the chunked form
(prefill), for one sequence.

Per value head h (key head `h // (Hv / Hk)`), with l2-normalised q and k and q scaled by
`dk ** -0.5`, state `S: [dk, dv]` in fp32:

    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t
"""

from __future__ import annotations

import functools

import torch

from kernels.common import decay_exp, exp


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """l2-norm, scale and expand q, k to the value heads. q, k: [T, Hk, dk] -> [T, Hv, dk] fp32"""
    ratio = num_v_heads // q.shape[1]
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k = _l2norm(k.float())
    return q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, keeping the state after every row.

    q, k: [T, Hk, dk]; v: [T, Hv, dv]; g, beta: [T, Hv]; state: [Hv, dk, dv] fp32
    -> (o [T, Hv, dv] fp32, states [T, Hv, dk, dv] fp32)
    """
    q, k = prepare_qk(q, k, v.shape[1])
    v, decay, beta = v.float(), exp(g.float()), beta.float()
    s = state.float()
    outs, states = [], []
    for t in range(q.shape[0]):
        s = s * decay[t, :, None, None]
        kv = (s * k[t, :, :, None]).sum(-2)  # [Hv, dv]
        delta = (v[t] - kv) * beta[t, :, None]
        s = s + k[t, :, :, None] * delta[:, None, :]
        outs.append((s * q[t, :, :, None]).sum(-2))
        states.append(s)
    return torch.stack(outs), torch.stack(states)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (WY) form: same math as the recurrent form, matmuls within each chunk.

    Shapes as `recurrent_gated_delta_rule`; returns (o [T, Hv, dv], final state [Hv, dk, dv]).
    """
    length = q.shape[0]
    q, k = prepare_qk(q, k, v.shape[1])
    pad = (-length) % chunk_size

    # [T, H, d] -> [H, N, C, d]: heads first, then chunks of C rows.
    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.transpose(0, 1).reshape(x.shape[1], -1, chunk_size, *x.shape[2:])

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g.unsqueeze(-1))[..., 0], chunks(beta.unsqueeze(-1))[..., 0]  # [H, N, C]
    g = g.cumsum(-1)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    lower = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device))
    strict = torch.tril(lower, diagonal=-1)
    decay = decay_exp(g[..., :, None] - g[..., None, :]).masked_fill(~lower, 0)
    # Solve (I + A) T = I for the strictly lower A of each chunk, row by row.
    a = -(k_beta @ k.transpose(-1, -2) * decay).masked_fill(~strict, 0)
    for i in range(1, chunk_size):
        a[..., i, :i] = a[..., i, :i] + (a[..., i, :i, None] * a[..., :i, :i]).sum(-2)
    a = a + torch.eye(chunk_size, device=q.device)
    u = a @ v_beta  # [H, N, C, dv]
    w = a @ (k_beta * decay_exp(g)[..., None])  # [H, N, C, dk]
    s = state.float()
    out = torch.empty_like(u)
    for n in range(q.shape[1]):
        qn, kn, gn = q[:, n], k[:, n], g[:, n]
        attn = (qn @ kn.transpose(-1, -2) * decay[:, n]).masked_fill(~lower, 0)
        v_new = u[:, n] - w[:, n] @ s
        out[:, n] = (qn * decay_exp(gn)[..., None]) @ s + attn @ v_new
        tail = decay_exp(gn[:, -1:] - gn)[..., None]  # decay from each row to the chunk's end
        s = s * decay_exp(gn[:, -1])[:, None, None] + (kn * tail).transpose(-1, -2) @ v_new
    o = out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].transpose(0, 1)
    return o, s


@functools.cache
def _pair_tables(
    heads: int, dim: int, num_v_heads: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale [2 Hk, 1]: q's heads by dk ** -0.5, k's by 1; for each value head, the row of
    its q head and of its k head [2, Hv])"""
    scale = torch.ones(2 * heads, 1, device=device)
    scale[:heads] = dim**-0.5
    key_head = torch.arange(num_v_heads, device=device) // (num_v_heads // heads)
    return scale, torch.stack([key_head, key_head + heads])


def prepare_qk_pair(qk: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`prepare_qk` on q and k side by side, in one pass.
    qk: [N, 2 * Hk, dk] (q's heads, then k's) -> q, k: [N, Hv, dk] fp32"""
    scale, rows = _pair_tables(qk.shape[1] // 2, qk.shape[2], num_v_heads, qk.device)
    qk = _l2norm(qk.float()) * scale
    return qk[:, rows[0]], qk[:, rows[1]]


def varlen_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_gated_delta_rule` for B sequences at once, a step over all of them at a time,
    the products as batched matmuls of one shape per step.

    q, k: [T, B, Hv, dk] (from `prepare_qk_pair`); v: [T, B, Hv, dv]; g, beta: [T, B, Hv];
    state: [B, Hv, dk, dv] -> (o [T, B, Hv, dv] fp32, states [T, B, Hv, dk, dv] fp32). A
    sequence with fewer rows than T gets padding steps after its own; their outputs and
    states are the caller's to drop."""
    steps, batch, heads, dk = k.shape
    if batch * heads == 1:
        # torch.bmm over one matrix takes another kernel than over several, so a sequence's
        # bytes would differ alone and in a batch where it holds one head (a tensor-parallel
        # rank's share of 4 value heads at TP 4): a zero sequence keeps it among two.
        qq, kk, vv, gg, bb = (torch.cat([t, torch.zeros_like(t)], 1) for t in (q, k, v, g, beta))
        two = torch.cat([state, torch.zeros_like(state)])
        o, every = varlen_recurrent_gated_delta_rule(qq, kk, vv, gg, bb, two)
        return o[:, :1], every[:, :1]
    dv, n = v.shape[-1], batch * heads
    kb = (k * beta.float()[..., None]).reshape(steps, n, dk, 1)
    decay = exp(g.float()).reshape(steps, n, 1, 1)
    s = state.float().reshape(n, dk, dv)
    states = []
    for t in range(steps):
        s = s * decay[t]
        kv = torch.bmm(k[t].reshape(n, 1, dk), s).view(batch, heads, dv)  # S^T k
        delta = (v[t].float() - kv).view(n, 1, dv)
        s = torch.baddbmm(s, kb[t], delta)  # S + (beta k) (v - S^T k)^T
        states.append(s)
    every = torch.stack(states)  # [T, n, dk, dv]
    o = torch.bmm(q.reshape(steps * n, 1, dk), every.view(steps * n, dk, dv))
    return o.view(steps, batch, heads, dv), every.view(steps, batch, heads, dk, dv)


def varlen_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_gated_delta_rule` for B sequences at once, T a multiple of `chunk_size`.
    Padding rows must carry g = 0 and beta = 0: they then leave the state as it was.

    Shapes as `varlen_recurrent_gated_delta_rule`; returns (o [T, B, Hv, dv], final state
    [B, Hv, dk, dv])."""
    steps, batch, heads = q.shape[0], q.shape[1], v.shape[2]

    # [T, B, H, d] -> [B, H, N, C, d]: heads first, then chunks of C rows.
    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = x.float().permute(1, 2, 0, 3)
        return x.reshape(batch, heads, steps // chunk_size, chunk_size, x.shape[-1])

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g.unsqueeze(-1))[..., 0], chunks(beta.unsqueeze(-1))[..., 0]  # [B, H, N, C]
    g = g.cumsum(-1)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    lower = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device))
    # Zero above the diagonal, so that the products below need no mask of their own.
    decay = decay_exp(g[..., :, None] - g[..., None, :]).masked_fill_(~lower, 0)
    # (I + A)^-1 for the strictly lower A of each chunk, as one unit-lower triangular solve
    # over every chunk of every sequence (each matrix solved on its own: batch invariant).
    # The solve reads only the strictly lower triangle, so A needs neither mask nor identity.
    eye = torch.eye(chunk_size, device=q.device)
    a_full = k_beta @ k.transpose(-1, -2) * decay
    a = torch.linalg.solve_triangular(a_full, eye, upper=False, unitriangular=True)
    u = a @ v_beta  # [B, H, N, C, dv]
    w = a @ (k_beta * decay_exp(g)[..., None])  # [B, H, N, C, dk]
    s = state.float()
    out = torch.empty_like(u)
    for n in range(q.shape[2]):
        qn, kn, gn = q[:, :, n], k[:, :, n], g[:, :, n]
        attn = qn @ kn.transpose(-1, -2) * decay[:, :, n]
        v_new = u[:, :, n] - w[:, :, n] @ s
        out[:, :, n] = (qn * decay_exp(gn)[..., None]) @ s + attn @ v_new
        tail = decay_exp(gn[..., -1:] - gn)[..., None]  # decay from each row to the chunk's end
        s = s * decay_exp(gn[..., -1])[..., None, None] + (kn * tail).transpose(-1, -2) @ v_new
    o = out.reshape(batch, heads, steps, out.shape[-1]).permute(2, 0, 1, 3)
    return o, s
