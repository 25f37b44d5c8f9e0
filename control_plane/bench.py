"""`met bench`: what speculation buys, in one run so the machine's drift cancels out.

On one checkpoint (default: the bundled one), each figure a median over repeats:
- `none` vs `mtp` vs `prompt_lookup` (and `mtp` with the measured cost model choosing the
  width) at several concurrencies: output tokens per second, mean accepted length, acceptance
  per draft position; all must produce identical tokens (the run fails otherwise);
- batched vs serial verify (`METRALE_NO_MTP_BATCH_VERIFY`);
- in process vs over gRPC (a GPU service child process): the split's cost per step;
- the verify buffers' bytes with the slot tiers vs every slot at full capacity;
- tracing off vs exporting to a local OTLP receiver (both processes);
- transformers' own `generate` on the same checkpoint, the outside baseline.
Prompts are the checkpoint's held-out ones when it ships them. Prints a table, writes JSON
(`--out`) and a PNG chart (`--chart`). `--quick` is the CI-sized smoke run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

from control_plane.env import Env
from control_plane.scheduler.loop import Scheduler, SchedulerOptions
from control_plane.scheduler.seq import MTP, NONE, PROMPT_LOOKUP, Finish, GenRequest
from protos.defaults import DEFAULT_MODEL_DIR
from protos.model import Model

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(",
    "for i in range(10):\n    print(",
    "with open(path) as f:\n    for line in f:\n",
]


def _serve(
    connect: Callable[[], Model],
    reqs: list[GenRequest],
    env: Env,
    tokenizer,
    options: dict | None = None,
) -> dict:
    """All of `reqs` at once through a scheduler; tokens per request and the figures."""
    opts = SchedulerOptions(max_queue=len(reqs), **(options or {}))
    sched = Scheduler(connect, tokenizer, opts, env)
    sched.start()
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    first: dict[str, float] = {}  # when each request's first token arrived
    left, done = [len(reqs)], threading.Event()
    lock = threading.Lock()

    def sink_for(rid: str) -> Callable[[object], None]:
        def sink(ev: object) -> None:
            with lock:
                tokens[rid] += getattr(ev, "token_ids", [])
                if tokens[rid] and rid not in first:
                    first[rid] = time.perf_counter()
                if isinstance(ev, Finish) or not hasattr(ev, "token_ids"):
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        return sink

    t0 = time.perf_counter()
    for r in reqs:
        sched.submit(r, sink_for(r.request_id))
    done.wait()
    end = time.perf_counter()
    seconds = end - t0
    snap = sched.snapshot()
    sched.stop()
    spec = snap["spec"]
    made = sum(map(len, tokens.values()))
    # After every request has its first token: the decode phase, prefill behind it.
    decode = end - max(first.values(), default=t0)
    return {
        "tokens": tokens,
        "tok_s": made / seconds,
        "decode_tok_s": (made - len(first)) / decode if decode > 0 else 0.0,
        "step_ms": seconds / max(snap["counters"].steps, 1) * 1e3,
        "accepted_length": spec.mean_accepted_length,
        "acceptance": spec.acceptance_at,
        "spec": spec,
    }


FIXED_DRAFTS = Env(None, True, False, False, no_dcut=True)  # num_drafts at every verify


def serve_texts(
    connect: Callable[[], Model],
    model_dir: Path,
    prompts: list[str],
    method: str,
    tokens: int,
    env: Env | None = None,
) -> dict:
    """Greedy continuations of `prompts`, all at once: texts in order, and the spec stats."""
    from control_plane.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    reqs = [
        GenRequest(f"{method}-{i}", tuple(tok.encode(p)), tokens, method=method)
        for i, p in enumerate(prompts)
    ]
    r = _serve(connect, reqs, env or Env(None, False, False, False), tok)
    r["texts"] = [tok.decode(r["tokens"][q.request_id]) for q in reqs]
    return r


class Workload:
    """The checkpoint's tokenizer and prompts: its held-out prompts when it ships them
    (`held_out_prompts.json`, written by `met train`), else a few generic ones."""

    def __init__(self, model_dir: Path) -> None:
        from control_plane.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        path = model_dir / "held_out_prompts.json"
        texts = [p["prompt"] for p in json.loads(path.read_text())] if path.exists() else PROMPTS
        self.prompts = [tuple(self.tokenizer.encode(t)) for t in texts]

    def requests(
        self, method: str, n: int, tokens: int, label: str | None = None
    ) -> list[GenRequest]:
        return [
            GenRequest(
                f"{label or method}-{i}",
                self.prompts[i % len(self.prompts)],
                tokens,
                method=method,
                ignore_eos=True,
            )
            for i in range(n)
        ]


# label -> (method, scheduler options): the methods, and mtp with the measured cost model
# choosing each step's width (`--spec-cost-model measured`) in place of the static ladder.
MTP_MEASURED = "mtp_measured"
VARIANTS = {
    NONE: (NONE, {}),
    MTP: (MTP, {}),
    MTP_MEASURED: (MTP, {"spec_cost_model": "measured"}),
    PROMPT_LOOKUP: (PROMPT_LOOKUP, {}),
}


def _median(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for key in ("tok_s", "decode_tok_s", "step_ms"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def methods(
    connect,
    work: Workload,
    concurrency: list[int],
    tokens: int,
    repeats: int,
    baseline: Callable[[], float] | None = None,
) -> tuple[list, list, float | None]:
    """Every method at every concurrency, repeats interleaved so that drift spreads over the
    methods alike; `baseline` (tok/s of one outside generate) runs in the same rounds at one
    request. -> (rows, failures, the baseline's median tok/s)"""
    rows, failures, outside = [], [], []
    env = Env(None, False, False, False)
    for n in concurrency:
        runs: dict[str, list[dict]] = {label: [] for label in VARIANTS}
        for _ in range(repeats):
            for label, (m, options) in VARIANTS.items():
                reqs = work.requests(m, n, tokens, label)
                runs[label].append(_serve(connect, reqs, env, work.tokenizer, options))
            if baseline is not None and n == 1:
                outside.append(baseline())
        results = {m: _median(r) for m, r in runs.items()}
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
    return rows, failures, statistics.median(outside) if outside else None


VERIFY_ARMS = {"batched": Env(None, False, False, False), "serial": Env(None, False, False, True)}


def batch_vs_serial(
    connect, work: Workload, concurrency: list[int], tokens: int, repeats: int
) -> list[dict]:
    """mtp with batched and with serial verify, repeats interleaved. Both arms prefill in one
    batched call; `decode_tok_s` counts the tokens after every request's first, over the
    time after it, where only the verify differs."""
    rows = []
    for n in concurrency:
        runs: dict[str, list[dict]] = {label: [] for label in VERIFY_ARMS}
        for _ in range(repeats):
            for label, env in VERIFY_ARMS.items():
                reqs = work.requests(MTP, n, tokens)
                runs[label].append(_serve(connect, reqs, env, work.tokenizer))
        for label, r in runs.items():
            m = _median(r)
            rows.append(
                {
                    "verify": label,
                    "concurrency": n,
                    "tok_s": m["tok_s"],
                    "decode_tok_s": m["decode_tok_s"],
                    "step_ms": m["step_ms"],
                }
            )
    return rows


def split(
    model_dir: Path,
    local_connect,
    work: Workload,
    concurrency: list[int],
    tokens: int,
    repeats: int,
) -> list[dict]:
    """Each method in process and through a GPU service child process over gRPC, greedy steps
    as one `DecodeStep` round trip and as two calls (`METRALE_NO_FUSED_STEP`)."""
    from control_plane.client import GrpcModel
    from control_plane.launch import start_gpu_service, stop

    proc, target = start_gpu_service(model_dir)
    rows = []
    try:
        fused = Env(None, False, False, False)
        two_calls = Env(None, False, False, False, no_fused_step=True)
        remote = lambda: GrpcModel(target)  # noqa: E731
        arms = (("local", local_connect, fused), ("grpc", remote, fused))
        arms += (("grpc_two_calls", remote, two_calls),)
        for n in concurrency:
            runs: dict[tuple[str, str], list[dict]] = {}
            for _ in range(repeats):  # methods and arms interleaved: drift falls on all alike
                for m in (NONE, MTP):
                    for where, connect, env in arms:
                        reqs = work.requests(m, n, tokens)
                        got = _serve(connect, reqs, env, work.tokenizer)
                        runs.setdefault((m, where), []).append(got)
            for m in (NONE, MTP):
                local, grpc_, two = (
                    _median(runs[(m, where)]) for where in ("local", "grpc", "grpc_two_calls")
                )
                rows.append(
                    {
                        "method": m,
                        "concurrency": n,
                        "in_process_tok_s": local["tok_s"],
                        "grpc_tok_s": grpc_["tok_s"],
                        "grpc_two_calls_tok_s": two["tok_s"],
                        "in_process_step_ms": local["step_ms"],
                        "grpc_step_ms": grpc_["step_ms"],
                        "grpc_two_calls_step_ms": two["step_ms"],
                        "overhead": grpc_["step_ms"] / local["step_ms"] - 1,
                        "overhead_two_calls": two["step_ms"] / local["step_ms"] - 1,
                        "accepted_length": grpc_["accepted_length"],
                    }
                )
    finally:
        stop(proc)
    return rows


def speedups(split_rows: list[dict]) -> list[dict]:
    """mtp over none at each concurrency, in process and over gRPC."""
    by = {(r["method"], r["concurrency"]): r for r in split_rows}
    return [
        {
            "concurrency": n,
            "in_process": by[(MTP, n)]["in_process_tok_s"] / by[(NONE, n)]["in_process_tok_s"],
            "grpc": by[(MTP, n)]["grpc_tok_s"] / by[(NONE, n)]["grpc_tok_s"],
        }
        for (m, n) in by
        if m == MTP and (NONE, n) in by
    ]


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


def transformers_baseline(
    model_dir: Path, work: Workload, tokens: int
) -> Callable[[], float] | None:
    """transformers' own greedy generate on the same checkpoint (no speculation: it offers
    none for this model), one request: a callable that runs it once and returns its tok/s;
    None when transformers is not installed."""
    try:
        import torch
        from transformers import Qwen3NextForCausalLM
    except ImportError:
        return None
    # fp32, as our engine computes on a CPU (bf16 weights widen exactly).
    model = Qwen3NextForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([list(work.prompts[0])])

    def once() -> float:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)

    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
    return once


def against_transformers(rows: list[dict], outside: float) -> dict:
    """Our in-process tok/s at one request over transformers' generate, per method."""
    ours = {r["method"]: r["tok_s"] for r in rows if r["concurrency"] == 1}
    return {
        "tok_s": outside,
        "threads": 1,
        "in_process": {m: v / outside for m, v in ours.items()},
    }


def batched_over_serial(rows: list[dict]) -> dict[int, dict[str, float]]:
    """Per concurrency: batched over serial, end to end and in the decode phase."""
    by = {(r["verify"], r["concurrency"]): r for r in rows}
    return {
        n: {
            key: by[("batched", n)][key] / by[("serial", n)][key]
            for key in ("tok_s", "decode_tok_s")
        }
        for (v, n) in by
        if v == "batched"
    }


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

    from control_plane.bench_report import draw_chart, markdown, print_table
    from gpu_service.config import ServiceConfig
    from gpu_service.engine import Engine

    torch.set_num_threads(1)  # as the GPU service runs its engine
    engine = Engine(args.model, ServiceConfig())
    work = Workload(args.model)
    quick = args.quick
    conc, tokens, repeats = ([1, 4], 12, 1) if quick else ([1, 4, 16], 64, 5)
    report: dict = {"model": engine.name, "quick": quick, "machine": _machine()}
    local = lambda: engine  # noqa: E731
    hf = None if quick else transformers_baseline(args.model, work, tokens)
    report["methods"], failures, outside = methods(local, work, conc, tokens, repeats, hf)
    if outside is not None:
        report["transformers_generate"] = against_transformers(report["methods"], outside)
    report["batch_vs_serial"] = batch_vs_serial(
        local, work, [4] if quick else [8, 16], tokens, repeats
    )
    report["batched_over_serial"] = batched_over_serial(report["batch_vs_serial"])
    report["split"] = split(args.model, local, work, [1] if quick else [1, 4], tokens, repeats)
    report["speedup"] = speedups(report["split"])
    report["memory"] = memory(engine)
    if not quick:
        report["tracing"] = tracing(4, tokens)
    report["failures"] = failures
    print_table(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(report))
    chart = args.chart or (args.out.with_suffix(".png") if args.out else None)
    if chart:
        draw_chart(report, chart)
        print(f"chart: {chart}")
    return 1 if failures else 0


def _machine() -> dict:
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "engine_threads": torch.get_num_threads(),
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--quick", action="store_true", help="the CI-sized smoke run")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument(
        "--chart", type=Path, default=None, help="the PNG chart (default: --out with .png)"
    )
    parser.add_argument("--markdown", type=Path, default=None, help="the report's tables")
