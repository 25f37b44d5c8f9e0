"""Requests through a scheduler, timed: the prompts, the requests built from them, and one
call that serves a batch of requests and returns its tokens and figures."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from control_plane.replicas.router import Drives, Router
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import Finish, GenRequest
from protos.defaults import DEFAULT_MODEL_DIR
from protos.hub import model_path
from protos.model import ServingModel
from protos.params import NONE

# A serving bench's load: requests sent at once, each a window of the prompts and tokens out.
LOAD_FLAGS = {
    "requests": (8, "requests sent at once"),
    "prompt": (200, "prompt tokens of each"),
    "tokens": (200, "tokens out of each"),
}


def load_parser(module: str, description: str | None) -> argparse.ArgumentParser:
    """`python -m module`'s parser with the load's flags and `--model`."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--model", type=model_path, default=DEFAULT_MODEL_DIR)
    for name, (default, text) in LOAD_FLAGS.items():
        parser.add_argument(f"--{name}", type=int, default=default, help=text)
    return parser


def parse_load(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, each of the load's counts at least 1."""
    args = parser.parse_args(argv)
    for name in LOAD_FLAGS:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return args


def settled(connect: Callable[[], ServingModel], poll_s: float = 0.5) -> None:
    """Until the model compiles nothing in the background (`Capabilities.compiles_pending`):
    counted rounds then run the graphs their work reaches, not a smaller bucket's in parts
    beside a compiler."""
    model = connect()
    while model.capabilities().compiles_pending:
        time.sleep(poll_s)


def served(svc):
    """`svc` (a `ServiceConfig`) compiled where `met gpu-service serve` given neither
    `--compile` nor `--no-compile` compiles on this machine: an engine in process then steps as
    the bench's GPU service children do, and the two arms of a comparison run one forward."""
    import os
    from dataclasses import replace

    from gpu_service.engine import compiled
    from gpu_service.engine.device import resolve_device

    on, _ = compiled.decide(None, resolve_device("auto"), 1, os.environ)
    return replace(svc, compile=on)


def scratch_env(directory: str) -> dict[str, str]:
    """The environment of a run whose cost tables live in `directory` alone (its GPU service
    children inherit it) while compiles keep reading and filling the user's compile cache:
    a compile costs minutes cold, and inductor keys its entries by graph and flags, so no
    figure depends on which entries were there."""
    from gpu_service.engine import compiled

    return {"XDG_CACHE_HOME": directory, compiled.CACHE_ENV: str(compiled.cache_dir())}


PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(",
    "for i in range(10):\n    print(",
    "with open(path) as f:\n    for line in f:\n",
]


def serve(
    connect: Callable[[], ServingModel],
    reqs: list[GenRequest],
    tokenizer,
    options: dict | None = None,
    env: Env | None = None,
) -> dict:
    """All of `reqs` at once through a scheduler with `options` (scheduler option names);
    tokens per request and the figures. The `METRALE_*` switches are ignored unless `env`
    is given, so an arm is what its options say."""
    return drive(Scheduler(connect, tokenizer, options_for(reqs, options), env or Env()), reqs)


def options_for(reqs: list[GenRequest], options: dict | None = None) -> SchedulerOptions:
    """Scheduler options that queue every one of `reqs` at once."""
    return SchedulerOptions(max_queue=len(reqs), **(options or {}))


def drive(sched: Drives, reqs: list[GenRequest]) -> dict:
    """All of `reqs` at once through `sched` (a scheduler, or a router over several), which
    this starts and stops: tokens per request and the figures, and the requests each replica
    took when it is a router."""
    sched.start()
    # Connected before the clock starts, as a served control plane is before its first
    # request: a fresh channel's first calls are not a step's cost.
    for s in [r.scheduler for r in sched.replicas] if isinstance(sched, Router) else [sched]:
        s.capabilities()
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    first: dict[str, float] = {}  # when each request's first token arrived
    failed: list[str] = []
    left, done = [len(reqs)], threading.Event()
    lock = threading.Lock()

    def sink_for(rid: str) -> Callable[[object], None]:
        def sink(ev: object) -> None:
            with lock:
                tokens[rid] += getattr(ev, "token_ids", [])
                if tokens[rid] and rid not in first:
                    first[rid] = time.perf_counter()
                if isinstance(ev, Finish) or not hasattr(ev, "token_ids"):
                    if not isinstance(ev, Finish):
                        failed.append(rid)
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        return sink

    t0 = time.perf_counter()
    for r in reqs:
        sched.submit(r, sink_for(r.request_id))
    submitted = time.perf_counter()
    done.wait()
    end = time.perf_counter()
    seconds = end - t0
    snap = sched.snapshot()
    sched.stop()
    spec, counters = snap["spec"], snap["counters"]
    made = sum(map(len, tokens.values()))
    # After every request has its first token: the decode phase, prefill behind it.
    decode = end - max(first.values(), default=t0)
    return {
        "tokens": tokens,
        "tok_s": made / seconds,
        "decode_tok_s": (made - len(first)) / decode if decode > 0 else 0.0,
        "step_ms": seconds / max(counters.steps, 1) * 1e3,
        "accepted_length": spec.mean_accepted_length,
        "acceptance": spec.acceptance_at,
        "spec": spec,
        "seconds": seconds,  # the run's wall time, first submit to last token
        "submit_s": submitted - t0,  # placing every request (a router's rule runs here)
        "plans": counters.plans,  # pipelined steps read back
        "engine_waited_s": counters.engine_waited_s,  # the service idle between them
        "by_replica": {r["replica"]: r["counters"].requests for r in snap.get("replicas", ())},
        "failed": failed,  # the requests that ended with a failure
        "ttft_median_s": statistics.median(f - t0 for f in first.values()) if first else 0.0,
        "preemptions": counters.preemptions,
    }


def median(runs: list[dict]) -> dict:
    """The first of `runs` with its timings replaced by the median over all of them."""
    out = dict(runs[0])
    for key in ("tok_s", "decode_tok_s", "step_ms"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def identical_to_none(results: dict[str, dict], n: int) -> dict[str, bool]:
    """Per label of `results` (`serve` results, requests named `label-i`), whether its `n`
    requests made the tokens the `none` label's did."""
    tokens = lambda label: [results[label]["tokens"][f"{label}-{i}"] for i in range(n)]  # noqa: E731
    return {label: tokens(label) == tokens(NONE) for label in results}


FIXED_DRAFTS = {"fixed_width": True, "dcut": False}  # num_drafts at every verify


def serve_texts(
    connect: Callable[[], ServingModel],
    model_dir: Path,
    prompts: list[str],
    method: str,
    tokens: int,
    options: dict | None = None,
) -> dict:
    """Greedy continuations of `prompts`, all at once: texts in order, and the spec stats."""
    from control_plane.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    reqs = [
        GenRequest(f"{method}-{i}", tuple(tok.encode(p)), tokens, method=method)
        for i, p in enumerate(prompts)
    ]
    r = serve(connect, reqs, tok, options)
    r["texts"] = [tok.decode(r["tokens"][q.request_id]) for q in reqs]
    return r


class Workload:
    """The checkpoint's tokenizer and prompts: its held-out prompts when it ships them
    (`held_out_prompts.json`, written by `met train`), else a few generic ones."""

    def __init__(self, model_dir: Path) -> None:
        from control_plane.text.tokenizer import load_tokenizer

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


class Windows:
    """Consecutive windows of the workload's prompts, cycled: tokens like those served, and
    no two windows alike while the prompts last."""

    def __init__(self, work: Workload) -> None:
        self.pool = [t for p in work.prompts for t in p]
        self.at = 0

    def take(self, n: int) -> tuple[int, ...]:
        out = tuple(self.pool[(self.at + i) % len(self.pool)] for i in range(n))
        self.at += n
        return out


@contextlib.contextmanager
def busy(n: int) -> Iterator[list[subprocess.Popen]]:
    """`n` processes spinning a core each (a pure Python loop) for the block's time."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield spinners
    finally:
        for p in spinners:
            p.kill()
            p.wait()
