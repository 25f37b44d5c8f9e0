"""The prefix cache: its policy on chosen prompts (what hits, where snapshots are taken, what
is evicted), and on a real engine through the scheduler: output with the cache on equals
output with it off, token for token, for `none`, `mtp` and `prompt_lookup`, over a shared
system prompt and the turns of chats, with hits; and nothing leaks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.prefill import chunk_length
from control_plane.scheduler.prefix_cache import PrefixCache
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import ActiveSeq, Event, Finish, GenRequest, ModelFacts
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.params import MTP, NONE, PROMPT_LOOKUP
from tests.collect import Outcome, run_all, serving

TOK = ByteTokenizer.default()
B = 4  # the policy tests' block


def _p(*parts: tuple[int, int]) -> list[int]:
    """A prompt of runs (token, count)."""
    return [t for t, n in parts for _ in range(n)]


def test_a_prompt_hits_its_deepest_snapshot_leaving_a_token_to_prefill() -> None:
    cache = PrefixCache(budget=4, block=B)
    first = _p((1, 8), (2, 3))  # boundaries 4, 8
    assert cache.lookup(first) is None
    assert cache.points(first, 0) == [8]  # its last whole block; no prompt seen to share
    assert cache.seen(first) == []
    assert cache.taken(first, 8, snapshot=11) == []
    hit = cache.lookup(_p((1, 8), (3, 5)))
    assert hit is not None and (hit.snapshot, hit.tokens) == (11, 8)
    # The whole prompt is the prefix: the hit backs off to leave its last token.
    assert cache.lookup(_p((1, 8))) is None
    assert cache.lookup(_p((1, 7), (9, 4))) is None, "shares 7 tokens: no whole block of it"
    assert cache.queries == 11 + 13 + 8 + 11 and cache.hits == 8


def test_snapshots_go_where_prompts_diverge() -> None:
    cache = PrefixCache(budget=4, block=B)
    system = _p((5, 12))
    a, b = system + _p((1, 6)), system + _p((2, 6))
    cache.seen(a)
    # b shares a's first 12 tokens: where a third prompt sharing the system prompt resumes.
    assert cache.points(b, 0) == [12, 16]
    assert cache.points(b, 12) == [16]


def test_eviction_is_least_recently_used_and_a_taken_twice_snapshot_is_dropped() -> None:
    cache = PrefixCache(budget=2, block=B)
    prompts = [_p((t, 9)) for t in (1, 2, 3)]
    assert cache.taken(prompts[0], 8, 10) == []
    assert cache.taken(prompts[1], 8, 20) == []
    assert cache.lookup(prompts[0]) is not None  # 10 is used: 20 is the least recently
    assert cache.taken(prompts[2], 8, 30) == [20]
    assert cache.num_snapshots == 2
    assert cache.taken(prompts[2], 8, 31) == [31], "its node holds one already"
    cache.forget(30)
    assert cache.lookup(prompts[2]) is None
    assert sorted(cache.clear()) == [10]


def test_chunks_end_on_block_boundaries_and_snapshot_points() -> None:
    a = ActiveSeq(GenRequest("r", tuple(range(200)), 1), lambda ev: None, TOK, ModelFacts(1024))
    assert chunk_length(a, 512, 100, 64) == 64, "a budget of 100 ends on the block at 64"
    assert chunk_length(a, 512, 1000, 64) == 200, "the prompt's end needs no boundary"
    a.snap_points = [128]
    assert chunk_length(a, 512, 1000, 64) == 128
    assert chunk_length(a, 512, 50, 64) == 0, "no whole block fits the budget"


# -- on a real engine ----------------------------------------------------------------------

SYSTEM = tuple(random.Random(5).randrange(256) for _ in range(150))


def _wave(method: str, seeds: range) -> list[GenRequest]:
    rng = random.Random(7)
    out = []
    for i in seeds:
        rng.seed(i)
        user = tuple(rng.randrange(256) for _ in range(rng.choice([20, 33, 70])))
        out.append(GenRequest(f"{method}{i}", SYSTEM + user, rng.randint(8, 16), method=method))
    return out


def _serve(engine: Engine, cache: bool) -> tuple[dict[str, list[int]], tuple[int, int]]:
    """Every request's tokens by id, and the cache's (queries, hits) in tokens."""
    s = Scheduler(lambda: engine, TOK, SchedulerOptions(prefix_cache=cache), Env())
    s.start()
    out: dict[str, list[int]] = {}
    try:
        for method in (NONE, MTP, PROMPT_LOOKUP):
            # A first wave, then the rest, which find its snapshots.
            for wave in (range(2), range(2, 6)):
                for r, o in zip(reqs := _wave(method, wave), run_all(s, reqs), strict=True):
                    out[r.request_id] = o.tokens
            # Chats of three turns: each turn the last one's prompt, its answer, and more.
            prompts = [SYSTEM[:70], SYSTEM[60:140]]
            for turn in range(3):
                reqs = [
                    GenRequest(f"chat-{method}-{c}-{turn}", tuple(p), 10, method=method)
                    for c, p in enumerate(prompts)
                ]
                outs = run_all(s, reqs)
                for r, o in zip(reqs, outs, strict=True):
                    out[r.request_id] = o.tokens
                prompts = [
                    [*p, *o.tokens, *SYSTEM[7 * turn : 7 * turn + 30]]
                    for p, o in zip(prompts, outs, strict=True)
                ]
        counts = (s.prefix.queries, s.prefix.hits) if s.prefix is not None else (0, 0)
    finally:
        s.stop()
    return out, counts


@pytest.mark.parametrize("budget", [6, 1], ids=["room", "evicting"])
def test_the_cache_changes_no_token_and_leaks_nothing(tiny_dir: Path, budget: int) -> None:
    """With room for six snapshots, and for one, which every new snapshot evicts (while
    sequences restored from it still hold its blocks)."""
    svc = ServiceConfig(verify_tiers="8:3,8:2", max_context=1024, prefix_snapshots=budget)
    off, (queries, _) = _serve(Engine(tiny_dir, svc), cache=False)
    assert queries == 0, "no cache, no lookups"
    engine = Engine(tiny_dir, svc)
    on, (queries, hits) = _serve(engine, cache=True)
    assert on == off
    print(f"prefix cache: {hits} of {queries} prompt tokens hit")
    assert hits >= (0.25 if budget > 1 else 0.05) * queries
    # Every request's sequence is freed, and the stopped scheduler dropped its snapshots.
    assert engine.slots.blocks.num_used == 0 and engine.prefixes.num_held == 0


def test_a_snapshot_where_prompts_diverge_is_evicted_last() -> None:
    cache = PrefixCache(budget=2, block=B)
    system = _p((5, 8))
    cache.seen(system + _p((1, 5)))
    assert cache.points(system + _p((2, 5)), 0) == [8, 12]  # 8: where the two diverge
    assert cache.taken(system + _p((2, 5)), 8, 10) == []
    assert cache.taken(_p((7, 9)), 8, 20) == []
    assert cache.lookup(_p((7, 9), (1, 1))) is not None  # 20 used last, 10 least recently
    assert cache.taken(_p((8, 9)), 8, 30) == [20], "the fork's snapshot stays"


def test_a_finished_answer_is_where_the_next_turn_resumes(tiny_dir: Path) -> None:
    """A 70-token prompt and its 70-token answer: snapshotted at 128 once the request ends and
    the loop is idle (the prompt's own snapshot is at 64), so the next turn, which starts with
    both, sent once the scheduler settled, resumes there, with the same tokens as without the
    cache."""
    svc = ServiceConfig(verify_tiers="8:3,8:2", max_context=1024, prefix_snapshots=4)
    outs = []
    for cache in (True, False):
        engine = Engine(tiny_dir, svc)
        s = Scheduler(
            lambda engine=engine: engine, TOK, SchedulerOptions(prefix_cache=cache), Env()
        )
        s.start()
        try:
            first = tuple(SYSTEM[:70])
            (answer,) = run_all(s, [GenRequest("t0", first, 70, ignore_eos=True, method=MTP)])
            assert s.settle(60), "the answer's snapshot is taken once the loop is idle"
            nxt = (*first, *answer.tokens, *SYSTEM[:20])
            hits = s.prefix.hits if s.prefix is not None else 0
            (second,) = run_all(s, [GenRequest("t1", nxt, 8, method=MTP)])
            if s.prefix is not None:
                assert s.prefix.hits - hits == 128
            outs.append((answer.tokens, second.tokens))
        finally:
            s.stop()
        assert engine.slots.blocks.num_used == 0 and engine.prefixes.num_held == 0
    assert outs[0] == outs[1]


def test_room_is_made_before_a_snapshot_is_taken() -> None:
    """The service holds no more snapshots than the budget: a full cache drops, before the
    call, as many as are to be taken, least recently used first, forks last."""
    cache = PrefixCache(budget=2, block=B)
    fork, other = _p((5, 8)), _p((6, 8))
    cache.seen(fork + _p((1, 5)))
    assert cache.points(fork + _p((2, 5)), 0) == [8, 12]  # 8: where the two diverge
    assert cache.taken(fork, 8, 10) == [] and cache.taken(other, 8, 20) == []
    assert cache.evict_for(0) == []
    assert cache.evict_for(1) == [20], "the fork's snapshot stays"
    assert cache.evict_for(5) == [10], "at most the budget is made room for"
    assert cache.num_snapshots == 0


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(random.Random(seed).randrange(256) for _ in range(n))


def _held(s: Scheduler) -> int:
    """The snapshots the scheduler's engine holds."""
    model = s.model
    assert isinstance(model, Engine)
    return model.prefixes.num_held


def test_a_full_cache_goes_on_taking_the_newest_prefixes(tiny_dir: Path) -> None:
    """Room for two snapshots and three prompts served one after the other: the third is
    snapshotted (the first, least recently used, dropped to make room), so a prompt sharing
    its first 128 tokens hits them, and one sharing the first prompt's misses."""
    svc = ServiceConfig(verify_tiers="8:3", max_context=512, prefix_snapshots=2)
    with serving(tiny_dir, svc) as s:
        prompts = [_prompt(seed, 140) for seed in (1, 2, 3)]
        for i, p in enumerate(prompts):
            run_all(s, [GenRequest(f"p{i}", p, 2, method=NONE)])
            assert s.settle(60)
        assert s.prefix is not None and s.prefix.num_snapshots == 2
        hits = s.prefix.hits
        run_all(s, [GenRequest("third", prompts[2][:128] + (1, 2, 3), 2, method=NONE)])
        assert s.prefix.hits - hits == 128
        run_all(s, [GenRequest("first", prompts[0][:128] + (1, 2, 3), 2, method=NONE)])
        assert s.prefix.hits - hits == 128, "the first prompt's snapshot went to make room"


def test_answers_wait_for_an_idle_loop(tiny_dir: Path) -> None:
    """A finished request's answer is snapshotted only once nothing else runs: while a longer
    request is still decoding, the short one's answer waits; once the loop settles, both are
    snapshotted at their last whole block."""
    waiting: list[int] = []
    svc = ServiceConfig(verify_tiers="8:3", max_context=512, prefix_snapshots=8)
    with serving(tiny_dir, svc) as s:

        class Seen(Outcome):
            def __call__(self, ev: Event) -> None:
                if isinstance(ev, Finish):  # on the loop's thread: nothing runs meanwhile
                    assert s.prefix is not None
                    waiting.append(len(s.prefix.answers))
                super().__call__(ev)

        short, long = Seen(), Seen()
        s.submit(GenRequest("short", _prompt(4, 70), 60, ignore_eos=True, method=NONE), short)
        s.submit(GenRequest("long", _prompt(5, 70), 150, ignore_eos=True, method=NONE), long)
        assert short.done.wait(120) and long.done.wait(120)
        assert waiting == [1, 2], "the short one's answer waited while the long one ran"
        assert s.settle(60) and s.prefix is not None and not s.prefix.answers
        for p, o in ((_prompt(4, 70), short), (_prompt(5, 70), long)):
            end = (70 + len(o.tokens)) // 64 * 64
            hit = s.prefix.deepest((*p, *o.tokens), end)
            assert hit is not None and hit.tokens == end


def test_requests_sent_together_prefill_their_shared_blocks_once(tiny_dir: Path) -> None:
    """Four requests at once whose prompts share 140 tokens, none cached: the first is
    snapshotted at 128 and the other three wait for it, then restore those 128 tokens each
    rather than prefill them beside it; the tokens are those of no cache."""
    shared = _prompt(6, 140)
    reqs = [GenRequest(f"r{i}", (*shared, *_prompt(10 + i, 9)), 6, method=MTP) for i in range(4)]
    svc = ServiceConfig(verify_tiers="8:3", max_context=512, prefix_snapshots=4)
    outs = []
    for cache in (True, False):
        with serving(tiny_dir, svc, cache) as s:
            outs.append([o.tokens for o in run_all(s, reqs)])
            assert (s.prefix.hits if s.prefix is not None else 0) == (3 * 128 if cache else 0)
    assert outs[0] == outs[1]


def test_snapshots_give_their_blocks_back_before_a_request_would_fail(tiny_dir: Path) -> None:
    """An eight-block pool and three 130-token prompts served with the cache on: their
    snapshots hold blocks. A 400-token prompt then needs seven: the snapshots go, least
    recently used first, and it runs as it does with the cache off, to the same tokens."""
    svc = ServiceConfig(verify_tiers="8:3", max_context=512, kv_blocks=8, prefix_snapshots=4)
    outs = []
    for cache in (True, False):
        with serving(tiny_dir, svc, cache) as s:
            for i in range(3):
                run_all(s, [GenRequest(f"p{i}", _prompt(i, 130), 2, method=NONE)])
                assert s.settle(60)
            assert (_held(s) > 0) == cache, "with the cache, the snapshots hold blocks"
            (big,) = run_all(s, [GenRequest("big", _prompt(9, 400), 8, method=MTP)])
            assert big.failure is None and len(big.tokens) == 8
            outs.append(big.tokens)
    assert outs[0] == outs[1]


def test_a_prompt_to_be_scored_is_prefilled_whole(tiny_dir: Path) -> None:
    """A prompt the cache holds is restored for a plain request, and prefilled whole for one
    that asks its prompt scored (a cached prefix has no rows to score); the tokens are alike."""
    prompt = tuple(_prompt(3, 150))
    svc = ServiceConfig(verify_tiers="8:3", max_context=512, prefix_snapshots=4)
    with serving(tiny_dir, svc) as s:
        (first,) = run_all(s, [GenRequest("first", prompt, 4)])
        hits = s.prefix.hits if s.prefix is not None else 0
        plain, scored = run_all(
            s,
            [
                GenRequest("plain", prompt, 4),
                GenRequest("scored", prompt, 4, prompt_logprobs=1),
            ],
        )
        restored = (s.prefix.hits if s.prefix is not None else 0) - hits
    assert plain.finish is not None and plain.finish.cached_tokens == 128 == restored
    assert scored.finish is not None and scored.finish.cached_tokens == 0
    assert scored.prompt is not None and len(scored.prompt.logprobs) == len(prompt) - 1
    assert first.tokens == plain.tokens == scored.tokens
