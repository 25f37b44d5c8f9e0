"""`met bench`: what speculation buys, in one run so the machine's drift cancels out.

On one checkpoint (default: the bundled one), each figure a median over repeats:
- `none` vs `mtp` vs `prompt_lookup` at several concurrencies: output tokens per second, mean
  accepted length, acceptance per draft position; the three must produce identical tokens (the
  run fails otherwise);
- batched vs serial verify (`METRALE_NO_MTP_BATCH_VERIFY`);
- in process vs over gRPC (a GPU service child process): the split's cost per step;
- the verify buffers' bytes with the slot tiers vs every slot at full capacity.
Prints a table and writes JSON (`--out`). `--quick` is the CI-sized smoke run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from control_plane.env import Env
from control_plane.scheduler.loop import Scheduler, SchedulerOptions
from control_plane.scheduler.seq import MTP, NONE, PROMPT_LOOKUP, Finish, GenRequest
from gpu_service.defaults import DEFAULT_MODEL_DIR
from gpu_service.interface import Model

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(",
    "for i in range(10):\n    print(",
    "with open(path) as f:\n    for line in f:\n",
]


def _serve(connect: Callable[[], Model], reqs: list[GenRequest], env: Env) -> dict:
    """All of `reqs` at once through a scheduler; tokens per request and the figures."""
    sched = Scheduler(connect, _tokenizer(), SchedulerOptions(max_queue=len(reqs)), env)
    sched.start()
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    left, done = [len(reqs)], threading.Event()
    lock = threading.Lock()

    def sink_for(rid: str) -> Callable[[object], None]:
        def sink(ev: object) -> None:
            with lock:
                tokens[rid] += getattr(ev, "token_ids", [])
                if isinstance(ev, Finish) or not hasattr(ev, "token_ids"):
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        return sink

    t0 = time.perf_counter()
    for r in reqs:
        sched.submit(r, sink_for(r.request_id))
    done.wait()
    seconds = time.perf_counter() - t0
    snap = sched.snapshot()
    sched.stop()
    spec = snap["spec"]
    return {
        "tokens": tokens,
        "tok_s": sum(map(len, tokens.values())) / seconds,
        "step_ms": seconds / max(snap["counters"].steps, 1) * 1e3,
        "accepted_length": spec.mean_accepted_length,
        "acceptance": spec.acceptance_at,
    }


def _tokenizer():
    from gpu_service.tokenizer import ByteTokenizer

    return ByteTokenizer.default()


def _requests(method: str, n: int, tokens: int) -> list[GenRequest]:
    tok = _tokenizer()
    return [
        GenRequest(
            f"{method}-{i}",
            tuple(tok.encode(PROMPTS[i % len(PROMPTS)] + f"# {i}\n")),
            tokens,
            method=method,
            ignore_eos=True,
        )
        for i in range(n)
    ]


def _median(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for key in ("tok_s", "step_ms"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def methods(connect, concurrency: list[int], tokens: int, repeats: int) -> tuple[list, list]:
    rows, failures = [], []
    env = Env(None, False, False, False)
    for n in concurrency:
        results = {
            m: _median([_serve(connect, _requests(m, n, tokens), env) for _ in range(repeats)])
            for m in (NONE, MTP, PROMPT_LOOKUP)
        }
        base = [results[NONE]["tokens"][f"{NONE}-{i}"] for i in range(n)]
        for m, r in results.items():
            same = [r["tokens"][f"{m}-{i}"] for i in range(n)] == base
            if not same:
                failures.append(f"{m} at {n} concurrent differs from none")
            rows.append(
                {
                    "method": m,
                    "concurrency": n,
                    "tok_s": r["tok_s"],
                    "accepted_length": r["accepted_length"],
                    "acceptance_per_position": r["acceptance"],
                    "identical": same,
                }
            )
    return rows, failures


def batch_vs_serial(connect, concurrency: list[int], tokens: int) -> list[dict]:
    rows = []
    for n in concurrency:
        for label, env in (
            ("batched", Env(None, False, False, False)),
            ("serial", Env(None, False, False, True)),
        ):
            r = _serve(connect, _requests(MTP, n, tokens), env)
            rows.append(
                {"verify": label, "concurrency": n, "tok_s": r["tok_s"], "step_ms": r["step_ms"]}
            )
    return rows


def split(model_dir: Path, local_connect, concurrency: list[int], tokens: int) -> list[dict]:
    from control_plane.client import GrpcModel
    from control_plane.launch import start_gpu_service, stop

    proc, target = start_gpu_service(model_dir)
    rows = []
    try:
        env = Env(None, False, False, False)
        for n in concurrency:
            local = _serve(local_connect, _requests(MTP, n, tokens), env)
            remote = _serve(lambda: GrpcModel(target), _requests(MTP, n, tokens), env)
            rows.append(
                {
                    "concurrency": n,
                    "in_process_step_ms": local["step_ms"],
                    "grpc_step_ms": remote["step_ms"],
                    "overhead": remote["step_ms"] / local["step_ms"] - 1,
                }
            )
    finally:
        stop(proc)
    return rows


def tracing(concurrency: int, tokens: int) -> dict:
    """Both processes with tracing off, then exporting to a local OTLP sink."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    from control_plane.bench_tracing import _run, _Sink

    sink = _Sink()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        off = _run(None, concurrency, tokens)
        on = _run(f"http://127.0.0.1:{port}", concurrency, tokens)
    finally:
        server.stop(None)
    return {
        "concurrency": concurrency,
        "disabled_tok_s": off,
        "exported_tok_s": on,
        "spans": sink.spans,
    }


def transformers_baseline(model_dir: Path, tokens: int) -> dict | None:
    """transformers' own greedy generate on the same checkpoint (no speculation: it offers
    none for this model), one request; None when transformers is not installed."""
    try:
        import torch
        from transformers import Qwen3NextForCausalLM
    except ImportError:
        return None
    model = Qwen3NextForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([list(_tokenizer().encode(PROMPTS[0]))])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    made = out.shape[1] - ids.shape[1]
    return {"tok_s": made / (time.perf_counter() - t0), "tokens": made}


def memory(engine) -> dict:
    cfg, svc = engine.cfg, engine.svc
    per_row = len(cfg.linear_layers) * (
        cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        + (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * engine.model.dtype.itemsize
    )
    caps = svc.slot_verify_drafts
    return {
        "tiers": svc.verify_tiers,
        "tiered_bytes": per_row * sum(c + 1 for c in caps),
        "full_capacity_bytes": per_row * len(caps) * (max(caps) + 1),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from gpu_service.checkpoint import ensure_weights
    from gpu_service.config import ServiceConfig
    from gpu_service.engine import Engine

    if args.model.resolve() == DEFAULT_MODEL_DIR:
        ensure_weights(args.model)
    torch.set_num_threads(1)  # as the GPU service runs its engine
    engine = Engine(args.model, ServiceConfig())
    quick = args.quick
    conc, tokens, repeats = ([1, 4], 12, 1) if quick else ([1, 4, 16], 48, 3)
    report: dict = {"model": engine.name, "quick": quick}
    report["methods"], failures = methods(lambda: engine, conc, tokens, repeats)
    report["batch_vs_serial"] = batch_vs_serial(lambda: engine, [4] if quick else [8, 16], tokens)
    report["split"] = split(args.model, lambda: engine, [1] if quick else [1, 4], tokens)
    report["memory"] = memory(engine)
    if not quick:
        report["tracing"] = tracing(4, tokens)
        report["transformers_generate"] = transformers_baseline(args.model, tokens)
    report["failures"] = failures
    _print(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failures else 0


def _print(report: dict) -> None:
    print(f"model {report['model']}")
    print("method         conc   tok/s   accepted length   identical")
    for r in report["methods"]:
        print(
            f"{r['method']:14} {r['concurrency']:4d} {r['tok_s']:7.1f}   "
            f"{r['accepted_length']:15.2f}   {r['identical']}"
        )
    for r in report["batch_vs_serial"]:
        print(
            f"verify {r['verify']:8} at {r['concurrency']:2d}: {r['tok_s']:7.1f} tok/s, "
            f"{r['step_ms']:.1f} ms a step"
        )
    for r in report["split"]:
        print(
            f"split at {r['concurrency']}: {r['in_process_step_ms']:.1f} ms in process, "
            f"{r['grpc_step_ms']:.1f} over gRPC ({r['overhead'] * 100:+.0f}%)"
        )
    m = report["memory"]
    print(
        f"verify buffers: {m['tiered_bytes'] / 2**20:.1f} MiB with tiers {m['tiers']}, "
        f"{m['full_capacity_bytes'] / 2**20:.1f} MiB at full capacity"
    )
    if "tracing" in report:
        t = report["tracing"]
        print(
            f"tracing at {t['concurrency']}: {t['disabled_tok_s']:.1f} tok/s off, "
            f"{t['exported_tok_s']:.1f} exported ({t['spans']} spans)"
        )
    if report.get("transformers_generate"):
        print(
            f"transformers generate (1 request, greedy): "
            f"{report['transformers_generate']['tok_s']:.1f} tok/s"
        )
    for f in report["failures"]:
        print(f"FAIL: {f}", file=sys.stderr)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--quick", action="store_true", help="the CI-sized smoke run")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
