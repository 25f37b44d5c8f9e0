"""`met bench`'s prefix-cache section on the tiny checkpoint at small sizes: its figures are
sane (hits with the cache, none without) and the cache changes no token; and a prompt that
shares only part of a block with a cached one hits its whole blocks alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.prefix_cache import PrefixCache
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.params import MTP
from tools.bench import prefix as bench
from tools.bench.prefix import Sizes, prefix, prefix_lines, prefix_table, serve
from tools.bench.workload import Workload

# Two whole blocks of system prompt, two measured requests sent together, two chats of two
# turns whose first prompt leaves a whole block to snapshot.
SMALL = Sizes(
    system=128,
    suffix=16,
    tokens=6,
    requests=2,
    concurrency=2,
    chats=2,
    turns=2,
    opening=70,
    user=16,
    burst=2,
    long_tokens=70,
    long_requests=2,
    long_concurrency=2,
)


def test_the_section_hits_with_the_cache_alone_and_changes_no_token(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arms: list[dict] = []
    compare = bench._compare
    # The arms' outputs, which the report leaves out.
    monkeypatch.setattr(bench, "_compare", lambda a: arms.append(a) or compare(a))
    section = prefix(tiny_dir, Workload(tiny_dir), SMALL)
    assert section["failures"] == []
    for name in bench.WORKLOADS:
        w = section[name]
        assert w["identical"], name
        assert w["off"]["hit_rate"] == 0, name
        # The long answers' prompts are distinct: nothing to hit, only answers to snapshot.
        assert (w["on"]["hit_rate"] > 0) == (name != "long"), name
        for arm in ("on", "off"):
            assert w[arm]["ttft_median_s"] > 0 and w[arm]["ttft_mean_s"] > 0
            assert w[arm]["tok_s"] > 0
        assert w["ttft_ratio"] == w["on"]["ttft_median_s"] / w["off"]["ttft_median_s"]
        assert w["tok_s_ratio"] == w["on"]["tok_s"] / w["off"]["tok_s"]
    system = section["system"]
    assert system["on"]["requests"] == SMALL.requests, "the seeds are left out"
    assert len(system["on"]["seed_ttft_s"]) == bench.SEEDS
    # Each measured request restores the whole system prompt; the seeds found nothing.
    assert system["on"]["measured_hit_rate"] == SMALL.system / (SMALL.system + SMALL.suffix)
    assert system["holds"] == (system["ttft_ratio"] <= bench.TARGET)
    assert len(section["chat"]["on"]["turn_ttft_median_s"]) == SMALL.turns
    outs = (SMALL.tokens, SMALL.tokens, SMALL.tokens, SMALL.long_tokens)
    for a, tokens in zip(arms, outs, strict=True):
        on, off = a["on"]["outputs"], a["off"]["outputs"]
        assert on == off and all(len(t) == tokens for t in on)
    assert len(arms[0]["on"]["outputs"]) == bench.SEEDS + SMALL.requests
    assert len(arms[1]["on"]["outputs"]) == SMALL.chats * SMALL.turns
    assert len(arms[2]["on"]["outputs"]) == SMALL.burst
    assert len(arms[3]["on"]["outputs"]) == SMALL.long_requests
    # The second of the burst waited for the first's snapshot of the system prompt.
    burst = section["burst"]["on"]["hit_rate"]
    assert burst == SMALL.system / (SMALL.burst * (SMALL.system + SMALL.suffix))
    text = "\n".join(prefix_lines(section))
    assert "TTFT on / off" in text and "the first 2 requests at once seed the cache" in text
    assert "| shared system prompt | on |" in "\n".join(prefix_table(section))
    assert "| long answers | off |" in "\n".join(prefix_table(section))
    assert "tok/s on / off" in text


def test_a_prompt_sharing_100_tokens_with_a_cached_one_hits_one_block(tiny_dir: Path) -> None:
    cache = PrefixCache(budget=4, block=64)
    cached = list(range(100))
    assert cache.points(cached, 0) == [64], "its last whole block"
    cache.taken(cached, 64, snapshot=1)
    hit = cache.lookup([*cached, *range(200, 230)])
    assert hit is not None and (hit.snapshot, hit.tokens) == (1, 64)
    # The same through a scheduler on an engine: the second prompt restores 64 tokens.
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", prefix_snapshots=2))
    tok = ByteTokenizer.default()
    sched = Scheduler(lambda: engine, tok, SchedulerOptions(), Env())
    sched.start()
    try:
        serve(sched, [GenRequest("cached", tuple(cached), 4, method=MTP)])
        assert sched.prefix is not None and sched.prefix.hits == 0
        serve(sched, [GenRequest("shares-100", (*cached, *range(200, 230)), 4, method=MTP)])
        assert sched.prefix.hits == 64 and sched.prefix.queries == 100 + 130
    finally:
        sched.stop()
