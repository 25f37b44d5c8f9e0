"""The step compiled on the CPU (gpu_service/engine/compiled.py): when a service compiles, what
it compiles at start-up, tokens equal to the eager forward's, a step of few torch ops, and the
serial forwards replaying the compiled graphs (compiled against compiled-serial)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.profiler import profile

from control_plane.circuit.report import run_diff
from gpu_service.engine import compiled
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from met.main import build_parser
from protos.model import StepResult
from tests.conftest import TRAINED

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
# Up to two drafts a step: the start-up compiles the verify of 1 to 3 rows and the chain of 1
# and 2 drafts, at the one key length a 256-position context has.
SVC = ServiceConfig(verify_tiers="8:2", max_context=256)


def test_a_service_compiles_on_the_cpu_unless_told_or_unable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert compiled.decide(None, CPU, 1, {}) == (True, "")
    assert compiled.decide(None, CPU, 1, {compiled.NO_COMPILE_ENV: ""}) == (
        False,
        f"{compiled.NO_COMPILE_ENV} is set",
    )
    assert compiled.decide(True, CPU, 1, {compiled.NO_COMPILE_ENV: "1"}) == (True, "")
    assert compiled.decide(False, CPU, 1, {}) == (False, "--no-compile")
    assert compiled.decide(None, CUDA, 1, {})[0] is False, "a GPU has captured graphs"
    with pytest.raises(ValueError, match="--compile: the step is compiled on the CPU only"):
        compiled.decide(True, CUDA, 1, {})
    with pytest.raises(ValueError, match="not compiled under tensor parallelism"):
        compiled.decide(True, CPU, 2, {})
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    assert compiled.decide(None, CPU, 1, {})[1].startswith("no C++ compiler (g++, clang++, c++)")
    with pytest.raises(ValueError, match="--compile: no C\\+\\+ compiler"):
        compiled.decide(True, CPU, 1, {})


def test_a_graph_that_fails_runs_eagerly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay over the buffers it was compiled with; one that fails (here its buffer was
    resized in place, which the graph's checks refuse) runs `run` itself, then and at every
    later call: never an error."""
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path))
    buf = torch.zeros(4)

    def run() -> None:
        buf.add_(1)

    with torch.inference_mode():
        replay = compiled.compile_run(run)
        replay()
        assert buf.tolist() == [2.0] * 4, "compiled once and replayed"
        buf.resize_(8).zero_()
        replay()
        replay()
    assert buf.tolist() == [2.0] * 8


def test_the_flags() -> None:
    parser = build_parser()
    base = ["gpu-service", "serve"]
    assert parser.parse_args(base).compile is None
    assert parser.parse_args([*base, "--no-compile"]).compile is False
    got = parser.parse_args([*base, "--compile", "--compile-cache", "/c"])
    assert got.compile is True and str(got.compile_cache) == "/c"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Engine]:
    """The 4-layer trained fixture, whose drafts stand, eager and compiled."""
    cache = str(tmp_path_factory.mktemp("compile"))
    eager = Engine(TRAINED, SVC, "fp32")
    return eager, Engine(TRAINED, replace(SVC, compile=True, compile_cache=cache), "fp32")


def _greedy(engine: Engine, n: int, rounds: int) -> list[StepResult]:
    """Greedy steps of `n` sequences, each verifying its last token and one draft."""
    seqs = [engine.alloc_sequence() for _ in range(n)]
    prompts = [[(5 * i + 3 * j) % 200 + 1 for i in range(9 + j)] for j in range(n)]
    first = engine.prefill(seqs, prompts).argmax
    out = [engine.decode_step(first, [1] * n, seqs, [True] * n, 1)]
    for _ in range(rounds):
        last, rows = out[-1], []
        width = 1 if len(out) == 1 else 2
        for i in range(n):
            rows += [last.argmax[i * width + last.accepted[i]], *last.proposal.drafts[i]]
        out.append(engine.decode_step(rows, [2] * n, seqs, [True] * n, 1))
    for s in seqs:
        engine.free_sequence(s)
    return out


@pytest.mark.slow
def test_the_service_serves_at_once_the_same_tokens_before_and_after_its_compiles(
    engines: tuple[Engine, Engine],
) -> None:
    """Nothing is compiled before the first call: one request's keys are queued, the likeliest
    first, and calls run eagerly until theirs are built; greedy tokens are the eager
    forward's before the compiles finish and after, when no call runs eagerly."""
    eager, engine = engines
    graphs = engine.choice.graphs
    assert graphs is not None and graphs.later is not None
    assert engine.compiled_at_start == [] and engine.capabilities().compiles_pending > 0
    line = compiled.queued(graphs.pending, engine.svc.compile_cache)
    assert "serves now and compiles the step for the CPU in the background" in line
    want = {n: [(r.argmax, r.accepted) for r in _greedy(eager, n, 6)] for n in (1, 3)}
    for n in (1, 3):
        assert [(r.argmax, r.accepted) for r in _greedy(engine, n, 6)] == want[n]
    assert graphs.fallbacks > 0, "the calls ran eagerly while their keys compiled"
    graphs.later.settle()
    before = graphs.fallbacks
    for n in (1, 3):
        got = _greedy(engine, n, 6)
        assert [(r.argmax, r.accepted) for r in got] == want[n]
        assert any(sum(r.accepted) for r in got[1:]), "drafts stood"
    graphs.later.settle()
    assert graphs.fallbacks == before, "every call a replay once its keys were built"
    # One request's 5, and the verify of 1 and 2 rows in the bucket of 4 that 3 sequences
    # take, queued by their calls.
    keys = set(graphs.graphs)
    assert {
        *(("eager", "verify", 1, k, 256, False) for k in (1, 2, 3)),
        *(("eager", "chain", 4, d, 256) for d in (1, 2)),
    } <= keys
    assert graphs.captures == 7 and not graphs.failed
    assert engine.capabilities().compiled and engine.capabilities().graphs


def test_one_requests_keys_are_queued_in_the_order_its_steps_ask_them() -> None:
    later, order = compiled.Later(), []
    gate = threading.Event()
    later.submit(("first",), gate.wait)  # holds the thread while the rest are queued
    for key in ("a", "b", "c"):
        later.submit((key,), lambda key=key: order.append(key))
    later.submit(("b",), lambda: order.append("b twice"), first=True)
    later.submit(("asked",), lambda: order.append("asked"), first=True)
    gate.set()
    later.settle()
    assert order == ["asked", "b", "a", "c"], "a call's key first, then the queue in turn"
    assert not later.pending


@pytest.mark.slow
def test_a_new_bucket_compiles_in_the_background(engines: tuple[Engine, Engine]) -> None:
    """Six sequences take buckets of 8 no step has built: their steps replay the buckets of 4
    meanwhile (the same bytes: the same tokens as eager), never eagerly and never waiting, and
    the buckets of 8 are built once the background settles."""
    eager, engine = engines
    graphs = engine.choice.graphs
    assert graphs is not None and graphs.later is not None
    graphs.later.settle()
    before = graphs.fallbacks
    got, want = _greedy(engine, 6, 3), _greedy(eager, 6, 3)
    assert [(r.argmax, r.accepted) for r in got] == [(r.argmax, r.accepted) for r in want]
    assert graphs.fallbacks == before
    graphs.later.settle()
    assert engine.capabilities().compiles_pending == 0
    built = {k[1:4] for k in graphs.graphs}
    assert {("verify", 8, 1), ("verify", 8, 2), ("chain", 8, 1)} <= built
    assert not graphs.failed


@pytest.mark.slow
def test_a_compiled_step_is_few_torch_ops(engines: tuple[Engine, Engine]) -> None:
    """One more greedy step at one sequence (verify, fold, chain): its top-level torch ops."""
    _, engine = engines

    def top_level(rounds: int) -> list[str]:
        with profile() as prof:
            _greedy(engine, 1, rounds)
        return [e.name for e in prof.events() if e.cpu_parent is None]

    graphs = engine.choice.graphs
    assert graphs is not None
    before = graphs.replays
    once, twice = top_level(1), top_level(2)
    assert graphs.replays - before >= 5, "its verifies and chains replay compiled graphs"
    one_more = len(twice) - len(once)
    print(f"top-level torch ops of one compiled greedy step at one sequence: {one_more}")
    assert 0 < one_more <= 150


@pytest.mark.slow
def test_the_diff_compares_compiled_against_compiled_serial(
    engines: tuple[Engine, Engine],
) -> None:
    """Widths 2 and 5 (buckets 2 and 8) against each sequence alone in a bucket of 1, at the
    suite's thread count; the mixed widths replay a graph per row count. A bucket of 1 pads
    its 2 or 3 rows to 4, a bucket of 2 with 2 rows each pads none: the embedding's padding
    differs, which once changed the first norm's bytes."""
    _, engine = engines
    graphs = engine.choice.graphs
    assert graphs is not None and graphs.later is not None
    graphs.later.settle()
    graphs.later = None  # as `met circuit diff --compile`: each bucket's own graph
    before = graphs.fallbacks  # the calls that ran eagerly while their keys compiled
    args = build_parser().parse_args(
        ["circuit", "diff", "--verify-batch", "--mtp", "--widths", "2,5", "--ks", "2,3"]
        + ["--steps", "3", "--num-drafts", "2"]
    )
    report = run_diff(engine, args)
    assert report["graphs"] == "compiled"
    assert report["verdict"] == "PASS", report["reasons"]
    assert engine.choice.graphs is graphs and graphs.fallbacks == before
