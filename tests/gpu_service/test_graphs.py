"""Captured graphs (gpu_service/engine/graphs.py) as far as the CPU runs them: buckets and key
lengths, the padding on the pad slot, persistent buffers reused replay after replay, the eager
fallback, the switches, and bytes equal to the eager forward's. `replay_eagerly` stands in for
the capture, which only a CUDA device has."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from control_plane.scheduler.seq import GenRequest
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine import graphs
from gpu_service.engine.facade import Engine
from gpu_service.engine.graphs import NO_GRAPHS_ENV, bucket_for, buckets, key_bucket, replay_eagerly
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.rpc.options import add_serve_args
from gpu_service.sizing.plan import service_config
from protos.model import Sampling, StepResult
from protos.params import MTP
from tests.collect import run_all

SVC = ServiceConfig(verify_tiers="8:3,4:2", max_context=256)


def engines(tiny_dir: Path) -> tuple[Engine, Engine]:
    eager, graphed = Engine(tiny_dir, SVC), Engine(tiny_dir, SVC)
    graphed.use_graphs(replay_eagerly)
    return eager, graphed


def test_buckets_and_key_lengths() -> None:
    assert buckets(32) == (4, 8, 16, 32) and buckets(33) == (4, 8, 16, 32, 64)
    assert buckets(1) == (4,)
    assert [bucket_for(n, (4, 8, 16)) for n in (1, 4, 5, 16, 17)] == [4, 4, 8, 16, None]
    assert [key_bucket(n, 1024) for n in (1, 64, 65, 129, 300, 600)] == [
        64,
        64,
        128,
        256,
        512,
        1024,
    ]
    assert key_bucket(900, 256) == 256, "never past the context"


def test_graphs_only_on_cuda_and_only_when_asked() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert graphs.wanted(True, cuda, {})
    assert not graphs.wanted(False, cuda, {}), "--no-cuda-graphs"
    assert not graphs.wanted(True, cuda, {NO_GRAPHS_ENV: ""}), "the seed's switch, even empty"
    assert not graphs.wanted(True, cpu, {}), "the CPU has no capture"
    parser = __import__("argparse").ArgumentParser()
    add_serve_args(parser)
    cfg = ModelConfig()
    assert service_config(parser.parse_args([]), cfg).cuda_graphs
    assert not service_config(parser.parse_args(["--no-cuda-graphs"]), cfg).cuda_graphs


def _steps(engine: Engine, n: int, k: int, rounds: int) -> list[StepResult]:
    """Greedy steps of `n` sequences, each verifying its last token and k - 1 drafts."""
    seqs = [engine.alloc_sequence() for _ in range(n)]
    first = engine.prefill(
        seqs, [[(5 * i + 3 * j) % 200 + 1 for i in range(9 + j)] for j in range(n)]
    ).argmax
    out = [engine.decode_step(first, [1] * n, seqs, [True] * n, k - 1)]
    for _ in range(rounds):
        last = out[-1]
        rows, off = [], 0
        for i in range(n):
            stood = last.accepted[i]
            bonus = last.argmax[off + stood]
            off += 1 if len(out) == 1 else k
            rows += [bonus, *last.proposal.drafts[i]]
        out.append(engine.decode_step(rows, [k] * n, seqs, [True] * n, k - 1))
    for s in seqs:
        engine.free_sequence(s)
    return out


def test_replays_give_the_eager_bytes(tiny_dir: Path) -> None:
    """Five sequences run in the bucket of eight, three of it padding; drafts, confidences,
    argmaxes and the last logits equal the eager engine's."""
    eager, graphed = engines(tiny_dir)
    a, b = _steps(eager, 5, 3, 4), _steps(graphed, 5, 3, 4)
    assert a == b
    assert torch.equal(eager.state.logits, graphed.state.logits)
    g = graphed.choice.graphs
    assert g is not None
    assert {key[:4] for key in g.graphs} == {
        ("eager", "verify", 8, 1),
        ("eager", "verify", 8, 3),
        ("eager", "chain", 8, 2),
    }
    assert g.fallbacks == 0


def test_buffers_are_reused_and_padding_stays_on_the_pad_slot(tiny_dir: Path) -> None:
    _, engine = engines(tiny_dir)
    g = engine.choice.graphs
    assert g is not None
    _steps(engine, 2, 3, 3)
    inputs = {key: [t.data_ptr() for t in graph.inputs] for key, graph in g.graphs.items()}
    captured, replayed = g.captures, g.replays
    _steps(engine, 3, 3, 3)  # the same buckets: nothing captured again
    assert g.captures == captured and g.replays > replayed
    assert {key: [t.data_ptr() for t in graph.inputs] for key, graph in g.graphs.items()} == inputs
    state, free = engine.state, list(range(3, engine.svc.num_slots))  # never allocated
    for name in ("gdn", "conv"):
        t = getattr(state, name)
        assert not t[:, free].any(), f"{name}: padding wrote a slot it does not own"
    # Three sequences of under a block each took blocks 0 to 2 (the lowest first), and the
    # padding wrote the pad block, the last: every block between was never written.
    never = slice(3, state.pad_block)
    for name in ("k_cache", "v_cache"):
        assert not getattr(state, name)[:, never].any(), f"{name}: padding wrote a free block"
    assert not state.mtp_k[never].any() and not state.mtp_valid[never].any()
    assert engine.slots.blocks.num_used == 0, "every sequence was freed"
    assert bool((state.block_table == state.pad_block).all())
    assert (
        state.pad_slot == engine.svc.num_slots and state.block_table.shape[0] == state.pad_slot + 1
    )


def test_calls_no_graph_fits_run_eagerly(tiny_dir: Path) -> None:
    eager, graphed = engines(tiny_dir)
    g = graphed.choice.graphs
    assert g is not None
    results = []
    for engine in (eager, graphed):
        seqs = [engine.alloc_sequence() for _ in range(2)]
        engine.prefill(seqs, [[5, 6, 7], [8, 9]])
        # Rows that differ between sequences: no graph has that shape.
        results.append(engine.decode_verify_batched([1, 2, 3, 4, 5], [2, 3], seqs).argmax)
        # A sampled chain draws on the host: eager.
        sampled = [Sampling(0.8, 0, 1.0, (0.3, 0.6)), None]
        results.append(engine.settle_verdict(seqs, [1, 1], [2, 3], [0, 1], [1, 2], 2, sampled))
    assert results[:2] == results[2:]
    assert g.fallbacks == 1 and g.replays == 0


def test_scheduler_outputs_match_and_capabilities_say_so(tiny_dir: Path) -> None:
    from control_plane.scheduler.env import Env
    from control_plane.scheduler.options import SchedulerOptions
    from control_plane.scheduler.scheduler import Scheduler

    eager, graphed = engines(tiny_dir)
    reqs = [GenRequest(f"r{i}", (i + 3, 4, 5, 6), 12, method=MTP) for i in range(6)]
    outs = []
    for engine in (eager, graphed):
        s = Scheduler(lambda e=engine: e, ByteTokenizer.default(), SchedulerOptions(), Env())
        s.start()
        try:
            outs.append([o.tokens for o in run_all(s, reqs)])
        finally:
            s.stop()
    assert outs[0] == outs[1]
    assert (eager.capabilities().graphs, graphed.capabilities().graphs) == (False, True)
    graphed.use_graphs(None)
    assert not graphed.capabilities().graphs


@pytest.mark.parametrize("n", [1, 4])
def test_a_bucket_of_one_sequence_pads_to_four(tiny_dir: Path, n: int) -> None:
    eager, graphed = engines(tiny_dir)
    assert _steps(eager, n, 2, 2) == _steps(graphed, n, 2, 2)
    g = graphed.choice.graphs
    assert g is not None and {key[2] for key in g.graphs} == {4}


def test_a_capture_that_fails_falls_back_for_good(tiny_dir: Path) -> None:
    eager, graphed = engines(tiny_dir)
    tries = []

    def refuses(run: graphs.Run) -> graphs.Run:
        tries.append(run)
        raise RuntimeError("operation not permitted when stream is capturing")

    graphed.use_graphs(refuses)
    assert _steps(eager, 3, 3, 2) == _steps(graphed, 3, 3, 2)
    g = graphed.choice.graphs
    assert g is not None and g.captures == 0 and g.replays == 0
    assert len(tries) == len(g.failed) == 3, "one try per key: verify k=1, k=3, the chain"
    assert all("stream is capturing" in why for why in g.failed.values())
    assert g.fallbacks > len(tries), "later calls of a failed key go eager without a try"


def test_a_compiled_key_builds_in_the_background_while_a_smaller_bucket_stands_in(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled path's scheduling, `replay_eagerly` standing in for the compiler: a call
    whose key is not built runs eagerly and queues it, never building it on its path; once one
    sequence's keys are built, five sequences replay them in parts (never eagerly) while their
    own buckets build in the background; once a build has failed, its calls run the eager
    forward. Every step's bytes equal the eager engine's."""
    eager, graphed = engines(tiny_dir)
    graphed.use_graphs(replay_eagerly, compiled=True)
    g = graphed.choice.graphs
    assert g is not None and g.later is not None
    gate = threading.Event()
    g.later.submit(("held",), gate.wait)  # the background busy: nothing is built meanwhile
    assert _steps(eager, 1, 3, 2) == _steps(graphed, 1, 3, 2)
    assert not g.graphs and g.fallbacks > 0, "the calls ran eagerly, their keys queued"
    gate.set()
    g.later.settle()
    assert {k[1:3] for k in g.graphs} == {("verify", 1), ("chain", 4)}
    before = g.fallbacks
    assert _steps(eager, 5, 3, 3) == _steps(graphed, 5, 3, 3)
    assert g.fallbacks == before
    g.later.settle()
    assert {("verify", 8), ("chain", 8)} <= {k[1:3] for k in g.graphs}
    assert graphed.capabilities().compiles_pending == 0

    built = dict(g.graphs)
    capture = g._capture_verify

    def refuses_two(key: tuple, b: int, *rest) -> graphs._Graph:
        if b == 2:
            raise RuntimeError("no graph of two")
        return capture(key, b, *rest)

    monkeypatch.setattr(g, "_capture_verify", refuses_two)
    assert _steps(eager, 2, 3, 2) == _steps(graphed, 2, 3, 2)
    g.later.settle()
    assert all(k[2] == 2 for k in g.failed) and g.failed, "the bucket of 2 failed"
    before = g.fallbacks
    assert _steps(eager, 2, 3, 1) == _steps(graphed, 2, 3, 1)
    assert g.fallbacks > before, "its calls run eagerly once it has failed"
    assert built.items() <= g.graphs.items()


def test_the_start_up_queues_its_keys_at_every_longer_key_length(tiny_dir: Path) -> None:
    """Nothing built now: queued to the background at every key length (fourfold from 256 to
    the context), the first's first, so a growing context finds them built."""
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:2", max_context=2048))
    engine.use_graphs(replay_eagerly, compiled=True)
    g = engine.choice.graphs
    assert g is not None and g.later is not None
    gate, holding = threading.Event(), threading.Event()

    def held() -> None:
        holding.set()
        gate.wait()

    g.later.submit(("held",), held)
    assert holding.wait(30), "the worker took the held job off the queue"
    with torch.inference_mode():
        assert g.warm(2, True) == []
    queued = [key for key, _ in g.later._jobs]
    assert [k[4] for k in queued] == [256] * 5 + [1024] * 5 + [2048] * 5
    assert [k[1:4] for k in queued[:3]] == [("verify", 1, 3), ("chain", 4, 2), ("verify", 1, 1)]
    gate.set()
    g.later.settle()
    at = {length: {k[1:4] for k in g.graphs if k[4] == length} for length in (256, 1024, 2048)}
    assert (
        at[256]
        == at[1024]
        == at[2048]
        == {
            *(("verify", 1, k) for k in (1, 2, 3)),
            *(("chain", 4, d) for d in (1, 2)),
        }
    )
    assert not g.failed
