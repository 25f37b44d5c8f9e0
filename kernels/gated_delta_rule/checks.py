"""The input check both gated delta rule kernels run on the host before a launch: a kernel
reads whatever its pointers reach, so a tensor of the wrong shape gives wrong numbers, not an
error."""

from __future__ import annotations

import torch


def _expect(op: str, name: str, x: torch.Tensor, shape: tuple[int, ...], dims: str) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(
            f"{op}: {name} has shape {tuple(x.shape)}; it must be {dims} = {shape}, as q and v give"
        )


def check_inputs(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pools: dict[str, torch.Tensor],
) -> tuple[int, int, int, int, int]:
    """Each tensor against the sizes q and v give, each named in its own refusal.
    q, k: [T, Hk, dk]; v: [T, Hv, dv]; g, beta: [T, Hv]; each pool: [*, Hv, dk, dv] fp32
    -> (T, Hk, Hv, dk, dv)"""
    if q.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"{op}: q is [T, Hk, dk] and v [T, Hv, dv]; they have {q.dim()} and {v.dim()} dims"
        )
    t_rows, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    _expect(op, "k", k, (t_rows, hk, dk), "[T, Hk, dk]")
    _expect(op, "v", v, (t_rows, hv, dv), "[T, Hv, dv]")
    _expect(op, "g", g, (t_rows, hv), "[T, Hv]")
    _expect(op, "beta", beta, (t_rows, hv), "[T, Hv]")
    if hv % hk:
        raise ValueError(f"{op}: {hv} value heads do not group over {hk} key heads")
    for name, pool in pools.items():
        if pool.dtype != torch.float32:
            raise ValueError(f"{op}: {name} is {pool.dtype}; the GDN state is fp32")
        _expect(op, name, pool, (*pool.shape[:1], hv, dk, dv), "[*, Hv, dk, dv]")
    return t_rows, hk, hv, dk, dv
