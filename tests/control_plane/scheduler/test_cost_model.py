"""The measured cost model: the service's cost table and its cache, the acceptance
calibration, `propose_depth`, and the step under it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from control_plane.scheduler import widths
from control_plane.scheduler.arms import step_mtp
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.scheduler.widths import (
    PRIOR,
    Calibration,
    CostTable,
    StepOverhead,
    drafted_line,
    propose_depth,
)
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine import costs as cost_tables
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.model import CostEntry, ResourceExhausted
from tests.collect import run_all
from tests.control_plane.scheduler.test_step import NO_ENV, seqs
from tests.fake_model import FakeModel


def table(verify: float = 1.0, per_row: float = 0.1, propose: float = 0.5) -> CostTable:
    return CostTable(
        [
            CostEntry(w, d, verify + per_row * w * (d + 1), propose * d)
            for w in (1, 4, 16)
            for d in range(4)
        ]
    )


def test_calibration_prior_then_observed() -> None:
    c = Calibration()
    assert c.rate(0) == PRIOR
    for _ in range(40):
        c.observe(3, 1)  # first stands, second falls, third not judged
    assert c.rate(0) == 1.0 and c.rate(1) == 0.0
    assert c.rate(2) == 0.0 and c.rate(7) == 0.0, "unjudged: the deepest judged position's"
    deep = Calibration()
    for _ in range(40):
        deep.observe(3, 3)
    assert deep.rate(5) == 1.0, "drafts that all stood: try deeper"
    few = Calibration()
    few.observe(2, 2)
    assert few.rate(0) == few.rate(1) == PRIOR, "too few observations anywhere: the prior"


def test_table_widths() -> None:
    t = table()
    assert t.step_ms(3, 1) == t.step_ms(4, 1), "the next larger measured width"
    assert t.step_ms(32, 0) == pytest.approx(t.step_ms(16, 0) * 2), "scaled past the largest"
    assert CostTable([CostEntry(1, 0, 1.0, 0.0)]).step_ms(1, 2) is None


def test_drafted_depths_lie_on_their_line() -> None:
    assert drafted_line({1: 6.0, 2: 7.0, 3: 8.0}) == pytest.approx({1: 6.0, 2: 7.0, 3: 8.0})
    smoothed = drafted_line({1: 6.0, 2: 7.4, 3: 7.9})  # depth 2 measured high
    assert smoothed == pytest.approx({1: 6.15, 2: 7.1, 3: 8.05})
    assert drafted_line({1: 6.0, 2: 5.0, 3: 5.5}) == pytest.approx({1: 5.5, 2: 5.5, 3: 5.5}), (
        "a step never costs less for drafting more: the slope floors at zero"
    )
    assert drafted_line({1: 6.0, 2: 9.0}) == {1: 6.0, 2: 9.0}, "two points: as measured"
    t = CostTable(
        [CostEntry(1, 0, 4.0, 1.0)]
        + [CostEntry(1, d, ms, 0.0) for d, ms in ((1, 6.0), (2, 7.4), (3, 7.9))]
    )
    assert t.step_ms(1, 0) == 5.0, "depth 0 runs no drafter: as measured"
    assert t.step_ms(1, 2) == pytest.approx(7.1)


def test_a_noisy_cell_does_not_move_the_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell measured a fifth high: the line ranks the depths as the noiseless table does;
    the raw cells would not."""
    sure = Calibration()
    for _ in range(40):
        sure.observe(3, 3)
    clean = {0: 5.0, 1: 6.0, 2: 7.0, 3: 8.0}
    noisy = {**clean, 3: 9.5}

    def pick(costs: dict[int, float]) -> int:
        t = CostTable([CostEntry(1, d, ms, 0.0) for d, ms in costs.items()])
        return propose_depth(t, sure, 1, 0.0, 32, 3)

    assert (pick(clean), pick(noisy)) == (3, 3)
    monkeypatch.setattr(widths, "drafted_line", dict)
    assert pick(noisy) == 2, "unsmoothed, the noisy cell ranks depth 2 first"


def test_propose_depth() -> None:
    good, bad = Calibration(), Calibration()
    for _ in range(40):
        good.observe(3, 3)
        bad.observe(3, 0)
    assert propose_depth(table(), good, 4, 0.0, 32, 3) == 3, "cheap drafts that stand: deep"
    assert propose_depth(table(), bad, 4, 0.0, 32, 3) == 0, "drafts that fall: none"
    assert propose_depth(table(), good, 40, 0.0, 32, 3) == 0, "above --mtp-max-seqs"
    assert propose_depth(table(), good, 4, 0.0, 32, 0) == 0, "--num-drafts 0"
    sparse = CostTable([CostEntry(1, 0, 0.0, 0.0)])  # nothing usable to weigh
    assert propose_depth(sparse, good, 1, 0.0, 32, 3) == 0
    half = Calibration()
    slack_free = propose_depth(table(), half, 4, 0.0, 32, 3)
    assert propose_depth(table(), half, 4, 0.9, 32, 3) <= slack_free
    assert propose_depth(table(), half, 4, 0.9, 32, 3) == 0, "a wide slack takes the cheapest"


def test_overhead_is_the_median_excess_over_the_table() -> None:
    t = table()  # width 1, depth 0: 1.1 ms
    o = StepOverhead()
    assert o.ms == 0.0, "no step seen: the table alone"
    o.observe(None, 1, 0, 50.0)
    o.observe(t, 40, 9, 50.0)  # a depth the table lacks
    assert o.ms == 0.0, "a step the table cannot price teaches nothing"
    for served in (3.1, 3.1, 40.0):  # one step held up by something else
        o.observe(t, 1, 0, served)
    assert o.ms == pytest.approx(2.0), "the median: one slow step does not move it"
    faster = StepOverhead()
    faster.observe(t, 1, 0, 0.5)
    assert faster.ms == 0.0, "a step served faster than the table adds nothing"


def test_overhead_deepens_the_step() -> None:
    """The same table and acceptance: a fixed cost on every served step makes the deeper
    step's extra rows and drafts weigh less, and the depth rises."""
    steep = table(verify=1.0, per_row=1.0, propose=1.0)
    half = Calibration()
    for _ in range(40):
        half.observe(3, 1)
        half.observe(3, 3)
    alone = propose_depth(steep, half, 1, 0.0, 32, 3)
    loaded = propose_depth(steep, half, 1, 0.0, 32, 3, overhead_ms=50.0)
    assert (alone, loaded) == (0, 3), "alone, a draft costs what it gains; with it, all three pay"


@pytest.mark.parametrize("plan_steps", [1, 2])
def test_served_steps_teach_the_overhead(plan_steps: int) -> None:
    """Each step's time as the scheduler saw it, less the table's cost, in step and
    pipelined (timed once per plan, per step of it): a table of near-zero costs leaves the
    whole step as overhead."""
    model = FakeModel()
    free = CostTable([CostEntry(w, d, 1e-6, 0.0) for w in (1, 2, 4) for d in range(4)])
    ctx = StepContext.build(model.capabilities(), NO_ENV, free)
    step_mtp(model, seqs(model, 2), ctx, 3)
    assert len(ctx.overhead.seen) == 1 and ctx.overhead.ms > 0
    model2 = FakeModel()
    model2.cached = True  # `auto` takes the service's table
    opts = SchedulerOptions(spec_cost_model="auto", plan_steps=plan_steps)
    s = Scheduler(lambda: model2, ByteTokenizer.default(), opts, Env())
    s.start()
    try:
        run_all(s, [GenRequest(f"p{i}", (5, 6, 7), 8, method="mtp") for i in range(2)])
    finally:
        s.stop()
    assert s.ctx is not None and s.ctx.costs is not None
    plans = s.snapshot()["counters"].plans
    assert plans > 0, "the steps ran ahead"
    assert len(s.ctx.overhead.seen) * plan_steps >= plans, "every plan read back was timed"


def test_step_under_the_cost_model() -> None:
    model = FakeModel()
    costs = CostTable(model.measure_costs([1, 2, 4, 8], 3)[0])
    ctx = StepContext.build(model.capabilities(), NO_ENV, costs)
    for _ in range(40):
        ctx.calibration.observe(1, 0)  # drafts never stand: the model's 0 floors to 1
    assert step_mtp(model, seqs(model, 2), ctx, 3).ladder_nd == 1
    capped = StepContext.build(model.capabilities(), replace(NO_ENV, mtp_max_seqs=1), costs)
    model2 = FakeModel()
    report = step_mtp(model2, seqs(model2, 2), capped, 3)
    assert report.ladder_nd == 0 and "propose" not in model2.names(), "plain decode above cap"
    fixed = StepContext.build(model.capabilities(), replace(NO_ENV, fixed_width=True), costs)
    for _ in range(40):
        fixed.calibration.observe(1, 0)
    model3 = FakeModel()
    assert step_mtp(model3, seqs(model3, 2), fixed, 3).ladder_nd == 3, "--fixed-width wins"


def test_scheduler_measures_once_and_stays_lossless(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3,8:2", max_context=256))
    reqs = [GenRequest(f"r{i}", (i + 1, 2, 3), 10) for i in range(6)]
    outs = {}
    for mode in ("static", "measured"):
        s = Scheduler(
            lambda: engine, ByteTokenizer.default(), SchedulerOptions(spec_cost_model=mode), Env()
        )
        s.start()
        try:
            outs[mode] = [o.tokens for o in run_all(s, reqs)]
        finally:
            s.stop()
    assert outs["static"] == outs["measured"]
    assert any(p.name.startswith("spec_cost.") for p in cost_tables.cache_dir().iterdir())
    assert not any(p.name.startswith("spec_cost.") for p in tiny_dir.iterdir())


def test_engine_cache(tmp_path: Path, tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="2:3,2:1", max_context=256))
    first, cached = engine.measure_costs([1, 2, 4], 3, repeats=1, refresh=True)
    assert not cached and {(e.width, e.depth) for e in first} >= {(1, 3), (2, 3), (4, 1)}
    assert (4, 3) not in {(e.width, e.depth) for e in first}, "slots 2-3 verify one draft"
    again, cached = engine.measure_costs([1, 2], 1)
    assert cached and again == first
    with pytest.raises(ResourceExhausted, match="free"):
        engine.measure_costs([8], 1, refresh=True)
    assert engine.capabilities().free_slots == 4, "scratch sequences are freed"


def test_measure_over_grpc(client) -> None:
    entries, _ = client.measure_costs([1, 2], 1, repeats=1)
    assert {(e.width, e.depth) for e in entries} >= {(1, 0), (1, 1), (2, 0), (2, 1)}
    assert all(e.verify_ms > 0 for e in entries)


def test_cached_only_reads_the_table_and_never_measures(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="2:3,2:1", max_context=256))
    assert engine.measure_costs([1, 2], 1, cached_only=True) == ([], False)
    assert not any(tmp_path.rglob("spec_cost.*")), "nothing measured, nothing written"
    measured, _ = engine.measure_costs([1, 2], 1, repeats=1)
    assert engine.measure_costs([1, 2], 1, cached_only=True) == (measured, True)


def test_cached_only_needs_no_admin_key(served: str) -> None:
    from control_plane.replicas.client import GrpcModel
    from protos.model import ModelError

    model = GrpcModel(served, admin_key="not the key")
    try:
        entries, cached = model.measure_costs([1], 0, cached_only=True)
        assert cached == bool(entries)
        with pytest.raises(ModelError):
            model.measure_costs([1], 0, repeats=1)
    finally:
        model.close()


@pytest.mark.parametrize("cached", [True, False])
def test_auto_uses_the_services_table_when_it_has_one(cached: bool) -> None:
    """`auto` asks for the table the service has, never a measurement; without one the step
    keeps the static ladder."""
    model = FakeModel()
    model.cached = cached
    opts = SchedulerOptions(spec_cost_model="auto")
    s = Scheduler(lambda: model, ByteTokenizer.default(), opts, Env())
    s.capabilities()
    assert s.ctx is not None and (s.ctx.costs is not None) == cached
    assert [c for c in model.calls if c[0] == "measure_costs"] == [
        ("measure_costs", [1, 2, 4, 8], 3)
    ]
