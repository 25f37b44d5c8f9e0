"""The scheduler loop in process: lossless speculation, stopping rules, queueing,
cancellation, chunked prefill, and recovery from a failed service."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest

from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.model import ResourceExhausted
from protos.params import MTP, NONE
from tests.collect import Outcome, run_all
from tests.fake_model import FakeModel, counting_oracle, perfect_drafter

TOK = ByteTokenizer.default()
NO_ENV = Env()  # no METRALE_* switch set


def mixed_requests(method: str, n: int = 32, seed: int = 0) -> list[GenRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = tuple(rng.randrange(256) for _ in range(rng.choice([1, 3, 17, 40, 70])))
        out.append(GenRequest(f"r{i}", prompt, rng.randint(4, 28), method=method))
    return out


def scheduler(model, **opts) -> Scheduler:
    s = Scheduler(lambda: model, TOK, SchedulerOptions(**opts), NO_ENV)
    s.start()
    return s


def test_mtp_is_lossless_against_plain_greedy(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3,8:2", max_context=256))
    s = scheduler(engine)
    try:
        mtp = run_all(s, mixed_requests(MTP))
        widths = s.snapshot()["counters"].step_widths
        plain = run_all(s, mixed_requests(NONE))
    finally:
        s.stop()
    assert min(widths) == 1 and max(widths) == 16, widths
    assert sum(o.finish.stats.drafted for o in mtp) > 0
    for i, (a, b) in enumerate(zip(mtp, plain, strict=True)):
        assert a.tokens == b.tokens, f"request {i}: mtp and none differ"
        assert a.finish.completion_tokens == len(a.tokens)
    # `none` itself against a hand-driven prefill and one-token decodes.
    req = mixed_requests(NONE)[5]
    seq = engine.alloc_sequence()
    tokens = [engine.prefill([seq], [list(req.prompt_ids)]).argmax[0]]
    while len(tokens) < len(plain[5].tokens):
        tokens.append(engine.decode_verify_batched([tokens[-1]], [1], [seq]).argmax[0])
        engine.gdn_fold_accepted([seq], [1])
        engine.commit_accepted_prefix([seq], [1], [1])
    assert tokens == plain[5].tokens


def test_full_accepts_with_a_perfect_drafter() -> None:
    model = FakeModel(drafter=perfect_drafter(counting_oracle))
    s = scheduler(model)
    try:
        out = run_all(s, [GenRequest(str(i), (i,), 20) for i in range(3)])
    finally:
        s.stop()
    for i, o in enumerate(out):
        assert o.tokens == [(i + 1 + j) % 256 for j in range(20)]
        assert o.finish.reason == "length"
        assert o.finish.stats.accepted > 0 and o.finish.stats.mean_accepted_length > 2.0


@pytest.mark.parametrize("fused", [True, False], ids=["fused-step", "two-calls"])
def test_partial_drafter_stays_lossless(fused: bool) -> None:
    """Drafts right at the first position only: one accepted per verify, same tokens, by
    either path of the `fused_step` lever."""

    def drafter(history: tuple[int, ...], nd: int) -> list[int]:
        return [counting_oracle(history)] + [200] * (nd - 1)

    model = FakeModel(drafter=drafter)
    s = scheduler(model, fused_step=fused)
    try:
        (o,) = run_all(s, [GenRequest("a", (1,), 15)])
    finally:
        s.stop()
    assert o.tokens == list(range(2, 17))
    assert o.finish.stats.acceptance_at[0] == 1.0 and o.finish.stats.acceptance_at[1] == 0.0
    assert bool(model.steps()) == fused


def oracle_with(token: int, after: int):
    """Counting, but `token` comes after `after`."""
    return lambda h: token if h[-1] == after else counting_oracle(h)


@pytest.mark.parametrize(
    ("req", "oracle", "tokens", "text", "reason"),
    [
        (GenRequest("eos", (60,), 20), oracle_with(257, 64), [61, 62, 63, 64], "=>?@", "stop"),
        (
            GenRequest("ign", (60,), 6, ignore_eos=True),
            oracle_with(257, 62),
            [61, 62, 257, 2, 3, 4],
            "=>\x02\x03\x04",
            "length",
        ),
        (
            GenRequest("min", (60,), 20, min_new_tokens=3, stop_token_ids=(62,)),
            counting_oracle,
            [61, 62, 63, 64],
            None,
            None,
        ),
        (
            GenRequest("stopid", (60,), 20, stop_token_ids=(63,)),
            counting_oracle,
            [61, 62],
            "=>",
            "stop",
        ),
        (
            GenRequest("stopstr", (96,), 20, stop=("bcd",)),
            counting_oracle,
            [97, 98, 99, 100],
            "a",
            "stop",
        ),
        (GenRequest("len", (60,), 3), counting_oracle, [61, 62, 63], "=>?", "length"),
    ],
    ids=["eos", "ignore-eos", "min-new-tokens", "stop-token", "stop-string", "length"],
)
def test_stopping(req, oracle, tokens, text, reason) -> None:
    model = FakeModel(oracle=oracle, drafter=perfect_drafter(oracle))
    s = scheduler(model)
    try:
        (o,) = run_all(s, [req])
    finally:
        s.stop()
    if reason is None:  # min-new-tokens: the stop token is masked out before 3 tokens
        assert o.tokens[:3] == [61, 0, 1] and o.finish.reason == "length"
        return
    assert (o.tokens, o.text, o.finish.reason) == (tokens, text, reason)


def test_queue_bound_and_cancel() -> None:
    model = FakeModel(caps=(1, 1))
    s = Scheduler(lambda: model, TOK, SchedulerOptions(max_queue=3), NO_ENV)
    outs = [Outcome() for _ in range(4)]
    for i in range(3):
        s.submit(GenRequest(f"q{i}", (1,), 50), outs[i])
    with pytest.raises(ResourceExhausted, match="waiting"):
        s.submit(GenRequest("q3", (1,), 5), outs[3])
    for i in range(3):
        s.cancel(f"q{i}")
    s.start()
    try:
        for o in outs[:3]:
            assert o.done.wait(30) and o.finish.reason == "cancelled"
        assert model.slots == {} and s.snapshot()["queued"] == 0
    finally:
        s.stop()


def test_a_snapshot_with_no_request_active_shows_their_blocks_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GetStats' figures: the service's pool is asked after the requests are read. A request
    leaves `active` only once its sequence is freed, so a sequence freed between the two reads
    shows as still active, never as none active beside its block held."""
    s = Scheduler(lambda: FakeModel(), TOK, SchedulerOptions(), NO_ENV)
    holding = [1]

    def pool() -> tuple[int, int]:
        holding[0] = 0  # the loop frees the last sequence right after the pool was asked
        return 32, 31

    monkeypatch.setattr(s.loop, "holding", lambda: holding[0])
    monkeypatch.setattr(s.link, "kv_blocks", pool)
    snap = s.snapshot()
    assert snap["active"] > 0 or snap["kv_blocks_free"] == snap["kv_blocks"], snap


def test_long_prompt_prefills_in_chunks() -> None:
    model = FakeModel()
    s = scheduler(model, prefill_chunk=16)
    try:
        (o,) = run_all(s, [GenRequest("long", tuple(range(40)), 2)])
    finally:
        s.stop()
    assert [c[1] for c in model.calls if c[0] == "prefill"] == [[16], [16], [8]]
    assert o.tokens == [40, 41]


def test_logprobs_when_asked() -> None:
    model = FakeModel()
    s = scheduler(model)
    try:
        a, b = run_all(s, [GenRequest("a", (1,), 5, logprobs=True), GenRequest("b", (1,), 5)])
    finally:
        s.stop()
    assert a.logprobs == [-0.5] * 5 and b.logprobs == []


def test_prompt_scores_gathered_over_chunks() -> None:
    """A scored prompt prefilled in chunks asks each chunk's rows scored, the chunk's last
    against the next chunk's first token, and hears them whole, once, with its first token; a
    request that asks none is not scored."""
    model = FakeModel()
    s = scheduler(model, prefill_chunk=16)
    try:
        scored, plain = run_all(
            s,
            [
                GenRequest("scored", tuple(range(40)), 2, prompt_logprobs=3),
                GenRequest("plain", tuple(range(5)), 2),
            ],
        )
    finally:
        s.stop()
    assert plain.prompt is None and scored.prompt is not None
    assert scored.prompt.logprobs == [-1.0] * 39  # one per token after the first
    assert len(scored.prompt.top_ids) == 40 and scored.prompt.top_ids[-1] == [0, 1, 2]
    assert scored.tokens == [40, 41]


class _Down(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"


def test_failed_service_fails_open_requests_then_recovers() -> None:
    models = [FakeModel(), FakeModel()]

    def broken(*args, **kwargs):
        raise _Down()

    models[0].decode_verify_batched = broken
    s = Scheduler(lambda: models.pop(0), TOK, SchedulerOptions(), NO_ENV)
    s.start()
    try:
        (bad,) = run_all(s, [GenRequest("a", (1,), 5)])
        assert bad.failure is not None and bad.failure.code == "UNAVAILABLE"
        (good,) = run_all(s, [GenRequest("b", (1,), 5)])
        assert good.finish.reason == "length" and good.tokens == [2, 3, 4, 5, 6]
    finally:
        s.stop()
