"""The logits pipeline (`gpu_service/engine/logits.py`) applies its steps in the order its
docstring states: a call's rows equal the steps written out one after another (bias,
penalties, allowed ids, grammar mask) on any rank's columns; a masked or disallowed column
stays at -inf whatever its bias; sampling's cuts read the processed logits; and the
log-probabilities, the greedy verdict's and a response's alike, are the fp32 log-softmax of
the processed logits. A column at -inf stays there through every step of 1 to 4, so among
them only the bias before the repetition penalty shows in the numbers (test_penalties.py
checks it row by row); what the order fixes beyond that is that sampling and the
log-probabilities read the processed logits."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from gpu_service.engine.logits import distribution, log_softmax_top, process_rows
from gpu_service.memory.sequence import SeqState
from gpu_service.model.backend import EAGER
from protos.model import Penalties, Sampling
from tests.conftest import random_tokens

VOCAB = 64
# Penalty values exact in fp32, so the written-out steps round as the service's; the rest is
# the same fp32 arithmetic in another order of operands.
ATOL = 1e-6
BIASED = 9  # a column every test biases upward and masks


def steps(
    row: torch.Tensor,
    prompt: list[int],
    output: list[int],
    pen: Penalties | None,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """Steps 1 to 4 written out for one row over every column. allowed: [V] bool or None"""
    x = row.float().clone()
    if pen is not None:
        for t, b in zip(pen.bias_ids, pen.bias_values, strict=True):
            x[t] += b
        if pen.repetition != 1.0:
            for t in set(prompt) | set(output):
                x[t] = x[t] / pen.repetition if x[t] > 0 else x[t] * pen.repetition
        for t, c in Counter(output).items():
            x[t] = x[t] - pen.frequency * c - pen.presence
        if pen.allowed_ids:
            keep = torch.zeros(VOCAB, dtype=torch.bool)
            keep[list(pen.allowed_ids)] = True
            x[~keep] = float("-inf")
    if allowed is not None:
        x[~allowed] = float("-inf")
    return x


def _sequences(rng: torch.Generator) -> list[SeqState]:
    """One penalized, one with allowed ids (not `BIASED`, which it biases most), one plain."""
    bias = dict(prompt_tokens=10, bias_values=(50.0, -2.5))
    pens = [
        Penalties(presence=0.5, frequency=0.25, repetition=1.25, bias_ids=(BIASED, 17), **bias),
        Penalties(allowed_ids=(3, 17, 40, 41), bias_ids=(BIASED, 40), **bias),
        None,
    ]
    tokens = [random_tokens(rng, 14, vocab=VOCAB) for _ in pens]  # 10 of prompt, 4 of output
    return [
        SeqState(i, i, tokens=t, penalties=p)
        for i, (t, p) in enumerate(zip(tokens, pens, strict=True))
    ]


@pytest.mark.parametrize("held", [(0, VOCAB), (20, VOCAB), (0, 20)], ids=["all", "rank1", "rank0"])
def test_a_calls_rows_are_the_steps_in_order(rng: torch.Generator, held: tuple[int, int]) -> None:
    """Three sequences of 3, 1 and 2 rows; a grammar mask on a row of each (the mask bans
    `BIASED`, biased by 50): every row equals the steps written out, on this rank's columns."""
    lo, hi = held
    seqs = _sequences(rng)
    rows = [random_tokens(rng, k, vocab=VOCAB) for k in (3, 1, 2)]
    starts, before = [0, 3, 4, 6], [s.seq_len for s in seqs]
    grammar = {r: torch.rand(VOCAB, generator=rng) < 0.5 for r in (1, 3, 5)}
    for allowed in grammar.values():
        allowed[[BIASED, 17]] = torch.tensor([False, True])
    logits = torch.randn(6, VOCAB, generator=rng)
    mine = logits[:, lo:hi].clone()
    process_rows(mine, held, seqs, before, rows, starts, {r: a[lo:hi] for r, a in grammar.items()})
    for i, s in enumerate(seqs):
        for j in range(len(rows[i])):
            r = starts[i] + j
            output = s.tokens[10:] + rows[i][: j + 1]
            want = steps(logits[r], s.tokens[:10], output, s.penalties, grammar.get(r))[lo:hi]
            torch.testing.assert_close(mine[r], want, atol=ATOL, rtol=0)
            if lo <= BIASED < hi and (r in grammar or i == 1):
                assert mine[r, BIASED - lo] == float("-inf"), "a bias lifted a masked column"


def test_sampling_cuts_the_processed_logits() -> None:
    """Top-k 1 after the mask keeps the best allowed column (before it, the raw best, which
    the mask then bans, would leave nothing); min-p measures against the best allowed column,
    after the bias: that lifts column 4 to e^-1.5 of it, above min-p's 0.2 (e^-2 without)."""
    logits = torch.tensor([[4.0, 3.0, 1.0, 0.0, -1.0]])
    allowed = torch.tensor([False, False, True, True, True])
    seq = SeqState(0, 0, tokens=[0], penalties=Penalties(bias_ids=(4,), bias_values=(0.5,)))
    process_rows(logits, (0, 5), [seq], [1], [[0]], [0], {0: allowed})
    p = distribution(logits, Sampling(1.0, top_k=1))[0]
    assert p.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]
    cut = distribution(logits, Sampling(1.0, min_p=0.2))[0]
    assert (cut[:2] == 0).all() and (cut[2:] > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_logprobs_are_the_log_softmax_of_the_processed_logits(
    rng: torch.Generator, dtype: torch.dtype
) -> None:
    """A response's log-probabilities and the greedy verdict's are torch's fp32 log-softmax of
    the same processed rows (masked columns at -inf), to fp32 rounding."""
    logits = (torch.randn(4, VOCAB, generator=rng) * 3).to(dtype)
    allowed = torch.rand(VOCAB, generator=rng) < 0.3
    seq = SeqState(0, 0, tokens=[1, 2], penalties=Penalties(repetition=1.25, prompt_tokens=2))
    process_rows(logits, (0, VOCAB), [seq], [2], [[3, 4, 5, 6]], [0], {2: allowed})
    want = torch.log_softmax(logits.float(), -1)
    after = [5, 7, int(allowed.nonzero()[0]), 11]
    logp, chosen, values, ids = log_softmax_top(logits, after, 5)
    torch.testing.assert_close(logp, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(chosen, want[torch.arange(4), after], atol=ATOL, rtol=0)
    torch.testing.assert_close(values, want.topk(5, -1).values, atol=ATOL, rtol=0)
    assert torch.equal(ids, want.topk(5, -1).indices)
    top, greedy = EAGER.argmax_logprob(logits)
    assert bool(allowed[top[2]])
    torch.testing.assert_close(greedy, want[torch.arange(4), top], atol=ATOL, rtol=0)


def test_distribution_top_k_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = distribution(logits, Sampling(1.0))
    torch.testing.assert_close(p, torch.softmax(logits.double(), -1))
    assert (distribution(logits, Sampling(1.0, top_k=2))[0, 2:] == 0).all()
    top_p = distribution(logits, Sampling(1.0, top_p=0.7))[0]
    assert top_p[0] > 0 and top_p[1] > 0 and (top_p[2:] == 0).all()
    torch.testing.assert_close(float(top_p.sum()), 1.0)


def test_min_p_cuts_before_top_p() -> None:
    """min_p keeps the tokens at least min_p times as probable as the most probable one, and
    top_p then sums the renormalised rest (vLLM's order): here top_p alone would keep three."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    logits = p.log()
    cut = distribution(logits, Sampling(1.0, min_p=0.2))[0]
    torch.testing.assert_close(cut, torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.95)
    assert (distribution(logits, Sampling(1.0, top_p=0.83))[0, :3] > 0).all()
    both = distribution(logits, Sampling(1.0, top_p=0.83, min_p=0.2))[0]
    torch.testing.assert_close(both, torch.tensor([0.5, 0.3, 0.0, 0.0], dtype=torch.float64) / 0.8)
