"""A KV pool smaller than the requests' contexts (control_plane/scheduler/pressure.py): the
rules on chosen requests, then whole runs over an in-process engine with a pool too small for
them, against the same runs with a pool of every slot's context."""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from control_plane.cli.launch import start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.pressure import Pool
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import ActiveSeq, GenRequest, ModelFacts
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.model.config import ServiceConfig
from protos.handles import SequenceHandle
from protos.params import MTP, NONE
from tests.collect import Outcome, run_all, serving
from tests.servers import capability_within

TOK = ByteTokenizer.default()
# Blocks of 64 positions; steps of at most 3 drafts, 4 steps an iteration; prefill chunks of
# 256 tokens, 512 a call.
POOL = Pool(blocks=8, block=64, width=3, steps=4, chunk=256, budget=512)


def _seq(
    prompt: int, generated: int = 0, prefilled: int | None = None, new: int = 200
) -> ActiveSeq:
    """A request with a `prompt`-token prompt, `generated` tokens out of `new` so far, and
    `prefilled` of its prompt in the cache (all of it once it generates)."""
    a = ActiveSeq(GenRequest("r", (5,) * prompt, new), lambda ev: None, TOK, ModelFacts(1024))
    a.generated = [7] * generated
    a.prefilled = prompt if prefilled is None else prefilled
    a.handle = SequenceHandle(0, 0, a.prefilled)
    return a


def test_each_request_goes_on_while_its_blocks_are_free_oldest_first() -> None:
    """At 121 tokens (120 in the cache) a decoding request's four steps may cross into its third
    block: one more; a prefilling one's next chunk of 256 tokens takes four. With six blocks
    free all but the newest go on; with one, only the oldest does."""
    old, mid = _seq(100, 21), _seq(100, 21)
    filling, later = _seq(300, prefilled=0), _seq(300, prefilled=0)
    assert POOL.decode_need(old) == 1
    plan = POOL.plan([filling, later], [old, mid], free=6)
    assert plan.need == 10 and plan.paused == {id(later)} and not plan.head_waits
    plan = POOL.plan([filling, later], [old, mid], free=1)
    assert plan.paused == {id(mid), id(filling), id(later)} and not plan.head_waits
    assert POOL.plan([filling], [old], free=0).head_waits, "the oldest cannot go on"


def test_the_oldest_prefilling_request_waits_when_its_chunk_does_not_fit() -> None:
    head, other = _seq(300, prefilled=0), _seq(40, prefilled=0)
    plan = POOL.plan([head, other], [], free=2)
    assert plan.head_waits and plan.paused == {id(head)}, "the other's one block still fits"


def test_the_newest_request_holding_blocks_is_preempted_never_the_oldest() -> None:
    old, mid = _seq(100, 21), _seq(100, 21)
    nothing_yet = _seq(300, prefilled=0)
    assert POOL.victim([nothing_yet], [old, mid]) is mid, "the newest holds no block"
    part = _seq(300, prefilled=128)
    assert POOL.victim([nothing_yet, part], [old, mid]) is part
    assert POOL.victim([], [old]) is None, "the oldest alone is never preempted"


def test_the_oldest_alone_goes_on_while_its_next_token_fits() -> None:
    """With no other left to preempt, the oldest goes on while its next position is backed:
    at 120 tokens (119 in the cache) the next is in its second block; at 129, it starts the
    third."""
    assert POOL.alone([_seq(100, 20)], free=0)
    assert not POOL.alone([_seq(100, 29)], free=0)
    assert POOL.alone([_seq(100, 29)], free=1)
    assert not POOL.alone([], free=8)


def test_an_upper_bound_that_fits_needs_no_call() -> None:
    """A decoding request at 170 tokens may reach 170 + 4 x 4 + 3 = 189 positions (three
    blocks) in this iteration's steps, and with a snapshot of 320 tokens (five blocks) the pool
    of eight surely holds both. With a step in flight before them it may reach 193: a fourth
    block, one too many; so is a 256-token prefill chunk (four) beside a snapshot of two."""
    a = _seq(100, 70)
    assert POOL.reach(a, POOL.steps) == 189
    assert POOL.surely_fits([], [a], in_flight=0, snapshots=[320])
    assert not POOL.surely_fits([], [a], in_flight=1, snapshots=[320])
    assert (POOL.decode_need(a), POOL.decode_need(a, in_flight=1)) == (0, 1)
    assert not POOL.surely_fits([_seq(300, prefilled=0)], [a], in_flight=0, snapshots=[128])


def test_a_request_reaches_no_further_than_its_last_token() -> None:
    """With 3 tokens of 10 left, its steps end at the prompt and the ten, and the drafter's
    entries past them: 100 + 10 + 3."""
    near_end = _seq(100, 7, new=10)
    assert POOL.reach(near_end, POOL.steps) == 113


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 250) for _ in range(n))


def _serving(tiny_dir: Path, kv_blocks: int, cache: bool) -> AbstractContextManager[Scheduler]:
    """`serving` with a pool of `kv_blocks` blocks (0: every slot's context)."""
    svc = ServiceConfig(
        verify_tiers="8:3", max_context=512, kv_blocks=kv_blocks, prefix_snapshots=4
    )
    return serving(tiny_dir, svc, cache)


def _four(method: str) -> list[GenRequest]:
    """Four 100-token prompts, 120 tokens each: four blocks apiece, sixteen in all."""
    return [
        GenRequest(f"r{i}", _prompt(i, 100), 120, ignore_eos=True, method=method) for i in range(4)
    ]


def _all_finish(s: Scheduler, reqs: list[GenRequest]) -> list[list[int]]:
    """Each request's tokens, every one of them finished with all its tokens."""
    outs = run_all(s, reqs)
    assert [o.failure for o in outs] == [None] * len(reqs)
    assert all(len(o.tokens) == r.max_new_tokens for o, r in zip(outs, reqs, strict=True))
    return [o.tokens for o in outs]


@pytest.fixture(scope="module")
def unlimited(tiny_dir: Path) -> Callable[[str], list[list[int]]]:
    """`_four`'s tokens with a pool of every slot's context, by method (run once each)."""
    runs: dict[str, list[list[int]]] = {}

    def tokens(method: str) -> list[list[int]]:
        if method not in runs:
            with _serving(tiny_dir, 0, False) as s:
                runs[method] = _all_finish(s, _four(method))
                assert s.snapshot()["counters"].preemptions == 0
        return runs[method]

    return tokens


@pytest.mark.parametrize(("method", "cache"), [(MTP, False), (NONE, True)])
def test_four_requests_finish_in_half_the_blocks_they_need(
    tiny_dir: Path, unlimited: Callable[[str], list[list[int]]], method: str, cache: bool
) -> None:
    """`_four` in a pool of eight blocks: requests sit out and the newest are preempted, and
    every one finishes, to the tokens of a pool of every slot's context (with the prefix cache
    on, its snapshots go first)."""
    with _serving(tiny_dir, 8, cache) as s:
        assert _all_finish(s, _four(method)) == unlimited(method)
        assert s.snapshot()["counters"].preemptions > 0, "GetStats' figure"


def test_over_grpc(tiny_dir: Path, unlimited: Callable[[str], list[list[int]]]) -> None:
    """The same over a GPU service of its own with `--kv-blocks 8`: the same tokens, and once
    the scheduler stops, every block free again."""
    flags = ("--verify-tiers", "8:3", "--max-context", "512", "--kv-blocks", "8")
    proc, target = start_gpu_service(tiny_dir, *flags)
    try:
        s = Scheduler(lambda: GrpcModel(target), TOK, SchedulerOptions(), Env())
        s.start()
        try:
            assert _all_finish(s, _four(MTP)) == unlimited(MTP)
            assert s.snapshot()["counters"].preemptions > 0
        finally:
            s.stop()
        observer = GrpcModel(target)
        try:
            capability_within(observer, "kv_blocks_free", 8, 5.0)
        finally:
            observer.close()
    finally:
        assert stop(proc) == 0


def test_a_request_the_pool_cannot_hold_fails_alone(tiny_dir: Path) -> None:
    """A pool of three blocks (192 positions): a 100-token prompt asking for 100 more cannot
    fit however the others make way. It fails with RESOURCE_EXHAUSTED; the short request
    admitted after it (preempted to make room for it, first) finishes with the tokens it has
    alone."""
    big = GenRequest("big", _prompt(1, 100), 100, ignore_eos=True, method=MTP)
    small = GenRequest("small", _prompt(2, 20), 30, ignore_eos=True, method=MTP)
    with _serving(tiny_dir, 0, False) as s:
        (alone,) = run_all(s, [small])
    with _serving(tiny_dir, 3, False) as s:
        out_big, out_small = Outcome(), Outcome()
        s.submit(big, out_big)
        s.submit(small, out_small)
        assert out_big.done.wait(120) and out_small.done.wait(120)
        assert s.tally.copy()[0].preemptions > 0
    assert out_big.failure is not None and out_big.failure.code == "RESOURCE_EXHAUSTED"
    assert "--kv-blocks" in out_big.failure.message
    assert out_small.failure is None and out_small.tokens == alone.tokens
