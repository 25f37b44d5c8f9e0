"""Sampling: the service's draws, the speculative verdict's distribution,
and seeded requests end to end with and without speculation."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.engine.sampling import draw, row_draws
from gpu_service.model.config import ServiceConfig
from protos.params import MTP, NONE, SamplingParams
from tests.collect import run_all

TOK = ByteTokenizer.default()
NO_ENV = Env()  # no METRALE_* switch set


def test_draw_reads_the_cdf() -> None:
    assert draw(torch.tensor([0.2, 0.3, 0.5]), 0.0) == 0
    assert draw(torch.tensor([0.2, 0.3, 0.5]), 0.45) == 1
    assert draw(torch.tensor([0.2, 0.3, 0.5]), 0.999) == 2


def test_min_p_of_one_samples_the_greedy_tokens(tiny_dir: Path) -> None:
    """At min_p 1 only the most probable token stays: sampled `mtp` (drafts drawn from the
    cut drafter, verified against the cut target) makes the greedy tokens."""
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3", max_context=256))
    s = Scheduler(lambda: engine, TOK, SchedulerOptions(max_queue=4), NO_ENV)
    s.start()
    try:
        prompt = (72, 105, 33, 10, 100)
        greedy = GenRequest("g", prompt, 24, method=NONE, ignore_eos=True)
        cut = [
            GenRequest(
                f"c{i}",
                prompt,
                24,
                ignore_eos=True,
                sampling=SamplingParams(0.9, min_p=1.0, seed=i),
            )
            for i in range(2)
        ]
        want, *got = (o.tokens for o in run_all(s, [greedy, *cut]))
    finally:
        s.stop()
    assert got == [want, want]


def test_speculative_verdict_reproduces_the_target() -> None:
    """Draft from q, accept with min(1, p/q), else draw from the residual: the token is
    distributed as p (Monte Carlo, 40000 draws, each probability within 0.01)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.1, 0.6, 0.1, 0.2], dtype=torch.float64)
    rng = random.Random(0)
    counts = torch.zeros(4)
    for _ in range(40000):
        d = draw(q, rng.random())
        rd = row_draws(p, q, d, rng.random())
        token = d if rng.random() < min(1.0, rd.p_next / float(q[d])) else rd.resample
        counts[token] += 1
    torch.testing.assert_close(counts / counts.sum(), p.float(), atol=0.01, rtol=0)


def _first_tokens(engine: Engine, method: str, n: int) -> list[list[int]]:
    s = Scheduler(lambda: engine, TOK, SchedulerOptions(max_queue=n), NO_ENV)
    s.start()
    try:
        reqs = [
            GenRequest(
                f"s{i}",
                (72, 105, 33),
                4,
                method=method,
                sampling=SamplingParams(0.7, top_k=3, seed=i),
                ignore_eos=True,
            )
            for i in range(n)
        ]
        outs = run_all(s, reqs, timeout=300)
        assert all(o.finish is not None and o.finish.reason == "length" for o in outs)
        return [o.tokens for o in outs]
    finally:
        s.stop()


# Slow: two full sampled generations.
@pytest.mark.slow
def test_seeded_sampling_with_and_without_speculation(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3,8:2", max_context=256))
    n = 240
    spec, plain = _first_tokens(engine, MTP, n), _first_tokens(engine, NONE, n)
    # A seed replays under the same load (the draft widths follow the batch).
    assert _first_tokens(engine, MTP, n) == spec, "a seed gives the same tokens"
    # Tokens 3 and 4 come from speculative verifies under mtp (1 is prefill's, 2 bootstrap's).
    for position in (2, 3):
        stat, df, critical = _chi_square([t[position] for t in spec], [t[position] for t in plain])
        assert stat < critical, f"position {position}: chi-square {stat:.1f} on {df} df"


def _chi_square(a: list[int], b: list[int]) -> tuple[float, int, float]:
    """Two-sample homogeneity: cells with an expected count under 5 pooled into one; the
    critical value at p = 0.001 by the Wilson-Hilferty approximation."""
    ca, cb = Counter(a), Counter(b)
    kept = [k for k in set(ca) | set(cb) if (ca[k] + cb[k]) / 2 >= 5]
    cells = [(ca[k], cb[k]) for k in kept]
    cells.append(
        (
            sum(v for k, v in ca.items() if k not in kept),
            sum(v for k, v in cb.items() if k not in kept),
        )
    )
    cells = [(x, y) for x, y in cells if x + y > 0]
    stat = sum(2 * (x - (x + y) / 2) ** 2 / ((x + y) / 2) for x, y in cells)
    df = max(len(cells) - 1, 1)
    z = 3.09  # the 0.999 quantile of the standard normal
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, df, critical


def test_rejection_verdict_accepts_and_falls() -> None:
    from control_plane.scheduler.seq import ActiveSeq, ModelFacts
    from control_plane.scheduler.verdict import _rejection
    from protos.handles import RowDraws

    a = ActiveSeq(
        GenRequest("x", (1,), 5, sampling=SamplingParams(1.0, seed=0)),
        lambda ev: None,
        TOK,
        ModelFacts(64, eos_ids=(257,)),
    )
    sure = [RowDraws(1.0, 7, 8), RowDraws(1.0, 9, 10), RowDraws(0.0, 11, 12, -1.5, -2.5)]
    assert _rejection(a, [1, 2, 3], [0.5, 0.5], sure) == (2, 12, -2.5), "p/q >= 1: all stand"
    never = [RowDraws(0.0, 7, 8, -3.5, -4.5), RowDraws(0.0, 9, 10)]
    assert _rejection(a, [1, 2], [0.5], never) == (0, 7, -3.5), "p = 0: the residual's draw"
