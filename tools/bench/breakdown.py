"""Where a step's time goes through both processes: `met bench`'s breakdown section, and alone
as `python -m tools.bench.breakdown`.

A GPU service and a control plane, both exporting their spans over OTLP to a local sink, serve
greedy MTP requests at each concurrency (a warm-up round first, not counted; the service's
background compiles settled after it). From the service's spans of the counted rounds, per
step (one `engine.verify` a step):
- forward: the verify's forward and the drafter's chain (`engine.verify` and `propose`, each
  with the argmax it reads), what the compiled graph replays;
- service, other: the rest of the service's plan (`engine.plan`: the verdict, fold and commit,
  the drafts' bookkeeping, the stats, the wire's conversions on the service's side);
- outside the service: the rest of the step's period (the control plane's step, its verdict
  and streaming, the gRPC hop both ways), the period being the counted rounds' span of plans
  over their steps.
`overhead` is the step's period less its forward: what the issue's 0.3 ms at one sequence
bounds."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent import futures

import grpc

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from protos.defaults import DEFAULT_MODEL_DIR
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tools.bench.tracing import Sink, StepSpan, local_sink
from tools.bench.workload import settled

KEPT = ("engine.plan", "engine.verify", "propose")
FORWARD = ("engine.verify", "propose")


def _ms(s: StepSpan) -> float:
    return (s.end_ns - s.start_ns) / 1e6


def split(spans: list[StepSpan]) -> dict:
    """Per step (ms): its period, its forward, the service's other work, what is outside."""
    plans = sorted((s for s in spans if s.name == "engine.plan"), key=lambda s: s.start_ns)
    steps = sum(1 for s in spans if s.name == "engine.verify")
    if not plans or not steps:
        return {}
    period = (plans[-1].end_ns - plans[0].start_ns) / 1e6 / steps
    forward = sum(_ms(s) for s in spans if s.name in FORWARD) / steps
    service = sum(_ms(p) for p in plans) / steps
    return {
        "steps": steps,
        "period_ms": period,
        "forward_ms": forward,
        "service_other_ms": service - forward,
        "outside_ms": period - service,
        "overhead_ms": period - forward,
    }


def _round(target: str, n: int, tokens: int) -> None:
    def one(i: int) -> None:
        with grpc.insecure_channel(target) as channel:
            request = pb.GenerateRequest(
                prompt_token_ids=list(range(3 + i, 19 + i)),
                max_new_tokens=tokens,
                ignore_eos=True,
                speculative_method=pb.SPECULATIVE_METHOD_MTP,
            )
            for _ in pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=600):
                pass

    with futures.ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def breakdown(
    concurrency: list[int], tokens: int, rounds: int, service: tuple[str, ...] = ()
) -> list[dict]:
    """Both processes exporting to a local sink; at each concurrency a warm-up round, then
    `rounds` counted -> a row each."""
    with local_sink(2, KEPT) as (sink, endpoint):
        return _measured(sink, endpoint, concurrency, tokens, rounds, service)


def _measured(
    sink: Sink, endpoint: str, concurrency: list[int], tokens: int, rounds: int, service
) -> list[dict]:
    saved = dict(os.environ)
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # ms: a round's spans sent within the wait
    try:
        gpu, target = start_gpu_service(DEFAULT_MODEL_DIR, *service)
        cp, cp_target = start_control_plane(target)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    rows = []
    model = GrpcModel(target)
    try:
        for n in concurrency:
            _round(cp_target, n, tokens)
            settled(lambda: model)  # what the warm-up's calls queued, built
            time.sleep(1.0)  # the exporters' batches of the warm-up reach the sink
            sink.take()
            got = []
            for _ in range(rounds):
                _round(cp_target, n, tokens)
                time.sleep(1.0)  # the same for the round's spans
                got.append(split(sink.take()))
            row = {k: statistics.median(g[k] for g in got) for k in got[0]}
            rows.append({"concurrency": n, **row})
    finally:
        model.close()
        stop(cp)
        stop(gpu)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--service", default="", help="the GPU service's further flags")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = breakdown(args.concurrency, args.tokens, args.rounds, tuple(args.service.split()))
    from tools.bench.report import breakdown_lines

    print(json.dumps(rows, indent=1) if args.json else "\n".join(breakdown_lines(rows)))


if __name__ == "__main__":
    main()
