"""Faults that concern one request end that request alone: a refused mask, a slot the service
cannot give, a lost connection. Beside each, the healthy streams finish token-identical to a
quiet run."""

from __future__ import annotations

import random
from pathlib import Path

import grpc

from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.grammar import GrammarCompiler
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.model import MTP_HEAD, FailedPrecondition, ResourceExhausted
from protos.params import MTP
from tests.collect import Outcome, run_all
from tests.fake_model import FakeModel

TOK = ByteTokenizer.default()


def greedy(n: int, max_new: int = 24, seed: int = 0) -> list[GenRequest]:
    rng = random.Random(seed)
    return [
        GenRequest(f"g{i}", tuple(rng.randrange(256) for _ in range(3 + 5 * i)), max_new)
        for i in range(n)
    ]


def run(model, reqs: list[GenRequest]) -> list[Outcome]:
    s = Scheduler(lambda: model, TOK, SchedulerOptions(), Env())
    s.start()
    try:
        return run_all(s, reqs, timeout=30)
    finally:
        s.stop()


def tokens(outs: list[Outcome]) -> list[list[int]]:
    for o in outs:
        assert o.finish is not None, o.failure
    return [o.tokens for o in outs]


def test_a_mask_that_allows_no_token_ends_its_request_alone(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3,8:2", max_context=256))
    caps = engine.capabilities()
    compiler = GrammarCompiler(TOK, caps.vocab_size, caps.eos_token_ids)
    quiet = tokens(run(engine, greedy(4)))
    # The empty regex allows only EOS, which min_new_tokens bans: the first row allows nothing.
    bad = GenRequest(
        "bad", (5, 6, 7), 10, min_new_tokens=5, method=MTP, grammar=compiler.compile("regex", "")
    )
    *healthy, refused = run(engine, [*greedy(4), bad])  # one prefill call for all five
    assert tokens(healthy) == quiet
    assert refused.failure is not None and refused.failure.code == "INVALID_ARGUMENT"
    assert "allows no token" in refused.failure.message
    assert engine.capabilities().free_slots == caps.num_slots, "the refused sequence was freed"


def test_a_refused_verify_ends_its_request_alone() -> None:
    quiet = tokens(run(FakeModel(), greedy(4)))
    model = FakeModel()
    verify, step = model.decode_verify_batched, model.decode_step

    def refusing(call):
        def wrapped(tokens, ks, seqs, *args, **kwargs):
            if any(model.seqs[h.seq_id].tokens[:1] == [200] and h.seq_len > 4 for h in seqs):
                raise FailedPrecondition("the grammar refused committed tokens")
            return call(tokens, ks, seqs, *args, **kwargs)

        return wrapped

    model.decode_verify_batched, model.decode_step = refusing(verify), refusing(step)
    *healthy, refused = run(model, [*greedy(4), GenRequest("bad", (200,), 20)])
    assert tokens(healthy) == quiet
    assert refused.failure is not None and refused.failure.code == "FAILED_PRECONDITION"
    assert "refused committed tokens" in refused.failure.message
    assert model.slots == {}


def test_a_slot_held_elsewhere_keeps_the_request_waiting() -> None:
    quiet = tokens(run(FakeModel(caps=(3, 3, 3, 3)), greedy(3)))
    model = FakeModel(caps=(3, 3, 3, 3))
    s = Scheduler(lambda: model, TOK, SchedulerOptions(), Env())
    s.start()
    try:
        run_all(s, [GenRequest("warm", (1,), 2)], timeout=30)  # connected: 4 slots free
        held = [model.alloc_sequence() for _ in range(4)]  # all taken by another client
        alloc, capabilities, refusals, polls = model.alloc_sequence, model.capabilities, [], []

        def counted_alloc(penalties=None, drafter=MTP_HEAD):
            try:
                return alloc(penalties, drafter)
            except ResourceExhausted:
                refusals.append(len(model.slots))
                raise

        def caps_then_release():
            polls.append(1)
            if len(polls) == 2:  # the other client lets its slots go
                for h in held:
                    model.free_sequence(h)
            return capabilities()

        model.alloc_sequence, model.capabilities = counted_alloc, caps_then_release
        outs = run_all(s, greedy(3), timeout=30)  # g0 finds no slot; none of ours frees one
    finally:
        s.stop()
    assert refusals == [4], "one refused alloc, then the service's count was trusted"
    assert len(polls) >= 2
    assert tokens(outs) == quiet
    assert model.slots == {}


class _Down(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset"


def test_a_lost_connection_frees_what_the_service_still_holds() -> None:
    quiet = tokens(run(FakeModel(caps=(3, 3)), greedy(1, seed=1)))
    model = FakeModel(caps=(3, 3))
    verify, step, asked = model.decode_verify_batched, model.decode_step, []
    capabilities = model.capabilities

    def down_once(call):
        def wrapped(*args, **kwargs):
            if not asked:
                asked.append("down")
                raise _Down()
            return call(*args, **kwargs)

        return wrapped

    def caps():
        if asked:
            asked.append(len(model.slots))  # what the service holds when asked
        return capabilities()

    model.decode_verify_batched, model.decode_step = down_once(verify), down_once(step)
    model.capabilities = caps
    first = greedy(2, seed=2)
    (later,) = greedy(1, seed=1)
    outs = run(model, [*first, later])  # two slots: `later` waits through the fault
    for o in outs[:2]:
        assert o.failure is not None and o.failure.code == "UNAVAILABLE"
        assert "connection reset" in o.failure.message
    assert tokens(outs[2:]) == quiet
    assert asked[:2] == ["down", 2], "the service was asked while it held both sequences"
    assert model.slots == {}
