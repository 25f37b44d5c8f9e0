"""The gated delta rule: chunked against recurrent (naive), the naive recurrence against the
rule written out per head, and the Triton kernels against the naive forms (ragged, grouped
heads, slots out of order, value columns split over programs) and against themselves run on
one sequence at a time."""

from __future__ import annotations

import re

import pytest
import torch

from kernels.gated_delta_rule import chunk, naive, recurrent
from tests.kernels.device import on

# Slow: the chunked kernel under the Triton interpreter.
pytestmark = pytest.mark.slow

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
def test_naive_chunked_matches_recurrent(shape: tuple[int, ...]) -> None:
    args = _inputs(*shape)
    o_rec, states = naive.recurrent_gated_delta_rule(*args)
    o_chunk, final = naive.chunk_gated_delta_rule(*args)
    # fp32: the chunked form reassociates sums over up to 64 rows.
    torch.testing.assert_close(o_chunk, o_rec, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, states[-1], atol=1e-5, rtol=1e-4)


def test_recurrent_matches_the_rule_per_head() -> None:
    q, k, v, g, beta, s0 = _inputs(5, 2, 4, 8, 4)
    o, states = naive.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
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


def _batch(lens: list[int], hk: int, hv: int, dk: int, dv: int):
    gen = torch.Generator().manual_seed(sum(lens) + dk)
    t = sum(lens)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g, beta = -torch.rand(t, hv, generator=gen) * 2, torch.rand(t, hv, generator=gen)
    states = torch.randn(5, hv, dk, dv, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([4, 0, 2][: len(lens)], dtype=torch.int32)
    return q, k, v, g, beta, states, cu, slots


# Both kernels give a program 16 value columns: dv 32 takes two blocks, dv 20 a whole one and a
# partial one.
BATCHES = [
    ([1], 1, 1, 16, 32),
    ([3, 1, 4], 2, 4, 16, 16),
    ([2, 5], 1, 2, 12, 20),
    ([17, 33], 1, 2, 16, 8),
]
IDS = ["N1-k1-dv32", "ragged-Hv4", "odd-dk12-dv20", "long-T33-Hv2"]


@pytest.mark.parametrize("batch", BATCHES, ids=IDS)
def test_triton_recurrent_matches_naive(batch: tuple) -> None:
    q, k, v, g, beta, states, cu, slots = _batch(*batch)
    live = states.clone()
    rows = torch.zeros(60, *states.shape[1:])
    vrows = torch.tensor([0, 20, 40][: len(slots)], dtype=torch.int32)
    dev = on(q, k, v, g, beta, live, cu, slots, rows, vrows)
    out = recurrent.recurrent_gated_delta_rule(*dev, write_live=True).cpu()
    live, rows = dev[5].cpu(), dev[8].cpu()
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        s = int(slots[i])
        ref, ref_states = naive.recurrent_gated_delta_rule(
            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], states[s]
        )
        # fp32, same order of operations per row: rounding of the reductions only.
        torch.testing.assert_close(out[lo:hi], ref, atol=1e-6, rtol=1e-5)
        v0 = int(vrows[i])
        torch.testing.assert_close(rows[v0 : v0 + hi - lo], ref_states, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(live[s], ref_states[-1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("batch", BATCHES, ids=IDS)
def test_triton_chunk_matches_naive(batch: tuple) -> None:
    q, k, v, g, beta, states, cu, slots = _batch(*batch)
    live = states.clone()
    dev = on(q, k, v, g, beta, live, cu, slots)
    out = chunk.chunk_gated_delta_rule(*dev).cpu()
    live = dev[5].cpu()
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        s = int(slots[i])
        ref, ref_final = naive.chunk_gated_delta_rule(
            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], states[s]
        )
        # fp32: the chunks are 16 rows here and 64 in the reference.
        torch.testing.assert_close(out[lo:hi], ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(live[s], ref_final, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("length", [1, 40, 64, 150])
def test_training_form_matches_recurrent_with_gradients(length: int) -> None:
    """The batched, differentiable chunked form (what `met train` runs) against the naive
    recurrence per sequence from a zero state: outputs and the gradients of every input,
    fp32, atol 1e-4."""
    from kernels.gated_delta_rule.train import chunk_gated_delta_rule_batched

    batch, hk, hv, dk, dv = 2, 2, 4, 16, 8
    gen = torch.Generator().manual_seed(length)
    inputs = [
        torch.randn(batch, length, hk, dk, generator=gen),
        torch.randn(batch, length, hk, dk, generator=gen),
        torch.randn(batch, length, hv, dv, generator=gen),
        -torch.rand(batch, length, hv, generator=gen) * 2,
        torch.rand(batch, length, hv, generator=gen),
    ]
    weight = torch.randn(batch, length, hv, dv, generator=gen)
    a = [x.clone().requires_grad_() for x in inputs]
    out = chunk_gated_delta_rule_batched(*a, chunk_size=32)
    (out * weight).sum().backward()
    b = [x.clone().requires_grad_() for x in inputs]
    ref = torch.stack(
        [
            naive.recurrent_gated_delta_rule(*(x[i] for x in b), torch.zeros(hv, dk, dv))[0]
            for i in range(batch)
        ]
    )
    (ref * weight).sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-4, rtol=1e-3)


def _call_recurrent(q, k, v, g, beta, states, cu, slots) -> torch.Tensor:
    rows = torch.zeros(8, *states.shape[1:])
    vrows = torch.zeros(len(slots), dtype=torch.int32)
    return recurrent.recurrent_gated_delta_rule(
        q, k, v, g, beta, states, cu, slots, rows, vrows, write_live=False
    )


HOSTS = [_call_recurrent, chunk.chunk_gated_delta_rule]


def _recurrent_states(q, k, v, g, beta, states, cu, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent kernel's outputs and the state after every row.
    -> (o [T, Hv, dv], states [T, Hv, dk, dv])"""
    rows = torch.zeros(int(cu[-1]), *states.shape[1:], device=q.device)
    vrows = cu[:-1].clone()
    out = recurrent.recurrent_gated_delta_rule(
        q, k, v, g, beta, states, cu, slots, rows, vrows, write_live=True
    )
    return out, rows


def _chunk_states(q, k, v, g, beta, states, cu, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked kernel's outputs and each sequence's final state.
    -> (o [T, Hv, dv], states [N, Hv, dk, dv])"""
    return chunk.chunk_gated_delta_rule(q, k, v, g, beta, states, cu, slots), states[slots]


@pytest.mark.parametrize(
    ("run", "lens"),
    [(_recurrent_states, [3, 2]), (_chunk_states, [2, 17])],
    ids=["recurrent", "chunk-2-chunks"],
)
def test_a_sequence_alone_is_byte_identical_in_a_batch(run, lens: list[int]) -> None:
    """Block sizes and split counts come from the head widths, never from the batch: each
    sequence's outputs and states are the same bytes launched alone as beside others. dv 32
    takes two value blocks."""
    q, k, v, g, beta, states, cu, slots = _batch(lens, 1, 2, 16, 32)
    batched = [x.cpu() for x in run(*on(q, k, v, g, beta, states.clone(), cu, slots))]
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        inputs = (q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], states.clone())
        one = (torch.tensor([0, hi - lo], dtype=torch.int32), slots[i : i + 1])
        out, after = (x.cpu() for x in run(*on(*inputs, *one)))
        assert torch.equal(out, batched[0][lo:hi])
        rows = slice(lo, hi) if run is _recurrent_states else slice(i, i + 1)
        assert torch.equal(after, batched[1][rows])


@pytest.mark.parametrize("host", HOSTS, ids=["recurrent", "chunk"])
@pytest.mark.parametrize(
    ("name", "shape"),
    [("g", (3, 5)), ("beta", (3, 5)), ("g", (2, 4)), ("k", (3, 2, 8))],
    ids=["g-heads", "beta-heads", "g-rows", "k-dim"],
)
def test_refuses_a_wrong_shape_naming_it(host, name: str, shape: tuple[int, ...]) -> None:
    """Each tensor is checked on its own before any launch: a wrong g beside a right beta is
    refused, the message naming the tensor, its shape and the one expected."""
    q, k, v, g, beta, states, cu, slots = _batch([3], 2, 4, 16, 8)
    inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    expected = tuple(inputs[name].shape)
    inputs[name] = torch.zeros(shape)
    message = rf"{name} has shape \({', '.join(map(str, shape))}\).* = {re.escape(str(expected))}"
    with pytest.raises(ValueError, match=message):
        host(*inputs.values(), states, cu, slots)


@pytest.mark.parametrize("host", HOSTS, ids=["recurrent", "chunk"])
def test_refuses_a_half_precision_state(host) -> None:
    q, k, v, g, beta, states, cu, slots = _batch([3], 2, 4, 16, 8)
    with pytest.raises(ValueError, match="states is torch.float16; the GDN state is fp32"):
        host(q, k, v, g, beta, states.half(), cu, slots)
