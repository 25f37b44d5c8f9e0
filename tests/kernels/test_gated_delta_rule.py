"""The chunked gated delta rule against the recurrent one, and the recurrent one against the
delta rule written out per head."""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta_rule.naive import chunk_gated_delta_rule, recurrent_gated_delta_rule

SHAPES = [
    (1, 2, 2, 16, 8),
    (7, 1, 2, 16, 16),
    (64, 2, 4, 32, 16),
    (100, 2, 4, 16, 8),
    (130, 1, 1, 8, 8),
]


def _inputs(t: int, hk: int, hv: int, dk: int, dv: int):
    gen = torch.Generator().manual_seed(t * 31 + hv)
    return (
        torch.randn(t, hk, dk, generator=gen),
        torch.randn(t, hk, dk, generator=gen),
        torch.randn(t, hv, dv, generator=gen),
        -torch.rand(t, hv, generator=gen) * 2,
        torch.rand(t, hv, generator=gen),
        torch.randn(hv, dk, dv, generator=gen),
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-Hk{}-Hv{}-dk{}-dv{}".format(*s))
def test_chunked_matches_recurrent(shape: tuple[int, ...]) -> None:
    args = _inputs(*shape)
    o_rec, states = recurrent_gated_delta_rule(*args)
    o_chunk, final = chunk_gated_delta_rule(*args)
    # fp32: the chunked form reassociates sums over up to 64 rows.
    torch.testing.assert_close(o_chunk, o_rec, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, states[-1], atol=1e-5, rtol=1e-4)


def test_recurrent_matches_the_rule_per_head() -> None:
    q, k, v, g, beta, s0 = _inputs(5, 2, 4, 8, 4)
    o, states = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    for h in range(4):
        kh = h // 2
        s = s0[h].clone()
        for t in range(5):
            qt = q[t, kh] / q[t, kh].norm() * 8**-0.5
            kt = k[t, kh] / k[t, kh].norm()
            s = torch.exp(g[t, h]) * s
            s = s + torch.outer(kt, beta[t, h] * (v[t, h] - s.T @ kt))
            torch.testing.assert_close(o[t, h], s.T @ qt, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(states[t, h], s, atol=1e-5, rtol=1e-4)
