"""Spans of one generation in memory, spans of both processes on the wire, and metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.scheduler.env import Env
from control_plane.scheduler.metrics import Metrics
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.params import MTP
from tests.collect import Outcome
from tests.conftest import SERVE_ARGS
from tests.otlp_receiver import Receiver
from tests.servers import serving

# Slow: starts both processes with an OTLP receiver.
pytestmark = pytest.mark.slow

_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def memory_spans() -> InMemorySpanExporter:
    """The process-wide provider can be set once; this module's tests read it."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)
    return _EXPORTER


@pytest.fixture(params=["fused", "two-calls"])
def in_process_api(tiny_dir: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """The generation API on a grpc.aio server in a thread, over an in-process engine; greedy
    steps the synchronous way (the pipeline's spans have a test of their own), as one
    `decode_step`, or as verify + verdict (`--no-fused-step`)."""
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256))
    opts = SchedulerOptions(fused_step=request.param == "fused", pipeline=False)
    with serving(Scheduler(lambda: engine, ByteTokenizer.default(), opts, Env())) as target:
        yield target


def _settled_spans(exporter: InMemorySpanExporter, timeout: float = 10.0) -> list:
    """The finished spans once the last iteration has ended too: the stream's final message
    leaves before its iteration's root span closes."""
    deadline = time.monotonic() + timeout
    while True:
        spans = exporter.get_finished_spans()
        ids = {s.context.span_id for s in spans}
        if (
            all(s.parent is None or s.parent.span_id in ids or s.name == "generate" for s in spans)
            or time.monotonic() > deadline
        ):
            return spans
        time.sleep(0.01)  # the scheduler thread ends the span right after


def test_one_generation_span_tree(memory_spans: InMemorySpanExporter, in_process_api: str) -> None:
    memory_spans.clear()
    client_tracer = trace.get_tracer("test.client")
    with client_tracer.start_as_current_span("client call") as client:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        with grpc.insecure_channel(in_process_api) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            msgs = list(
                stub.Generate(
                    pb.GenerateRequest(prompt="abc", max_new_tokens=5),
                    metadata=list(carrier.items()),
                )
            )
    assert msgs[-1].finish_reason == "length"
    spans = _settled_spans(memory_spans)
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    ids = {s.context.span_id: s for s in spans}

    (gen,) = by_name["generate"]
    assert gen.kind == SpanKind.SERVER
    assert gen.context.trace_id == client.get_span_context().trace_id, "continues the client"
    assert gen.parent.span_id == client.get_span_context().span_id
    a = gen.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.temperature"] == 0
    assert a["gen_ai.usage.input_tokens"] == 3 and a["gen_ai.usage.output_tokens"] == 5
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.request.model"] and a["met.time_to_first_token_s"] > 0
    assert a["met.spec.verifies"] == 4
    # Which GPU service served it, the request and each step (the scheduler's default name).
    assert a["met.replica"] == "local"
    for name in ("scheduler_iteration", "step_mtp"):
        assert {s.attributes["met.replica"] for s in by_name[name]} == {"local"}

    def parent(s):
        return ids[s.parent.span_id] if s.parent and s.parent.span_id in ids else None

    steps = by_name["step_mtp"]
    assert len(steps) == 4
    for st in steps:
        assert parent(st).name == "scheduler_iteration" and parent(parent(st)) is None
        assert [link.context.span_id for link in st.links] == [gen.context.span_id]
        assert {"met.active", "met.ladder_nd", "met.drafted", "met.accepted"} <= set(st.attributes)
    assert {parent(d).name for d in by_name["dcut"]} == {"step_mtp"}
    (prefill,) = by_name["prefill"]
    assert parent(prefill).name == "scheduler_iteration"
    assert [link.context.span_id for link in prefill.links] == [gen.context.span_id]
    assert {parent(b).name for b in by_name["bootstrap"]} == {"step_mtp"}
    modes = {v.attributes["met.verify.mode"] for v in by_name["verify"]}
    assert modes <= {"bootstrap", "serial", "batched"} and "bootstrap" in modes
    for v in by_name["verify"]:
        assert parent(v).name in ("bootstrap", "step_mtp") and "met.verify.ks" in v.attributes
    fused = "engine.step" in by_name
    assert fused == all(v.attributes.get("met.fused") for v in by_name["verify"])
    if fused:  # the verdict's figures ride on the verify span
        assert all("met.accepted" in v.attributes for v in by_name["verify"])
    # one call: verify > engine.step > engine.verdict; two: verdict > engine.verdict
    above = ("engine.step", "verify") if fused else ("verdict", "step_mtp")
    for name in ("fold", "commit", "propose", "stash", "trim"):
        assert by_name[name], name
        assert {parent(s).name for s in by_name[name]} == {"engine.verdict"}, [
            (parent(s).name, parent(parent(s)).name) for s in by_name[name]
        ]
        assert {parent(parent(s)).name for s in by_name[name]} == {above[0]}, name
        grand = {parent(parent(parent(s))).name for s in by_name[name]}
        assert grand <= {above[1], "bootstrap"}, (name, grand)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pipelined_steps_overlap_and_carry_their_plans(
    memory_spans: InMemorySpanExporter, tiny_dir: Path
) -> None:
    """In process: each step's engine span sits under its own step's span, those of a plan
    of several steps too, and a step's span opens before the previous one closes (step N + 1
    is sent before step N is read)."""
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256))
    scheduler = Scheduler(lambda: engine, ByteTokenizer.default(), SchedulerOptions(), Env())
    memory_spans.clear()
    out = Outcome()
    scheduler.submit(GenRequest("p", (1, 2), 24, method=MTP, ignore_eos=True), out)
    scheduler.start()
    try:
        assert out.done.wait(60) and out.finish is not None
    finally:
        scheduler.stop()
    spans = _settled_spans(memory_spans)
    ids = {s.context.span_id: s for s in spans}
    steps = sorted((s for s in spans if s.name == "step_mtp"), key=lambda s: s.start_time)
    plans = [s for s in spans if s.name == "engine.plan"]
    assert len(plans) >= 3 and all(s.attributes["met.pipelined"] for s in steps)
    assert {ids[p.parent.span_id].name for p in plans} == {"step_mtp"}
    assert len({p.parent.span_id for p in plans}) == len(plans), "a span of its own each"
    assert max(s.attributes["met.plan_steps"] for s in steps) == 2, "plans of two steps"
    assert any(b.start_time < a.end_time for a, b in zip(steps, steps[1:], strict=False))


def test_both_processes_export_one_trace(tiny_dir: Path) -> None:
    receiver = Receiver()
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    old = dict(os.environ)
    os.environ.update(env)
    metrics_port = _free_port()
    try:
        gpu, target = start_gpu_service(tiny_dir, *SERVE_ARGS)
        cp, cp_target = start_control_plane(
            target, "--tokenizer", str(tiny_dir), "--metrics-port", str(metrics_port)
        )
    finally:
        os.environ.clear()
        os.environ.update(old)
    try:
        with grpc.insecure_channel(cp_target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            stream = stub.Generate(
                pb.GenerateRequest(prompt_token_ids=[1, 2], ignore_eos=True, max_new_tokens=120)
            )
            next(stream)
            before = _metrics(metrics_port, target)
            for _ in range(3):
                next(stream)
            during = _metrics(metrics_port, target)
            drafted = _by_method(metrics_port, target, "met:spec_decode_num_draft_tokens_total")
            list(stream)
    finally:
        assert stop(cp) == 0 and stop(gpu) == 0  # graceful: both flush their spans
        receiver.stop()
    assert during["met:generation_tokens_total"] > before["met:generation_tokens_total"]
    assert during["met:scheduler_steps_total"] > before["met:scheduler_steps_total"]
    assert during["met:time_to_first_token_seconds_count"] == 1
    assert during["met:num_requests_running"] == 1
    # Counted by the method that drafted (the server's choice, by default, names its own).
    assert drafted and set(drafted) <= {"mtp", "dflash", "prompt_lookup"}, drafted
    assert during["met:spec_decode_step_width"] >= 1

    spans = receiver.spans
    services = {s.service for s in spans}
    assert {"gpu-service", "control-plane"} <= services
    ids = {s.span_id: s for s in spans}
    # Greedy steps are pipelined: each plan runs on the service under its step's span.
    plans = [s for s in spans if s.service == "gpu-service" and s.name == "engine.plan"]
    assert plans and all(s.kind == 2 for s in plans)  # SPAN_KIND_SERVER
    steps = [s for s in spans if s.service == "control-plane" and s.name == "step_mtp"]
    for p in plans:
        step = ids[p.parent_id]
        assert step.name == "step_mtp" and step.service == "control-plane"
        assert step.trace_id == p.trace_id
    assert len({p.parent_id for p in plans}) == len(plans), "each step under its own span"
    # Two steps overlap across the processes: the control plane opened step N + 1 while the
    # service ran step N.
    assert any(
        p.start_ns < s.start_ns < p.end_ns and s.span_id != p.parent_id
        for p in plans
        for s in steps
    )
    verdict_children = {
        s.name
        for s in spans
        if s.service == "gpu-service" and ids.get(s.parent_id, s).name == "engine.verdict"
    }
    assert {"fold", "commit", "propose", "trim", "stash"} <= verdict_children


def _by_method(port: int, replica: str, name: str) -> dict[str, float]:
    """A family's samples by their `method` label."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        s.labels["method"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.labels.get("replica") == replica
    }


def _metrics(port: int, replica: str) -> dict[str, float]:
    """The samples labelled with `replica` and its model alone (every series carries both)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.keys() == {"replica", "model_name"} and s.labels["replica"] == replica
    }


def test_no_endpoint_exports_nothing(tmp_path: Path) -> None:
    """With no endpoint and no OTEL_TRACES_EXPORTER, no SDK is installed."""
    code = (
        "import os; os.environ.pop('OTEL_EXPORTER_OTLP_ENDPOINT', None);"
        "from protos.telemetry import setup_tracing; from opentelemetry import trace;"
        "setup_tracing('x'); print(type(trace.get_tracer_provider()).__name__)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.stdout.strip() == "ProxyTracerProvider", out.stderr
    env["OTEL_TRACES_EXPORTER"] = "console"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.stdout.strip() == "TracerProvider", out.stderr


def test_a_prefix_hit_is_on_its_restore_span(
    memory_spans: InMemorySpanExporter, tiny_dir: Path
) -> None:
    """The second request sharing a 130-token prompt start goes on from the first's snapshot
    at its last whole block: the `prefix_restore` span that restored it says 128 tokens."""
    svc = ServiceConfig(verify_tiers="4:3", max_context=256, prefix_snapshots=2)
    engine = Engine(tiny_dir, svc)
    scheduler = Scheduler(lambda: engine, ByteTokenizer.default(), SchedulerOptions(), Env())
    scheduler.start()
    try:
        for i, tail in enumerate([(1, 2), (3, 4)]):
            memory_spans.clear()
            out = Outcome()
            scheduler.submit(GenRequest(f"p{i}", tuple(range(5, 135)) + tail, 4), out)
            assert out.done.wait(60) and out.finish is not None
    finally:
        scheduler.stop()
    # Stopped, the loop's thread has ended every span it began (the clears above drop the
    # first request's parents: waiting for them to end would wait for nothing).
    restores = [s for s in memory_spans.get_finished_spans() if s.name == "prefix_restore"]
    assert [s.attributes["met.prefix_hit_tokens"] for s in restores] == [128]


def test_an_answer_snapshot_is_a_trace_of_its_own(
    memory_spans: InMemorySpanExporter, tiny_dir: Path
) -> None:
    """A 70-token prompt (snapshotted at 64) and a 70-token answer: once idle, the loop
    prefills the answer's 64 tokens from 64 to 128 again, under a root `prefix_answer` span."""
    engine = Engine(
        tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256, prefix_snapshots=2)
    )
    scheduler = Scheduler(lambda: engine, ByteTokenizer.default(), SchedulerOptions(), Env())
    scheduler.start()
    try:
        out = Outcome()
        scheduler.submit(GenRequest("a", tuple(range(5, 75)), 70, ignore_eos=True), out)
        assert out.done.wait(60) and out.finish is not None
        assert scheduler.settle(60)
    finally:
        scheduler.stop()
    (answer,) = [s for s in memory_spans.get_finished_spans() if s.name == "prefix_answer"]
    assert answer.parent is None and answer.attributes is not None
    assert answer.attributes["met.replica"] == "local"
    assert answer.attributes["met.prefix_hit_tokens"] == 64
    assert answer.attributes["met.prefix_answer_tokens"] == 64


def test_a_preemption_is_an_event_of_its_iteration(
    memory_spans: InMemorySpanExporter, tiny_dir: Path
) -> None:
    """A pool of three blocks, a 100-token prompt asking for 100 more and a short request after
    it: the short one is preempted to make room for the first (which fails alone once it needs
    a fourth), and the iteration that preempted it says so, with the tokens it held."""
    svc = ServiceConfig(verify_tiers="8:3", max_context=512, kv_blocks=3)
    engine = Engine(tiny_dir, svc)
    opts = SchedulerOptions(prefix_cache=False)
    scheduler = Scheduler(lambda: engine, ByteTokenizer.default(), opts, Env())
    scheduler.start()
    memory_spans.clear()
    try:
        big, small = Outcome(), Outcome()
        scheduler.submit(GenRequest("big", tuple(range(5, 105)), 100, ignore_eos=True), big)
        scheduler.submit(GenRequest("small", tuple(range(5, 25)), 30, ignore_eos=True), small)
        assert big.done.wait(60) and small.done.wait(60) and small.failure is None
    finally:
        scheduler.stop()
    events = [
        (s.name, dict(e.attributes or {}))
        for s in memory_spans.get_finished_spans()
        for e in s.events
        if e.name == "preempt"
    ]
    assert events, "a preempt event"
    name, attrs = events[0]
    assert name == "scheduler_iteration" and attrs["met.request_id"] == "small"
    assert isinstance(attrs["met.tokens"], int) and attrs["met.tokens"] > 20
    assert attrs["met.preemptions"] == 1, "its first"


def test_metrics_are_true_when_idle(tiny_dir: Path) -> None:
    """After the last request ends (its slot freed once the plan in flight is read back), the
    gauges say what `GetStats` says: nothing running, every slot free."""
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256))
    metrics = Metrics()
    scheduler = Scheduler(
        lambda: engine, ByteTokenizer.default(), SchedulerOptions(), Env(), metrics
    )
    scheduler.start()
    try:
        out = Outcome()
        scheduler.submit(GenRequest("one", (1, 2), 24, ignore_eos=True, method=MTP), out)
        assert out.done.wait(60) and out.finish is not None
        assert scheduler.settle(30)
        snap = scheduler.snapshot()
    finally:
        scheduler.stop()

    def gauge(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"replica": scheduler.replica})

    assert (snap["active"], snap["free_slots"]) == (0, engine.capabilities().num_slots)
    assert gauge("met:num_requests_running") == 0
    assert gauge("met:free_slots") == snap["free_slots"]
