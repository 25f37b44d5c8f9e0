"""The server's choice (`auto`): MTP first, the others measured in turn,
the one that delivers more tokens per millisecond taking over; a sequence whose own
acceptance is poor sits out and probes; named requests keep their method; and whatever is
chosen, step after step, greedy output equals no speculation's."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from control_plane.scheduler.choice import (
    BACKOFF,
    BUDGET,
    EXPLORE,
    NONE_OPTION,
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
from control_plane.text.grammar import GrammarCompiler
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
YIELDS = {"none": 1, "mtp": 3, "dflash": 4}


def served(
    chooser: Chooser,
    active: list[ActiveSeq],
    costs: dict[str, float],
    steps: int,
    yields: dict[str, int] = YIELDS,
    poor: frozenset[str] = frozenset(),
) -> list[str]:
    """`steps` steps chosen, each choosing sequence gaining its option's `yields` (by option
    name; one token, its drafts refused, for the requests `poor` names), timed at `costs`.
    -> the options served"""
    out = []
    now = [chooser.clock() if chooser.mark is not None else 0.0]
    chooser.clock = lambda: now[0]
    for _ in range(steps):
        pick = chooser.choose(active, caps(16), 3, 8)
        assert pick is not None
        out.append(str(pick))
        for a in active:
            runs = a.method is pick.method and a.req.request_id not in poor
            gained = yields[str(pick)] if runs else 1
            a.generated += [0] * gained
            a.drafted_by = a.method.name
            a.record_verify(3 if a.method.drafts else 0, gained - 1)
        chooser.observe(active)
        now[0] += costs[str(pick)] / 1e3  # the step's time, read at the next choice
    return out


def test_options_none_and_each_method_the_service_drafts_with_within_the_caps() -> None:
    chooser = Chooser()
    assert [str(o) for o in chooser.options(caps(), 3, 2, 8)] == ["none", "mtp"]
    assert [str(o) for o in chooser.options(caps(16), 2, 2, 8)] == ["none", "mtp", "dflash"]
    assert [str(o) for o in chooser.options(caps(16), 3, 9, 8)] == ["none", "dflash"], (
        "chains only within --mtp-max-seqs"
    )
    assert [str(o) for o in chooser.options(caps(16), 0, 2, 8)] == ["none"]
    assert [str(o) for o in chooser.options(caps(1), 3, 2, 8)] == ["none", "mtp"], (
        "a block of one holds no draft"
    )


# Tokens per millisecond for two sequences: none 2.0, mtp 2.0, dflash 3.2.
COSTS = {"none": 1.0, "mtp": 3.0, "dflash": 2.5}


def test_mtp_runs_first_then_the_one_that_delivers_more() -> None:
    chooser, active = Chooser(), [seq("a"), seq("b")]
    picks = served(chooser, active, COSTS, 3 * EXPLORE)
    assert picks[:RUN] == ["mtp"] * RUN, "what a request naming no method got before, first"
    assert set(picks) == {"none", "mtp", "dflash"}, "each measured in turn"
    assert picks[-EXPLORE // 2 :].count("dflash") >= EXPLORE // 2 - SETTLE, "dflash took over"
    assert all(a.method is BLOCK for a in active)


def test_exploring_costs_a_run_every_explore_steps() -> None:
    chooser, active = Chooser(), [seq("a"), seq("b")]
    served(chooser, active, COSTS, 3 * EXPLORE)
    picks = served(chooser, active, COSTS, 2 * EXPLORE)
    assert len(picks) - picks.count("dflash") <= 2 * SETTLE


def test_a_busier_machine_moves_the_incumbent() -> None:
    chooser, active = Chooser(), [seq("a"), seq("b")]
    served(chooser, active, COSTS, 3 * EXPLORE)
    slower = {**COSTS, "dflash": 5.0}  # dflash now delivers 1.6, measured as it runs
    served(chooser, active, slower, 2 * SAMPLES)
    assert chooser.incumbent[(2, False)] != Option(BLOCK)


def test_drafts_that_do_not_stand_turn_the_choice_to_none() -> None:
    chooser, active = Chooser(), [seq("a"), seq("named", MTP)]
    costs = {"none": 1.0, "mtp": 2.0, "dflash": 2.5}
    nothing_stands = dict.fromkeys(YIELDS, 1)
    picks = served(chooser, active, costs, 3 * EXPLORE, nothing_stands)
    assert picks[-1] == "none" and active[0].method is PLAIN
    assert active[1].method is HEAD, "a request that names its method keeps it"


class Forcing:
    """A grammar that constrains every next token."""

    def constrains(self) -> bool:
        return True


def test_a_new_batch_size_starts_from_its_nearest_known_one() -> None:
    chooser, two = Chooser(), [seq("a"), seq("b")]
    served(chooser, two, COSTS, 3 * EXPLORE)
    three = [*two, seq("c")]
    assert served(chooser, three, COSTS, RUN) == ["dflash"] * RUN, "the incumbent of two"
    constrained = seq("json")
    constrained.grammar = Forcing()  # type: ignore[assignment]
    picks = served(chooser, [*three, constrained], COSTS, 1)
    assert picks == ["none"], "no grammar's shape known: none, which MTP must beat under a grammar"
    constrained_two = Chooser()
    picks = served(constrained_two, [seq("a"), constrained], COSTS, 3 * EXPLORE)
    assert picks[0] == "none" and picks[-EXPLORE // 2 :].count("dflash") >= EXPLORE // 2 - SETTLE


def test_a_shape_met_before_its_neighbours_ran_an_option_waits_as_they_found() -> None:
    """One request alone first (too briefly to explore), then two, where dflash is found far
    worse; alone again, dflash waits as the two's wait says instead of running at once."""
    chooser, a, b = Chooser(), seq("a"), seq("b")
    far = {"none": 1.0, "mtp": 1.0, "dflash": 20.0}
    served(chooser, [a], far, SETTLE)
    served(chooser, [a, b], far, 3 * EXPLORE)
    assert chooser.waits[((2, False), Option(BLOCK))] >= 4 * EXPLORE
    assert "dflash" not in served(chooser, [a], far, EXPLORE)


def test_a_sequence_whose_own_drafts_fall_sits_out_and_probes() -> None:
    chooser, good, poor = Chooser(), seq("good"), seq("poor")
    # For two: none 2.0 tokens/ms, mtp 3.3 (2.2 with one sitting out), dflash 1.6.
    costs = {"none": 1.0, "mtp": 1.8, "dflash": 5.0}
    refused = frozenset({"poor"})
    served(chooser, [good, poor], costs, 3 * EXPLORE, poor=refused)
    methods, goods = [], []
    for _ in range(2 * PROBE):
        # Another option's exploring run falls inside: the sequence joins it (it has no
        # record of it), and its PROBE steps out count from the next sit-out.
        if served(chooser, [good, poor], costs, 1, poor=refused) == ["mtp"]:
            methods.append(poor.method)
            goods.append(good.method)
    assert set(goods) == {HEAD} and methods[0] is PLAIN
    assert HEAD in methods and methods.count(PLAIN) >= len(methods) - 2, "a probe a PROBE steps"


def test_nothing_is_chosen_without_a_choosing_request() -> None:
    chooser = Chooser()
    assert chooser.choose([seq("a", NONE)], caps(), 3, 8) is None
    assert bucket(1) == 1 and bucket(3) == 4 and bucket(10**6) == 256


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
    assert {"none", "mtp", "dflash"} <= set(seen)
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
    assert {"none", "mtp"} <= set(seen), "the choice changed from step to step"
    stats = [o.finish.stats.by_method for o in chosen]
    assert all(MTP_HEAD in s and NONE in s for s in stats), "each response names what it ran"
    assert DFLASH not in engine.capabilities().drafters


def test_a_step_counts_once_the_verdicts_come_from_what_runs() -> None:
    """After a switch the pipeline returns what the option before planned, and a drafter's
    first verify holds no drafts: such steps are not the new option's measure."""
    chooser, a = Chooser(), seq("a")
    now = [0.0]
    chooser.clock = lambda: now[0]

    def step(drafted: int) -> None:
        assert str(chooser.choose([a], caps(16), 3, 8)) == "mtp"
        a.generated.append(0)
        a.drafted_by = MTP_HEAD
        a.record_verify(drafted, 0)
        chooser.observe([a])
        now[0] += 1e-3

    for _ in range(2 * SETTLE):
        step(0)  # verifies without drafts, as right after a switch
    assert not chooser.measured
    for _ in range(SETTLE + 1):
        step(3)
    assert sum(chooser.measured.values()) >= 1


def test_a_run_whose_drafts_a_grammar_cuts_all_of_is_measured() -> None:
    """A verify whose drafts the grammar cut to none followed its drafter's step: read as
    none's, no step of a run under a grammar counted, and the run came back at once."""
    chooser, a = Chooser(), seq("a")
    a.grammar = GrammarCompiler(TOK, 320, (257,)).compile("regex", "a+")
    chooser.incumbent[(1, True)] = Option(HEAD)  # MTP serving the constrained shape
    now = [0.0]
    chooser.clock = lambda: now[0]
    for _ in range(RUN + 1):
        chooser.choose([a], caps(16), 3, 8)
        if a.method.drafts:
            a.pending_drafts, a.pending_conf, a.drafted_by = [ord("b")] * 3, [1.0] * 3, MTP_HEAD
            a.cut_drafts()
        a.generated.append(ord("a"))
        a.record_verify(len(a.pending_drafts), 0)
        chooser.observe([a])
        now[0] += 1e-3
    assert chooser.measured[((1, True), Option(HEAD))] == TIMED
    assert a.stats.grammar_truncations == RUN  # then none's turn to be measured


# DFlash at 0.8 of mtp's tokens a millisecond: clearly less, its runs cheap enough that the
# budget never holds them back.
NEAR = {"none": 1.0, "mtp": 1.0, "dflash": 4 / (0.8 * 3)}


def test_what_delivers_clearly_less_is_watched_ever_less_often() -> None:
    chooser, active = Chooser(), [seq("a"), seq("b")]
    picks = served(chooser, active, NEAR, 60 * EXPLORE)
    gaps = _dflash_gaps(picks)
    assert len(gaps) >= 3 and gaps == sorted(gaps) and gaps[-1] >= 3 * gaps[0], "its wait grew"
    assert gaps[-1] <= EXPLORE * BACKOFF + RUN * SETTLE, "and is bounded"


def _dflash_gaps(picks: list[str]) -> list[int]:
    runs = [i for i, p in enumerate(picks) if p == "dflash" and picks[i - 1] != "dflash"]
    return [b - a for a, b in itertools.pairwise(runs)]


def test_what_delivers_far_less_waits_longer_than_what_delivers_a_little_less() -> None:
    """After its first run, DFlash at 0.8 of mtp's tokens a millisecond waits twice EXPLORE;
    at a fifteenth, four times."""

    def wait(dflash_ms: float) -> int:
        chooser, active = Chooser(), [seq("a"), seq("b")]
        picks = served(chooser, active, {**NEAR, "dflash": dflash_ms}, 2 * EXPLORE)
        assert picks.count("dflash") == RUN, "one run"
        return chooser.waits[((2, False), Option(BLOCK))]

    assert wait(NEAR["dflash"]) == 2 * EXPLORE and wait(20.0) == 4 * EXPLORE


def test_watching_what_delivers_far_less_costs_at_most_the_budget() -> None:
    """DFlash at a fifteenth of mtp's tokens a millisecond: measured at once, then watched at
    four times EXPLORE or longer, what its runs cost beyond mtp's rate within BUDGET of the
    time served (one run over at most)."""
    chooser, active = Chooser(), [seq("a"), seq("b")]
    costs = {"none": 1.0, "mtp": 1.0, "dflash": 20.0}
    picks = served(chooser, active, costs, 200 * EXPLORE)
    gaps = _dflash_gaps(picks)
    assert "dflash" in picks[: 3 * EXPLORE] and gaps and gaps[0] >= 4 * EXPLORE
    shape = (2, False)
    run_cost = RUN * (costs["dflash"] - 2 * YIELDS["dflash"] / 6.0)
    assert chooser.lost[(shape, Option(BLOCK))] <= BUDGET * chooser.spent[shape] + 2 * run_cost
    assert chooser.lost.get((shape, NONE_OPTION), 0.0) <= BUDGET * chooser.spent[shape], "none"
    assert chooser.incumbent[shape] == Option(HEAD)
