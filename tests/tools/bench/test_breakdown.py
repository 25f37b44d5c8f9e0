"""The breakdown's arithmetic on chosen spans: a step's period, its forward, the service's
other work and what lies outside the service."""

from __future__ import annotations

from tools.bench.breakdown import split
from tools.bench.report import breakdown_lines as lines
from tools.bench.tracing import StepSpan

MS = 1_000_000


def Span(name: str, start: int, end: int) -> StepSpan:  # noqa: N802
    return StepSpan("gpu-service", name, b"", b"", start, end)


def test_a_steps_time_splits_into_forward_service_and_outside() -> None:
    # Two plans of one step each, 10 ms apart: the first 6 ms long (verify 3, propose 1.5),
    # the second 7 ms long (verify 3.5, propose 2).
    spans = [
        Span("engine.plan", 0, 6 * MS),
        Span("engine.verify", 1 * MS, 4 * MS),
        Span("propose", 4 * MS, int(5.5 * MS)),
        Span("engine.plan", 10 * MS, 17 * MS),
        Span("engine.verify", 11 * MS, int(14.5 * MS)),
        Span("propose", int(14.5 * MS), int(16.5 * MS)),
    ]
    got = split(spans)
    assert got["steps"] == 2
    assert got["period_ms"] == 8.5  # 17 ms over two steps
    assert got["forward_ms"] == 5.0
    assert got["service_other_ms"] == 1.5
    assert got["outside_ms"] == 2.0
    assert got["overhead_ms"] == 3.5
    (head, row) = lines([{"concurrency": 1, **got}])
    assert "overhead" in head and row.split() == ["1", "8.50", "5.00", "1.50", "2.00", "3.50"]


def test_no_step_no_row() -> None:
    assert split([Span("propose", 0, MS)]) == {}
