"""The prefix cache through a scheduler over a busy mix, in process and over gRPC: 32 requests
at once (a shared 512-token system prompt and each one's own tokens, `none`, `mtp` and
`prompt_lookup`, stop strings, four cancelled after their first tokens, and the first turns of
four chats), then the chats' later turns, three turns each. Every request's tokens with the
cache on equal those with it off (a cancelled one's: the shorter a prefix of the longer), and
at the end every block, slot and snapshot is free."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from control_plane.cli.launch import start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import Delta, Event, GenRequest
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.model import CircuitModel
from protos.params import MTP, NONE, PROMPT_LOOKUP
from tests.collect import Outcome
from tests.servers import capability_within

TOK = ByteTokenizer.default()
SYSTEM = tuple(random.Random(11).randrange(256) for _ in range(512))
METHODS = (NONE, MTP, PROMPT_LOOKUP)
TIERS, CONTEXT, SNAPSHOTS = "8:3,8:2", 1024, 8
CANCELLED = {3, 10, 17, 24}


class _Cancelling(Outcome):
    """An outcome that cancels its request once its first tokens arrive."""

    def __init__(self, cancel: Callable[[], None]) -> None:
        super().__init__()
        self.cancel = cancel

    def __call__(self, ev: Event) -> None:
        first = isinstance(ev, Delta) and not self.tokens
        super().__call__(ev)
        if first:
            self.cancel()


def _first_wave() -> list[GenRequest]:
    rng = random.Random(3)
    out = []
    for i in range(28):
        own = tuple(rng.randrange(256) for _ in range(rng.choice([9, 30, 64])))
        # Bytes the tiny model writes often: some of these requests end on them.
        stop = ("\x8b", "%") if i % 4 == 1 else ()
        out.append(GenRequest(f"r{i}", SYSTEM + own, 14, stop=stop, method=METHODS[i % 3]))
    return out


def _run(scheduler: Scheduler, reqs: list[GenRequest], first: int = 0) -> list[Outcome]:
    outs: list[Outcome] = []
    for i, r in enumerate(reqs):
        rid = r.request_id
        o = (
            _Cancelling(lambda rid=rid: scheduler.cancel(rid))
            if first + i in CANCELLED
            else Outcome()
        )
        outs.append(o)
        scheduler.submit(r, o)
    for o in outs:
        assert o.done.wait(120), "a request did not finish"
    return outs


def _serve(connect: Callable[[], CircuitModel], cache: bool) -> tuple[dict[str, Outcome], int]:
    """Every request's outcome by id, and the prompt tokens the cache gave."""
    s = Scheduler(connect, TOK, SchedulerOptions(prefix_cache=cache), Env())
    s.start()
    try:
        chats = [list(SYSTEM[: 100 + 50 * c]) for c in range(4)]
        reqs = _first_wave() + [
            GenRequest(f"chat{c}-0", tuple(p), 10, method=METHODS[c % 3])
            for c, p in enumerate(chats)
        ]
        outs = dict(zip([r.request_id for r in reqs], _run(s, reqs), strict=True))
        for turn in (1, 2):
            chats = [
                [*p, *outs[f"chat{c}-{turn - 1}"].tokens, *SYSTEM[40 * turn : 40 * turn + 20]]
                for c, p in enumerate(chats)
            ]
            reqs = [
                GenRequest(f"chat{c}-{turn}", tuple(p), 10, method=METHODS[c % 3])
                for c, p in enumerate(chats)
            ]
            outs |= dict(zip([r.request_id for r in reqs], _run(s, reqs, first=100), strict=True))
        hits = s.prefix.hits if s.prefix is not None else 0
        assert s.snapshot()["counters"].prefix_hits == hits, "GetStats' figure"
    finally:
        s.stop()
    return outs, hits


def _same(on: dict[str, Outcome], off: dict[str, Outcome]) -> None:
    assert on.keys() == off.keys()
    for rid, a in on.items():
        b = off[rid]
        assert a.finish is not None and b.finish is not None, rid
        if a.finish.reason == "cancelled" or b.finish.reason == "cancelled":
            short, long = sorted((a.tokens, b.tokens), key=len)
            assert long[: len(short)] == short, rid
        else:
            assert (a.tokens, a.finish.reason) == (b.tokens, b.finish.reason), rid
    reasons = [o.finish.reason for o in on.values() if o.finish is not None]
    assert "stop" in reasons and "cancelled" in reasons and "length" in reasons


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[str]:
    flags = ("--verify-tiers", TIERS, "--max-context", str(CONTEXT))
    proc, target = start_gpu_service(tiny_dir, *flags, "--prefix-snapshots", str(SNAPSHOTS))
    try:
        yield target
    finally:
        assert stop(proc) == 0


def test_in_process(tiny_dir: Path) -> None:
    svc = ServiceConfig(verify_tiers=TIERS, max_context=CONTEXT, prefix_snapshots=SNAPSHOTS)
    engine = Engine(tiny_dir, svc)
    off, _ = _serve(lambda: engine, cache=False)
    on, hits = _serve(lambda: engine, cache=True)
    _same(on, off)
    assert hits > 0
    assert engine.slots.blocks.num_used == 0 and engine.prefixes.num_held == 0
    assert engine.slots.num_free == svc.num_slots


def test_over_grpc(served: str) -> None:
    off, _ = _serve(lambda: GrpcModel(served), cache=False)
    on, hits = _serve(lambda: GrpcModel(served), cache=True)
    _same(on, off)
    assert hits > 0
    observer = GrpcModel(served)
    try:
        caps = observer.capabilities()
        capability_within(observer, "kv_blocks_free", caps.kv_blocks, 5.0)
        capability_within(observer, "free_slots", caps.num_slots, 5.0)
    finally:
        observer.close()
