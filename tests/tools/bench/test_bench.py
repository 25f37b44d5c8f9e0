"""`met bench --quick` as a smoke test: it runs end to end and the three methods agree; the
replicas and tensor-parallel sections, the draft's cost and transformers' static batch on the
tiny checkpoint; the draft-cost fit and the speedup prediction on chosen numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_service.engine import costs
from gpu_service.engine.facade import Engine
from protos.model import CostEntry
from tools.bench.baseline import (
    batch_against_transformers,
    grpc_against_transformers,
    same_rounds,
    transformers_baselines,
)
from tools.bench.depth import DEEP, DEEP_TIERS, depth, depth_lines, depth_table
from tools.bench.predict import (
    cost_figures,
    deviation,
    draft_cost,
    draft_ms,
    mtp_step_ms,
    predicted_speedup,
    prediction,
    target_step_ms,
    verify_at,
)
from tools.bench.replicas import replicas
from tools.bench.report import (
    figure_lines,
    replicas_lines,
    tensor_parallel_lines,
    tensor_parallel_table,
)
from tools.bench.split import pair
from tools.bench.tensor_parallel import ARMS, tensor_parallel
from tools.bench.workload import Workload

# Slow: runs `met bench`.
pytestmark = pytest.mark.slow


def test_bench_quick(tmp_path: Path) -> None:
    """On the bundled checkpoint and its held-out prompts, as a user runs it; the output
    files' directories need not exist yet."""
    out = tmp_path / "runs" / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "met",
            "bench",
            "--quick",
            "--out",
            str(out),
            "--markdown",
            str(tmp_path / "tables" / "bench.md"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["failures"] == []
    assert {r["method"] for r in report["methods"]} == {
        "none",
        "mtp",
        "mtp_auto",
        "prompt_lookup",
        "dflash",  # the bundled model ships a drafter
    }
    assert all(r["identical"] for r in report["methods"])
    assert report["model"] == "default"
    mtp = next(r for r in report["methods"] if r["method"] == "mtp" and r["concurrency"] == 1)
    # 12 tokens of one prompt: drafts stand (an untrained drafter's length is 1.0)
    assert mtp["accepted_length"] > 1.2, "the trained drafter's drafts stand"
    assert report["memory"]["tiered_bytes"] < report["memory"]["full_capacity_bytes"]
    assert {(r["method"], r["concurrency"]) for r in report["split"]} == {("none", 1), ("mtp", 1)}
    for r in report["split"]:
        arms = ("in_process", "in_process_unpipelined", "grpc", "grpc_unpipelined")
        assert all(r[f"{a}_tok_s"] > 0 and r[f"{a}_step_ms"] > 0 for a in arms)
        assert r["in_process_plans"] > 0 and r["grpc_plans"] > 0, "the pipeline ran"
        assert r["in_process_unpipelined_plans"] == 0 and r["grpc_unpipelined_plans"] == 0
        assert 0 <= r["grpc_idle"] <= 1 and 0 <= r["in_process_idle"] <= 1
        assert r["grpc_over_in_process"] > 0 and r["grpc_over_in_process_unpipelined"] > 0
    assert [r["concurrency"] for r in report["speedup"]] == [1]
    chart = out.with_suffix(".png")
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mtp / none at 1" in result.stdout
    assert "split mtp  at 1: pipelined" in result.stdout
    table = (tmp_path / "tables" / "bench.md").read_text()
    assert "| mtp | 1 |" in table and "| prompt_lookup | 4 |" in table
    assert "| dflash | 4 |" in table
    assert "service idle between steps (gRPC, pipelined)" in table
    _check_figures(report, result.stdout, table)
    choice = {(r["method"], r["concurrency"]): r for r in report["choice"]}
    assert set(choice) == {
        *((m, 1) for m in ("none", "mtp", "dflash", "unnamed")),
        ("json_schema/none", 8),
        ("json_schema/mtp", 8),
        ("json_schema/unnamed", 8),
    }
    assert all(r["identical"] for r in choice.values()), "through both processes, as none's"
    assert choice[("unnamed", 1)]["ran"], "the response's stats name what the choice ran"
    assert "json_schema/unnamed" in result.stdout and "json_schema/unnamed" in table
    depth_arms = {r["arm"] for r in report["depth"]["rows"]}
    assert depth_arms == {"none", "fixed_3", "fixed_7", "measured_3", "measured_deep"}
    assert "draft depth (tiers 4:7," in result.stdout and "| measured_deep | 1 |" in table


def _check_figures(report: dict, stdout: str, table: str) -> None:
    """The draft's cost and the predicted speedup at one request; no static batch under
    `--quick`."""
    cost, pred = report["draft_cost"], report["prediction"]
    assert [e["depth"] for e in cost["entries"]] == [0, 1, 2, 3]
    # Orders that hold by construction (gpu_service/engine/costs.py, `bounded`: a drafted verify
    # as long as the plain one, a draft's cost above 0), not by the machine's timing.
    assert cost["target_step_ms"] > 0 and cost["draft_ms"] > 0
    assert cost["draft_over_step"] == cost["draft_ms"] / cost["target_step_ms"]
    assert pred["drafts_from"] == "spec stats" and 0 < pred["drafts_per_verify"] <= 3
    assert pred["accepted_length"] > 1 and pred["mtp_step_ms"] > cost["target_step_ms"]
    assert pred["predicted"] > 0 and pred["measured_in_process"] > 0 and pred["measured_grpc"] > 0
    assert pred["deviation_grpc"] == pred["predicted"] / pred["measured_grpc"] - 1
    assert "transformers_generate_batch" not in report
    for text in (stdout, table):
        assert "draft cost at 1 request: target step" in text
        assert "mtp / none at 1 predicted from accepted length" in text and "over gRPC (" in text


def test_depth_arms_draft_as_told_and_match_plain_decoding(tiny_dir: Path) -> None:
    """Fixed depths draft that many at every verify but a sequence's last; the measured cost
    model stays within its cap; every arm makes plain decoding's tokens."""
    section = depth(tiny_dir, Workload(tiny_dir), [1], 12, 1, quick=False)
    rows = {r["arm"]: r for r in section["rows"]}
    assert set(rows) == {"none", *(f"fixed_{d}" for d in range(1, DEEP + 1))} | {
        "measured_3",
        "measured_deep",
    }
    assert section["failures"] == [] and all(r["identical"] for r in rows.values())
    assert rows["none"]["drafts_per_verify"] == 0.0 and rows["none"]["over_none"] == 1.0
    # d drafts at every verify but the first (it bootstraps the drafter): 12 tokens, 11 verifies
    per = [rows[f"fixed_{d}"]["drafts_per_verify"] for d in range(1, DEEP + 1)]
    assert per == pytest.approx([d * 10 / 11 for d in range(1, DEEP + 1)])
    assert rows["measured_3"]["drafts_per_verify"] <= 3
    assert rows["measured_deep"]["drafts_per_verify"] <= DEEP
    lines = depth_lines(section)
    assert lines[0] == f"draft depth (tiers {DEEP_TIERS}):" and len(lines) == len(rows)
    assert "| fixed_1 | 1 |" in "\n".join(depth_table(section))


def test_replicas_bench_rows(tiny_dir: Path) -> None:
    """Every arm of the replicas section serves the same requests to the same tokens, and a
    router over two services puts requests on both."""
    work = Workload(tiny_dir)
    (row,) = replicas(tiny_dir, work, concurrency=[2], tokens=4, repeats=1, count=2)
    assert row["method"] == "mtp" and row["concurrency"] == 2 and row["replicas"] == 2
    assert all(row[f"{arm}_tok_s"] > 0 for arm in ("single", "router_1", "router_n"))
    assert row["router_1_over_single"] > 0 and row["router_n_over_router_1"] > 0
    assert row["requests_by_replica"] == [1, 1]
    assert row["identical"]
    assert row["single_submit_us"] > 0 and row["router_1_submit_us"] > 0
    lines = replicas_lines([row])
    assert "us through the router" in lines[0]
    assert lines[0].startswith("replicas mtp at 2: single") and "routing, not scaling" in lines[1]


def test_tensor_parallel_bench_rows(tiny_dir: Path) -> None:
    """TP 1, TP 2 ordered and TP 2 nccl-style serve the same requests to the same tokens, and
    every figure of the section is measured and printed."""
    work = Workload(tiny_dir)
    (row,) = tensor_parallel(tiny_dir, work, concurrency=[1], tokens=4, repeats=1, size=2)
    assert row["method"] == "mtp" and row["concurrency"] == 1 and row["size"] == 2
    assert all(row[f"{arm}_tok_s"] > 0 for arm in ARMS)
    assert row["ordered_over_tp_1"] > 0 and row["nccl_over_tp_1"] > 0
    assert row["ordered_cost"] == 1 - row["ordered_tok_s"] / row["nccl_tok_s"]
    assert row["reduce_us"]["ordered"] > 0 and row["reduce_us"]["nccl"] > 0
    assert row["identical"] and row["differs"] == []
    lines = tensor_parallel_lines([row])
    assert lines[0].startswith("tensor parallel mtp at 1: TP 1")
    assert "% against nccl-style" in lines[0] and "identical yes" in lines[0]
    assert "share this machine's" in lines[1]


def test_tensor_parallel_table_says_which_arms_differ() -> None:
    """A row whose nccl-style arm made other tokens says so in the table and the lines."""
    row = {
        "method": "mtp",
        "concurrency": 1,
        "size": 2,
        "cores": 2,
        "tp_1_tok_s": 100.0,
        "ordered_tok_s": 60.0,
        "nccl_tok_s": 75.0,
        "ordered_over_tp_1": 0.6,
        "nccl_over_tp_1": 0.75,
        "ordered_cost": 0.2,
        "reduce_us": {"ordered": 900.0, "nccl": 800.0},
        "reduce_rows": 1,
        "hidden": 128,
        "identical": False,
        "differs": ["nccl"],
    }
    table = "\n".join(tensor_parallel_table([row]))
    assert "| 100.0 | 60.0 | 0.60x | 75.0 | 0.75x | +20.0% | 900 / 800 | NO (nccl differ" in table
    line = tensor_parallel_lines([row])[0]
    assert "ordered costs +20.0% against nccl-style" in line
    assert line.endswith("identical NO (nccl differ from TP 1)")


def _entries(propose: list[float], verify: list[float]) -> list[CostEntry]:
    """Width 1 at depths 0.., and a width-2 row the figures must leave out."""
    rows = [CostEntry(1, j, v, p) for j, (v, p) in enumerate(zip(verify, propose, strict=True))]
    return [*rows, CostEntry(2, 0, 100.0, 100.0), CostEntry(2, 1, 100.0, 900.0)]


# verdicts grow by 2, 3 and 5.5 ms over the plain one at 1, 2 and 3 drafts:
# (1 * 2 + 2 * 3 + 3 * 5.5) / (1 + 4 + 9) = 1.75 ms a draft
ENTRIES = _entries(propose=[0.5, 2.5, 3.5, 6.0], verify=[3.0, 3.5, 4.0, 5.0])


def test_draft_cost_is_the_slope_through_depth_0() -> None:
    assert target_step_ms(ENTRIES) == 3.5
    assert draft_ms(ENTRIES) == 1.75
    figures = cost_figures(ENTRIES)
    assert figures["draft_over_step"] == 0.5 and figures["verdict_ms"] == 0.5
    assert [e["depth"] for e in figures["entries"]] == [0, 1, 2, 3]
    assert draft_ms(_entries(propose=[0.5, 1.5], verify=[3.0, 3.0])) == 1.0, "one depth is enough"
    with pytest.raises(ValueError, match="depth of 1 or more"):
        draft_ms(_entries(propose=[0.5], verify=[3.0]))


def test_verify_is_interpolated_between_measured_depths() -> None:
    assert verify_at(ENTRIES, 2) == 4.0
    assert verify_at(ENTRIES, 1.5) == 3.75
    assert verify_at(ENTRIES, 2.25) == 4.25
    assert verify_at(ENTRIES, 7) == 5.0 and verify_at(ENTRIES, -1) == 3.0


def test_predicted_speedup() -> None:
    # verify at 2 drafts 4.0 + plain verdict 0.5 + 2 drafts of 1.75 = 8 ms for 4 tokens
    assert mtp_step_ms(ENTRIES, 2, 1.75) == 8.0
    assert predicted_speedup(4.0, 3.5, 8.0) == 1.75
    assert deviation(1.75, 1.4) == pytest.approx(0.25, rel=1e-12)
    rows = [
        {"method": "mtp", "concurrency": 1, "tok_s": 300.0, "accepted_length": 4.0},
        {"method": "none", "concurrency": 1, "tok_s": 200.0, "accepted_length": 1.0},
        {"method": "mtp", "concurrency": 4, "tok_s": 9e9, "accepted_length": 1.0},
    ]
    rows[0]["drafts_per_verify"] = 2.0
    cost = {"max_depth": 3, **cost_figures(ENTRIES)}
    speedup = [{"concurrency": 1, "in_process": 9.0, "grpc": 1.4}]
    got = prediction(rows, cost, speedup)
    assert got["mtp_step_ms"] == 8.0 and got["predicted"] == 1.75
    assert got["measured_in_process"] == 1.5 and got["measured_grpc"] == 1.4
    assert got["deviation_in_process"] == pytest.approx(1 / 6, rel=1e-12)
    assert got["deviation_grpc"] == pytest.approx(0.25, rel=1e-12)
    rows[0]["drafts_per_verify"] = None  # no verifies: the configured depth
    got = prediction(rows, cost, [])
    # 5.0 + 0.5 + 3 * 1.75 = 10.75 ms
    assert got["drafts_from"] == "configured" and got["predicted"] == 4.0 * 3.5 / 10.75
    assert "measured_grpc" not in got


def test_draft_cost_measures_in_a_scratch_cache(engine: Engine) -> None:
    """Measured afresh, and the user's cost tables (here the test session's) left as they
    were."""
    before = sorted(costs.cache_dir().glob("*")) if costs.cache_dir().exists() else []
    got = draft_cost(engine, 2, 3)
    assert got["max_depth"] == 2 and got["repeats"] == 3
    assert [(e["width"], e["depth"]) for e in got["entries"]] == [(1, 0), (1, 1), (1, 2)]
    # Positive by construction (engine/costs.py, `bounded`), not by the machine's timing.
    assert got["target_step_ms"] > 0 and got["draft_ms"] > 0
    after = sorted(costs.cache_dir().glob("*")) if costs.cache_dir().exists() else []
    assert after == before


def test_transformers_static_batch(tiny_dir: Path) -> None:
    """transformers' generate over a left-padded batch, against ours at as many requests."""
    work = Workload(tiny_dir)
    runs = transformers_baselines(tiny_dir, work, 3, [1, 4])
    assert sorted(runs) == [1, 4] and all(run() > 0 for run in runs.values())
    rows = [
        {"method": m, "concurrency": n, "tok_s": t}
        for m, n, t in (("none", 4, 400.0), ("mtp", 4, 600.0), ("mtp_auto", 4, 1.0))
    ]
    got = batch_against_transformers(rows, [{"method": "mtp", "concurrency": 1}], 200.0, 4)
    assert got["in_process"] == {"none": 2.0, "mtp": 3.0} and got["grpc"] == {}
    assert got["tok_s"] == 200.0 and got["batch"] == 4


def test_the_pair_at_a_static_batchs_width(tiny_dir: Path) -> None:
    """none and mtp through a GPU service child over gRPC, the same tokens, with the outside
    baseline in the same rounds; the static batch's comparison reads their gRPC figures and
    takes their ratios from those rounds."""
    outside = iter([10.0, 20.0])
    rows = pair(tiny_dir, Workload(tiny_dir), 2, 4, 2, lambda: next(outside))
    assert [(r["method"], r["concurrency"]) for r in rows] == [("none", 2), ("mtp", 2)]
    assert all(r["identical"] and r["grpc_tok_s"] > 0 for r in rows)
    assert all(r["transformers_tok_s"] == 15.0 for r in rows)
    got = batch_against_transformers([], rows, 1e9, 2)
    assert set(got["grpc"]) == {"none", "mtp"} and got["grpc_tok_s"]["mtp"] == rows[1]["grpc_tok_s"]
    assert got["grpc"]["mtp"] == rows[1]["grpc_over_transformers"] > 1e-6, "not against 1e9"
    assert got["grpc_transformers_tok_s"] == 15.0


def test_a_baseline_in_the_same_rounds_is_compared_repeat_by_repeat() -> None:
    """Each repeat's ratio, then their median: a machine twice as fast in the second repeat
    leaves the ratio at 2, where the ratio of the medians would not be."""
    got = same_rounds([20.0, 40.0, 60.0], [10.0, 20.0, 20.0])
    assert got == {"transformers_tok_s": 20.0, "grpc_over_transformers": 2.0}
    rows = [
        {"method": "none", "concurrency": 1, "grpc_tok_s": 30.0, **got},
        {"method": "mtp", "concurrency": 1, "grpc_tok_s": 50.0},  # no rounds of its own
        {"method": "none", "concurrency": 4, "grpc_tok_s": 99.0},
    ]
    one = grpc_against_transformers({"tok_s": 25.0}, rows)
    assert one["grpc"] == {"none": 2.0, "mtp": 2.0} and one["grpc_tok_s"]["none"] == 30.0
    assert one["grpc_transformers_tok_s"] == 20.0


def test_figure_lines() -> None:
    rows = [
        {"method": "mtp", "concurrency": 1, "tok_s": 3.0, "accepted_length": 4.0},
        {"method": "none", "concurrency": 1, "tok_s": 2.0, "accepted_length": 1.0},
        {"method": "none", "concurrency": 4, "tok_s": 400.0},
        {"method": "mtp", "concurrency": 4, "tok_s": 600.0},
    ]
    rows[0]["drafts_per_verify"] = 2.0
    cost = {**cost_figures(ENTRIES), "max_depth": 3, "repeats": 5}
    report = {
        "draft_cost": cost,
        "prediction": prediction(rows, cost, []),
        "transformers_generate_batch": batch_against_transformers(rows, [], 200.0, 4),
    }
    draft, predicted, batch = figure_lines(report)
    assert "one MTP draft 1.75 ms: 50.0% of a step" in draft
    assert ": 1.75x; measured 1.50x in process (+16.7%)" in predicted
    assert "static batch of 4" in batch and "mtp 600.0 (3.00x)" in batch
    assert batch.endswith("(over gRPC not measured at 4)")
    del report["transformers_generate_batch"]
    assert len(figure_lines(report)) == 2


def _span(name: str, span_id: int, parent: int, start: int, end: int):
    from opentelemetry.proto.trace.v1 import trace_pb2

    return trace_pb2.Span(
        name=name,
        span_id=span_id.to_bytes(8, "big"),
        parent_span_id=parent.to_bytes(8, "big") if parent else b"",
        start_time_unix_nano=start,
        end_time_unix_nano=end,
    )


def test_overlapping_steps_as_they_cross_the_wire() -> None:
    """A plan overlaps when a step other than its own opened while it ran: its own step's
    span does not count, nor one opened before it began or after it ended."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.resource.v1 import resource_pb2
    from opentelemetry.proto.trace.v1 import trace_pb2

    from tools.bench.report import overlap_line
    from tools.bench.tracing import Sink, overlaps

    def resource_spans(service: str, spans: list) -> trace_pb2.ResourceSpans:
        name = common_pb2.KeyValue(
            key="service.name", value=common_pb2.AnyValue(string_value=service)
        )
        return trace_pb2.ResourceSpans(
            resource=resource_pb2.Resource(attributes=[name]),
            scope_spans=[trace_pb2.ScopeSpans(spans=spans)],
        )

    ms = 1_000_000
    control = [  # steps 1 and 2 sent together, step 3 sent while step 2 runs
        _span("step_mtp", 1, 0, 0, 12 * ms),
        _span("step_mtp", 2, 0, 0, 22 * ms),
        _span("step_mtp", 3, 0, 15 * ms, 32 * ms),
        _span("scheduler_iteration", 9, 0, 0, 40 * ms),
    ]
    service = [
        _span("engine.plan", 11, 1, 1 * ms, 10 * ms),  # nothing opened while it ran
        _span("engine.plan", 12, 2, 11 * ms, 20 * ms),  # step 3 opened 4 ms in
        _span("engine.plan", 13, 3, 21 * ms, 30 * ms),  # only its own step, before it
        _span("verify", 14, 13, 22 * ms, 29 * ms),
    ]
    sink = Sink()
    request = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[resource_spans("control-plane", control)]
    )
    sink.Export(request, None)
    sink.Export(
        trace_service_pb2.ExportTraceServiceRequest(
            resource_spans=[resource_spans("gpu-service", service)]
        ),
        None,
    )
    assert sink.spans == 8 and len(sink.steps) == 6
    o = overlaps(sink.steps)
    assert o == {
        "steps": 3,
        "overlapping": 1,
        "first": {"step_ms": 9.0, "next_step_opened_at_ms": 4.0},
    }
    assert "1 of the service's 3 steps" in overlap_line(o)
    assert overlaps(sink.steps[:3])["first"] is None
