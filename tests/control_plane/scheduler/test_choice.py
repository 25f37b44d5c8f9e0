"""The server's choice (`auto`): options served a few times each before any is weighed, then
the best by expected tokens per measured millisecond, served again when stale; a sequence whose own
acceptance is poor sits out and probes; named requests keep their method; and whatever is
chosen, step after step, greedy output equals no speculation's."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from control_plane.scheduler.choice import (
    FAR,
    NONE_OPTION,
    OWN_SEEN,
    PROBE,
    REVISIT,
    SAMPLES,
    SETTLE,
    TIMED,
    Chooser,
    Option,
    bucket,
)
from control_plane.scheduler.env import Env
from control_plane.scheduler.methods import BLOCK, HEAD, PLAIN
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import ActiveSeq, GenRequest, ModelFacts
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import DFLASH_VERIFY_TIERS, ServiceConfig
from protos.defaults import DEFAULT_MODEL_DIR, DRAFTER_DIR
from protos.model import DFLASH, MTP_HEAD
from protos.params import AUTO, MTP, NONE
from tests.collect import Outcome
from tests.fake_model import FakeModel
from tools.bench.workload import Workload
from tools.bench.workload import serve as serve_work

TOK = ByteTokenizer.default()


def caps(dflash: int = 0):
    from dataclasses import replace

    return replace(FakeModel(caps=(3,) * 4).capabilities(), dflash_block=dflash)


def seq(rid: str, method: str = AUTO) -> ActiveSeq:
    return ActiveSeq(GenRequest(rid, (1,), 50, method=method), lambda ev: None, TOK, ModelFacts())


# Steps an option runs when it is measured TIMED times in a row from its first step.
RUN = TIMED + SETTLE - 1
# Tokens a sequence gains in a step it runs an option (one that sits out gains one).
YIELDS = {"none": 1, "mtp:1": 2, "mtp:2": 3, "mtp:3": 3}


def served(
    chooser: Chooser,
    active: list[ActiveSeq],
    costs: dict[str, float],
    steps: int,
    yields: dict[str, int] = YIELDS,
) -> list[str]:
    """`steps` steps chosen, each choosing sequence gaining its option's `yields` (by option
    name), timed at `costs`. -> the options served"""
    out = []
    for _ in range(steps):
        pick = chooser.choose(active, caps(), 3, 8)
        assert pick is not None
        out.append(str(pick))
        for a in active:
            a.generated += [0] * (yields[str(pick)] if a.method is pick.method else 1)
        chooser.observe(active, costs[str(pick)])
    return out


def test_options_each_method_at_its_widths_within_the_caps() -> None:
    chooser = Chooser()
    assert [str(o) for o in chooser.options(caps(), 3, 2, 8)] == ["none", "mtp:1", "mtp:2", "mtp:3"]
    assert [str(o) for o in chooser.options(caps(16), 2, 2, 8)] == [
        "none",
        "mtp:1",
        "mtp:2",
        "dflash:2",
        "dflash:3",
    ], "a block's widths up to the slots' capacity, whatever --num-drafts"
    assert [str(o) for o in chooser.options(caps(16), 3, 9, 8)] == ["none", "dflash:2", "dflash:3"]
    assert [str(o) for o in chooser.options(caps(16), 0, 2, 8)] == ["none"]


def test_every_option_is_timed_then_the_best_is_served() -> None:
    chooser, active = Chooser(), [seq("a"), seq("b")]
    # Tokens per millisecond: none 2.0, mtp:1 2.1, mtp:2 3.0, mtp:3 2.0.
    costs = {"none": 1.0, "mtp:1": 1.9, "mtp:2": 2.0, "mtp:3": 3.0}
    timed = [o for o in ("none", "mtp:1", "mtp:2", "mtp:3") for _ in range(RUN)]
    assert served(chooser, active, costs, len(timed) + 2) == [*timed, "mtp:2", "mtp:2"]
    assert all(a.method is HEAD for a in active)
    costs["mtp:2"] = 4.0  # a busier machine: what it delivers falls step by step until it loses
    assert served(chooser, active, costs, SAMPLES)[-1] == "mtp:1"


def test_a_new_batch_size_times_none_and_scales_the_others_from_a_neighbour() -> None:
    chooser, two = Chooser(), [seq("a"), seq("b")]
    costs = {"none": 1.0, "mtp:1": 1.9, "mtp:2": 2.0, "mtp:3": 3.0}
    served(chooser, two, costs, 4 * RUN)
    three = [*two, seq("c")]  # bucket 4: everything costs twice as much, in the same ratios
    doubled = {o: 2 * ms for o, ms in costs.items()}
    assert served(chooser, three, doubled, RUN + 1) == ["none"] * RUN + ["mtp:2"]


def test_an_option_not_served_for_a_while_is_timed_again() -> None:
    """One near the best every REVISIT steps; one far from it FAR times as rarely."""
    chooser, active = Chooser(), [seq("a")]
    costs = {"none": 1.0, "mtp:1": 2.2, "mtp:2": 9.0, "mtp:3": 9.0}  # mtp:1 near, at 0.91
    served(chooser, active, costs, 4 * RUN)
    picks = served(chooser, active, costs, REVISIT + SETTLE)
    assert set(picks) == {"none", "mtp:1"} and picks.count("mtp:1") == SETTLE, "until measured"
    picks = served(chooser, active, costs, FAR * REVISIT)
    assert {"mtp:2", "mtp:3"} <= set(picks), "each far option served again, at last"


def test_drafts_that_do_not_stand_turn_the_choice_to_none() -> None:
    chooser, active = Chooser(), [seq("a"), seq("named", MTP)]
    costs = {"none": 1.0, "mtp:1": 1.5, "mtp:2": 2.0, "mtp:3": 2.5}
    nothing_stands = dict.fromkeys(YIELDS, 1)
    served(chooser, active, costs, 4 * RUN, nothing_stands)
    assert served(chooser, active, costs, 1, nothing_stands) == ["none"]
    assert active[1].method is HEAD, "a request that names its method keeps it"


def test_a_sequence_whose_own_drafts_fall_sits_out_and_probes() -> None:
    chooser, good, poor = Chooser(), seq("good"), seq("poor")
    # For two: none 2.0 tokens/ms, mtp:1 2.5, mtp:2 3.3, mtp:3 2.7.
    costs = {"none": 1.0, "mtp:1": 1.6, "mtp:2": 1.8, "mtp:3": 2.2}
    served(chooser, [good, poor], costs, 4 * RUN)
    good.drafted_by = poor.drafted_by = MTP_HEAD
    for _ in range(OWN_SEEN):
        good.record_verify(3, 3)
        poor.record_verify(3, 0)
    chooser.choose([], caps(), 3, 8)  # a step with no choosing sequence reads the verdicts
    chooser.observe([good, poor], 1.0)
    methods = []
    for _ in range(PROBE + 1):
        served(chooser, [good, poor], costs, 1)
        methods.append(poor.method)
    assert good.method is HEAD and methods[0] is PLAIN
    assert methods.count(HEAD) == 1 and methods[-1] is HEAD, "one probe after PROBE steps"


def test_nothing_is_chosen_without_a_choosing_request() -> None:
    chooser = Chooser()
    assert chooser.choose([seq("a", NONE)], caps(), 3, 8) is None
    assert chooser.width("heads") is None
    assert bucket(1) == 1 and bucket(3) == 4 and bucket(10**6) == 256


def test_a_chosen_block_width_goes_to_the_block_arm_only() -> None:
    chooser = Chooser()
    chooser.current = Option(BLOCK, 4)
    assert chooser.width("blocks") == 4 and chooser.width("heads") is None
    chooser.current = NONE_OPTION
    assert chooser.width("blocks") is None


# -- lossless whatever is chosen -----------------------------------------------------------


def cycling(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every step a different option, in turn, for every choosing sequence."""
    turn = itertools.count()
    seen: list[str] = []

    def pick(self, options, choosing):
        o = options[next(turn) % len(options)]
        seen.append(str(o))
        return o

    monkeypatch.setattr(Chooser, "_pick", pick)
    return seen


def serve(engine: Engine, reqs: list[GenRequest], **opts) -> list[Outcome]:
    s = Scheduler(lambda: engine, TOK, SchedulerOptions(**opts), Env())
    outs = [Outcome() for _ in reqs]
    for r, o in zip(reqs, outs, strict=True):
        s.submit(r, o)
    s.start()
    try:
        for o in outs:
            assert o.done.wait(120), "a request did not finish"
        return outs
    finally:
        s.stop()


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "synchronous"])
def test_with_a_block_drafter_greedy_output_equals_none_whatever_the_choice(
    monkeypatch: pytest.MonkeyPatch, pipeline: bool
) -> None:
    """The bundled model and its drafter: a choice moves sequences between the pipelined
    step (none, mtp) and the synchronous one (dflash), and between drafters, step by step;
    one that ends in the drain before a synchronous step steps no further."""
    svc = ServiceConfig(verify_tiers=DFLASH_VERIFY_TIERS, max_context=256)
    engine = Engine(DEFAULT_MODEL_DIR, svc, drafter=DEFAULT_MODEL_DIR / DRAFTER_DIR)
    work = Workload(DEFAULT_MODEL_DIR)
    plain = serve_work(lambda: engine, work.requests(NONE, 4, 64), work.tokenizer)
    seen = cycling(monkeypatch)
    opts = {"pipeline": pipeline}
    chosen = serve_work(lambda: engine, work.requests(AUTO, 4, 64), work.tokenizer, opts)
    for i in range(4):
        assert chosen["tokens"][f"auto-{i}"] == plain["tokens"][f"none-{i}"]
    assert {"mtp:1", "dflash:2"} <= set(seen)
    assert chosen["spec"].by_method[DFLASH].drafted > 0


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "synchronous"])
def test_greedy_output_equals_none_whatever_the_choice(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, pipeline: bool
) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3,8:2", max_context=256))
    prompts = [tuple(range(5 + i, 12 + 2 * i)) for i in range(5)]
    plain = serve(engine, [GenRequest(f"n{i}", p, 30, method=NONE) for i, p in enumerate(prompts)])
    seen = cycling(monkeypatch)
    auto = [GenRequest(f"a{i}", p, 30, method=AUTO) for i, p in enumerate(prompts)]
    chosen = serve(engine, auto, pipeline=pipeline)
    for a, b in zip(plain, chosen, strict=True):
        assert a.tokens == b.tokens
    assert {"none", "mtp:1", "mtp:3"} <= set(seen), "the choice changed from step to step"
    stats = [o.finish.stats.by_method for o in chosen]
    assert all(MTP_HEAD in s and NONE in s for s in stats), "each response names what it ran"
    assert DFLASH not in engine.capabilities().drafters
