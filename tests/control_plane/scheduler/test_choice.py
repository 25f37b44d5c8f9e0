"""The server's choice (`auto`): the ladder's MTP width first, the others measured in turn,
the one that delivers more tokens per millisecond taking over; a sequence whose own
acceptance is poor sits out and probes; named requests keep their method; and whatever is
chosen, step after step, greedy output equals no speculation's."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from control_plane.scheduler.choice import (
    EXPLORE,
    NONE_OPTION,
    OWN_SEEN,
    PROBE,
    SAMPLES,
    SETTLE,
    TIMED,
    Chooser,
    Option,
    bucket,
)
from control_plane.scheduler.methods import BLOCK, HEAD, PLAIN
from control_plane.scheduler.seq import ActiveSeq, GenRequest, ModelFacts
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import DFLASH_VERIFY_TIERS, ServiceConfig
from protos.defaults import DEFAULT_MODEL_DIR, DRAFTER_DIR
from protos.model import DFLASH, MTP_HEAD
from protos.params import AUTO, MTP, NONE
from tests.control_plane.scheduler.test_pipeline import serve
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
    now = [chooser.clock() if chooser.mark is not None else 0.0]
    chooser.clock = lambda: now[0]
    for _ in range(steps):
        pick = chooser.choose(active, caps(), 3, 8, ladder=3)
        assert pick is not None
        out.append(str(pick))
        for a in active:
            a.generated += [0] * (yields[str(pick)] if a.method is pick.method else 1)
        chooser.observe(active)
        now[0] += costs[str(pick)] / 1e3  # the step's time, read at the next choice
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


# Tokens per millisecond for two sequences: none 2.0, mtp:1 2.1, mtp:2 3.0, mtp:3 2.0.
COSTS = {"none": 1.0, "mtp:1": 1.9, "mtp:2": 2.0, "mtp:3": 3.0}


def test_the_ladders_width_runs_first_then_the_one_that_delivers_more() -> None:
    chooser, active = Chooser(), [seq("a"), seq("b")]
    picks = served(chooser, active, COSTS, 3 * EXPLORE)
    assert picks[:RUN] == ["mtp:3"] * RUN, "the ladder's width, until measured"
    assert set(picks) == {"none", "mtp:1", "mtp:2", "mtp:3"}, "each measured in turn"
    assert picks[-EXPLORE // 2 :].count("mtp:2") >= EXPLORE // 2 - SETTLE, "mtp:2 took over"
    assert all(a.method is HEAD for a in active)


def test_exploring_costs_a_run_every_explore_steps() -> None:
    chooser, active = Chooser(), [seq("a"), seq("b")]
    served(chooser, active, COSTS, 3 * EXPLORE)
    picks = served(chooser, active, COSTS, 2 * EXPLORE)
    assert len(picks) - picks.count("mtp:2") <= 2 * SETTLE


def test_a_busier_machine_moves_the_incumbent() -> None:
    chooser, active = Chooser(), [seq("a"), seq("b")]
    served(chooser, active, COSTS, 3 * EXPLORE)
    slower = {**COSTS, "mtp:2": 4.0}  # mtp:2 now delivers 1.5, measured as it runs
    assert served(chooser, active, slower, SAMPLES + 1)[-1] != "mtp:2"


def test_drafts_that_do_not_stand_turn_the_choice_to_none() -> None:
    chooser, active = Chooser(), [seq("a"), seq("named", MTP)]
    costs = {"none": 1.0, "mtp:1": 1.5, "mtp:2": 2.0, "mtp:3": 2.5}
    nothing_stands = dict.fromkeys(YIELDS, 1)
    picks = served(chooser, active, costs, 3 * EXPLORE, nothing_stands)
    assert picks[-1] == "none" and active[0].method is PLAIN
    assert active[1].method is HEAD, "a request that names its method keeps it"


def test_a_new_batch_size_starts_from_the_ladder_again() -> None:
    chooser, two = Chooser(), [seq("a"), seq("b")]
    served(chooser, two, COSTS, 3 * EXPLORE)
    assert served(chooser, [*two, seq("c")], COSTS, 1) == ["mtp:3"]


def test_a_sequence_whose_own_drafts_fall_sits_out_and_probes() -> None:
    chooser, good, poor = Chooser(), seq("good"), seq("poor")
    # For two: none 2.0 tokens/ms, mtp:1 2.5, mtp:2 3.3, mtp:3 2.7.
    costs = {"none": 1.0, "mtp:1": 1.6, "mtp:2": 1.8, "mtp:3": 2.2}
    served(chooser, [good, poor], costs, 3 * EXPLORE)
    good.drafted_by = poor.drafted_by = MTP_HEAD
    for _ in range(OWN_SEEN):
        good.record_verify(3, 3)
        poor.record_verify(3, 0)
    chooser.observe([good, poor])  # the verdicts read
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

    def pick(self, options, choosing, ladder):
        o = options[next(turn) % len(options)]
        seen.append(str(o))
        return o

    monkeypatch.setattr(Chooser, "_pick", pick)
    return seen


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
    plain = serve(
        engine, [GenRequest(f"n{i}", p, 30, method=NONE) for i, p in enumerate(prompts)], True
    )
    seen = cycling(monkeypatch)
    auto = [GenRequest(f"a{i}", p, 30, method=AUTO) for i, p in enumerate(prompts)]
    chosen = serve(engine, auto, pipeline)
    for a, b in zip(plain, chosen, strict=True):
        assert a.tokens == b.tokens
    assert {"none", "mtp:1", "mtp:3"} <= set(seen), "the choice changed from step to step"
    stats = [o.finish.stats.by_method for o in chosen]
    assert all(MTP_HEAD in s and NONE in s for s in stats), "each response names what it ran"
    assert DFLASH not in engine.capabilities().drafters
