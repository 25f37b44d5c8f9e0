"""The levers beyond the core: adaptive rung, D-Cut, draft-confidence stop, prompt lookup;
each branch with a fake Model, then losslessness with each on, alone and together."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from control_plane.scheduler.arms import step_mtp
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.env import Env
from control_plane.scheduler.methods import find_copy
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import ActiveSeq, GenRequest, ModelFacts
from control_plane.scheduler.widths import LOW, AdaptiveRung, Ladder, dcut_depth
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.params import MTP, NONE, PROMPT_LOOKUP
from tests.collect import run_all
from tests.control_plane.scheduler.test_step import NO_ENV, seqs
from tests.fake_model import FakeModel, counting_oracle

TOK = ByteTokenizer.default()


def ctx(model: FakeModel, **opts) -> StepContext:
    return StepContext.build(model.capabilities(), replace(NO_ENV, **opts))


# -- adaptive rung -------------------------------------------------------------------------


def test_adaptive_rung_rises_holds_and_falls() -> None:
    rung = AdaptiveRung(Ladder.parse("4:3,8:3,16:1,32:1"), window=10)
    assert rung.drafts_for(12, 3) == 1
    for _ in range(10):
        rung.observe(1, 1)
    assert rung.raised and rung.drafts_for(12, 3) == 2
    assert rung.drafts_for(20, 3) == 1 and rung.drafts_for(4, 3) == 3, "only 9..16 change"
    assert rung.drafts_for(12, 1) == 1, "never above num_drafts"
    for _ in range(5):  # 5 of 10 accepted: between the thresholds, it holds
        rung.observe(1, 0)
    assert rung.raised
    for _ in range(2):
        rung.observe(1, 0)
    assert not rung.raised and rung.drafts_for(12, 3) == 1
    rung.observe(0, 0)
    assert len(rung.window) == 10, "verifies without drafts are not observed"


def test_adaptive_rung_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_NO_MTP_ADAPTIVE_RUNG", "1")
    c = StepContext.build(FakeModel().capabilities(), NO_ENV.with_env(Env.read()))
    for _ in range(64):
        c.rung.observe(1, 1)
    assert c.rung.drafts_for(12, 3) == 1


def test_adaptive_rung_moves_with_what_step_mtp_observes() -> None:
    """Steps over 9 sequences whose first drafts stand raise the width from 1 to 2; once
    first drafts fall, it comes back to 1."""
    model = FakeModel(caps=(3,) * LOW, max_batch=LOW)
    active = seqs(model, LOW, max_new=200)
    c = ctx(model)
    rising = [step_mtp(model, active, c, 3).ladder_nd for _ in range(10)]
    assert rising[:2] == [1, 1] and rising[-1] == 2 and c.rung.raised, rising
    model.drafter = lambda history, nd: [(history[-1] + 7) % 256] * nd  # first drafts fall
    falling = [step_mtp(model, active, c, 3).ladder_nd for _ in range(10)]
    assert falling[0] == 2 and falling[-1] == 1 and not c.rung.raised, falling


# -- D-Cut ---------------------------------------------------------------------------------


def test_dcut_depth() -> None:
    assert dcut_depth([0.9, 0.9, 0.9], 0.3) == 3
    assert dcut_depth([0.9, 0.5, 0.5], 0.3) == 2
    assert dcut_depth([0.1, 0.9], 0.3) == 1, "at least one draft"


def test_dcut_cuts_and_orders_the_batch() -> None:
    model = FakeModel()
    active = seqs(model, 3, drafts=[3, 3, 3])
    active[0].pending_conf = [0.9, 0.2, 0.9]
    active[2].pending_conf = [0.9, 0.9, 0.2]
    report = step_mtp(model, active, ctx(model, dcut=True), 3)
    assert report.dcut and report.batched_calls == [[4, 3, 2]], "deepest first"
    assert model.verify_calls()[0][2] == [1, 2, 0]


@pytest.mark.parametrize(
    ("opts", "nd"),
    [({"dcut": False}, 3), ({}, 3), ({"dcut": True}, 1), ({"dcut": True, "dcut_width_cap": 2}, 3)],
    ids=["no-dcut", "off-by-default", "ladder-below-2", "wider-than-cap"],
)
def test_dcut_stands_aside(opts: dict, nd: int) -> None:
    model = FakeModel()
    active = seqs(model, 3, drafts=[nd] * 3)
    for a in active:
        a.pending_conf = [0.9] + [0.1] * (nd - 1)
    report = step_mtp(model, active, ctx(model, **opts), nd)
    assert not report.dcut and report.batched_calls == [[nd + 1] * 3]


# -- draft-confidence stop -----------------------------------------------------------------


def test_draft_confidence_stop_ends_chains_and_they_still_batch() -> None:
    model = FakeModel()
    active = seqs(model, 3)
    for a in active:
        a.draft_stop = -0.5  # log(0.9) = -0.105 passes; the fake's confidences are 0.9
    step_mtp(model, active, ctx(model, draft_confidence_stop=-0.5), 3)
    assert [len(a.pending_drafts) for a in active] == [3, 3, 3]
    for a in active:
        a.draft_stop = -0.05  # now every draft is below: no chain survives
    active[0].pending_drafts, active[0].pending_conf = [active[0].last + 1], [0.9]
    active[1].pending_drafts = active[1].pending_drafts[:2]
    active[1].pending_conf = active[1].pending_conf[:2]
    model.calls.clear()
    report = step_mtp(model, active, ctx(model, draft_confidence_stop=-0.05), 3)
    assert sorted(report.batched_calls[0]) == [2, 3, 4], "each joins at its own depth"
    assert all(a.pending_drafts == [] for a in active)


# -- prompt lookup -------------------------------------------------------------------------


def test_find_copy() -> None:
    assert find_copy([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]
    assert find_copy([5, 1, 2, 7, 1, 2], 2) == [7, 1], "two-grams when no three-gram repeats"
    assert find_copy([4, 5, 1, 2, 3, 6, 2, 3], 3) == [6, 2, 3], "the most recent occurrence"
    assert find_copy([1, 2, 3, 4], 3) == []


def _repeating(model: FakeModel, method: str, n: int) -> list[ActiveSeq]:
    out = []
    for i in range(n):
        prompt = (7, 8, 9, 10 + i, 7, 8)
        a = ActiveSeq(
            GenRequest(str(i), prompt, 50, method=method),
            lambda ev: None,
            TOK,
            ModelFacts(512, eos_ids=(257,)),
        )
        a.handle = model.alloc_sequence()
        model.prefill([a.handle], [list(prompt)])
        a.last = 9  # the history ends 7 8 9: the copy is what followed 7 8 9 before
        a.generated = [9]
        out.append(a)
    model.calls.clear()
    return out


def test_prompt_lookup_requests_verify_copies_or_decode_plainly() -> None:
    model = FakeModel(oracle=lambda h: 10 if h[-1] == 9 else counting_oracle(h))
    active = _repeating(model, PROMPT_LOOKUP, 2)
    active[1].generated, active[1].last = [42], 42  # no repeat: plain decode
    report = step_mtp(model, active, ctx(model), 3)
    assert report.copied == [True, False]
    assert "propose" not in model.names(), "prompt lookup never proposes"
    # Sequence 0 verified its copy [10, 7, 8] (the oracle after 9 says 10: accepted).
    assert active[0].generated[:3] == [9, 10, 11] and active[0].stats.drafted == 3
    assert active[1].generated == [42, 43] and active[1].stats.drafted == 0


def test_copy_joins_the_batch_at_its_own_depth_and_propose_keeps_ladder_nd() -> None:
    model = FakeModel(caps=(3,) * 8)
    active = [*_repeating(model, MTP, 1), *seqs(model, 2, drafts=[3, 3])]
    active[0].pending_drafts, active[0].pending_conf = [1], [0.9]  # an MTP chain to replace
    model.calls.clear()
    report = step_mtp(model, active, ctx(model, prompt_lookup=True, dcut=True), 3)
    assert report.copied == [True, False, False]
    (call,) = report.batched_calls
    assert sorted(call) == [4, 4, 4] and report.dcut
    proposes = [c for c in model.calls if c[0] == "propose"]
    assert proposes and all(nd == 3 for _, _, nd in proposes)
    assert active[0].copy == 0, "copies are settled after the step"


def test_lone_copy_takes_its_own_serial_arm() -> None:
    model = FakeModel(caps=(3,) * 8)
    (a,) = _repeating(model, PROMPT_LOOKUP, 1)
    a.req = GenRequest("x", (7, 8, 9, 1, 7, 8), 50, method=PROMPT_LOOKUP)
    report = step_mtp(model, [a], ctx(model), 1)
    assert report.serial_arms == ["K4"], "3 copied drafts, though the width is 1"


# -- lossless with the levers on -----------------------------------------------------------


def _requests(method: str) -> list[GenRequest]:
    rng = random.Random(3)
    out = []
    for i in range(12):
        base = [rng.randrange(256) for _ in range(rng.choice([2, 4, 6]))]
        prompt = tuple(base * rng.choice([1, 3]))  # repeats give prompt lookup matches
        m = (PROMPT_LOOKUP if i % 3 == 0 else MTP) if method == "mixed" else method
        out.append(GenRequest(f"r{i}", prompt, rng.randint(6, 20), method=m))
    return out


@pytest.mark.parametrize(
    "opts",
    [
        {"adaptive_rung": False},
        {"dcut_threshold": 0.05},
        {"draft_confidence_stop": -3.0},
        {"prompt_lookup": True},
        {"prompt_lookup": True, "draft_confidence_stop": -3.0, "dcut_threshold": 0.05},
        {"fused_step": False},
    ],
    ids=["static-ladder", "dcut", "draft-stop", "prompt-lookup", "all", "two-calls"],
)
def test_lossless_with_levers(tiny_dir: Path, opts: dict) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3,8:2", max_context=256))
    outs = {}
    for method in (NONE, "mixed"):
        s = Scheduler(lambda: engine, TOK, SchedulerOptions(**opts), Env())
        s.start()
        try:
            outs[method] = run_all(s, _requests(method))
        finally:
            s.stop()
    for i, (a, b) in enumerate(zip(outs[NONE], outs["mixed"], strict=True)):
        assert a.tokens == b.tokens, f"request {i} differs with the levers on"


@pytest.fixture(scope="module")
def echo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its layers damped and lm_head equal to the embedding: its greedy
    output tends to repeat itself, so prompt lookup finds copies on a real engine."""
    from gpu_service.model.weights import init_weights, save_weights
    from tests.conftest import TINY
    from training.checkpoint import init_model

    directory = tmp_path_factory.mktemp("echo")
    init_model(directory, TINY, seed=11)
    w = init_weights(TINY, 11)
    for name in w:
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            w[name] = w[name] * 0.05
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    save_weights(w, directory)
    return directory


def test_prompt_lookup_requests_are_lossless(tiny_dir: Path, echo_dir: Path) -> None:
    copies = []
    for directory in (tiny_dir, echo_dir):
        engine = Engine(directory, ServiceConfig(verify_tiers="8:3,8:2", max_context=256))
        s = Scheduler(
            lambda engine=engine: engine, TOK, SchedulerOptions(prompt_lookup=True), Env()
        )
        s.start()
        try:
            plain = run_all(s, _requests(NONE))
            lookup = run_all(s, _requests("mixed"))
            copies.append(s.snapshot()["counters"].copies)
        finally:
            s.stop()
        assert [o.tokens for o in plain] == [o.tokens for o in lookup], directory.name
    assert copies[1] > 0, "the echo model's repeats give copies"
    assert sum(o.finish.stats.accepted for o in lookup) > 0
