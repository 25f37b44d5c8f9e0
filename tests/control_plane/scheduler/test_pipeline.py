"""The pipelined step on a real engine in process: greedy outputs token-identical with the
pipeline on and off (32 concurrent prompts, every method, stop strings and stop ids firing
mid-step, grammars mixed in, cancellations at random points), sampling reproducible, and the
stale-result cases: a plan continuing a sequence cancelled or freed meanwhile, a stop string
found one step late."""

from __future__ import annotations

import contextlib
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import Delta, GenRequest
from control_plane.text.grammar import GrammarCompiler
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.params import DFLASH, MTP, NONE, PROMPT_LOOKUP, SamplingParams
from protos.steps import StepPlan
from tests.collect import Outcome
from tests.conftest import TINY
from tests.gpu_service.dflash.drafter import write_drafter

TOK = ByteTokenizer.default()
SERVICE = ServiceConfig(verify_tiers="16:3,16:2", max_context=256)
METHODS = (NONE, MTP, PROMPT_LOOKUP)


def requests(n: int, seed: int = 0, methods: tuple[str, ...] = METHODS) -> list[GenRequest]:
    """Prompts with repeats (prompt lookup finds copies), `methods` in turn; every third
    request has stop strings, every fifth a stop id, chosen so that some fire mid-step."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        base = [rng.randrange(32, 127) for _ in range(rng.randint(3, 12))]
        prompt = tuple(base * rng.choice([1, 3]))
        stop = ("e", "a ") if i % 3 == 0 else ()
        stop_ids = (rng.randrange(97, 123),) if i % 5 == 0 else ()
        out.append(
            GenRequest(
                f"r{i}",
                prompt,
                rng.randint(8, 40),
                method=methods[i % len(methods)],
                stop=stop,
                stop_token_ids=stop_ids,
            )
        )
    return out


def serve(engine: Engine, reqs: list[GenRequest], pipeline: bool, **opts) -> list[Outcome]:
    """Every request submitted before the loop starts: its first iteration takes them all, so
    that each run sees the same batches."""
    s = Scheduler(lambda: engine, TOK, SchedulerOptions(pipeline=pipeline, **opts), Env())
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


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    return Engine(tiny_dir, SERVICE)


@contextlib.contextmanager
def counting_plans(engine: Engine) -> Iterator[list[StepPlan]]:
    """Every step the engine's stream runs, as the plan it ran (a repeated plan's later
    steps as plans of one step continuing every sequence)."""
    plans: list[StepPlan] = []
    run = engine.run_plan

    def counted(plan: StepPlan):
        plans.append(plan)
        return run(plan)

    engine.run_plan = counted  # type: ignore[method-assign]
    try:
        yield plans
    finally:
        del engine.run_plan


@pytest.mark.parametrize(
    ("plan_steps", "methods"),
    [(1, METHODS), (2, METHODS), (4, (NONE, MTP))],
    ids=["a-step-per-plan", "two-steps-per-plan", "four-steps-without-prompt-lookup"],
)
def test_greedy_outputs_are_identical_with_and_without_the_pipeline(
    engine: Engine, plan_steps: int, methods: tuple[str, ...]
) -> None:
    """Nothing runs ahead beside prompt lookup's synchronous steps: plans repeat once the
    sequences left all continue."""
    reqs = requests(32, methods=methods)
    plain = serve(engine, reqs, pipeline=False)
    with counting_plans(engine) as plans:
        piped = serve(engine, reqs, pipeline=True, plan_steps=plan_steps)
    for r, a, b in zip(reqs, plain, piped, strict=True):
        assert (a.tokens, a.text, a.finish.reason) == (b.tokens, b.text, b.finish.reason), r
    assert {o.finish.reason for o in piped} == {"stop", "length"}, "stops fired"
    assert max(p.repeat for p in plans) == plan_steps
    assert engine.capabilities().free_slots == engine.capabilities().num_slots


def test_the_pipeline_ran_ahead(engine: Engine) -> None:
    """The plans went back to back: the engine's stream ran every greedy step, three to a
    plan once every sequence continued, fewer only where a sequence's room was short."""
    reqs = [GenRequest(f"p{i}", (65 + i, 66), 40, method=MTP) for i in range(4)]
    with counting_plans(engine) as plans:
        serve(engine, reqs, True, plan_steps=3)
    assert len(plans) >= 6 and any(all(p.continues) for p in plans)
    repeated = [p for p in plans if p.repeat > 1]
    assert repeated and all(p.repeat == 3 and all(p.continues) for p in repeated)


def test_grammars_mixed_in_keep_every_output(engine: Engine, tiny_dir: Path) -> None:
    caps = engine.capabilities()
    compiler = GrammarCompiler(TOK, caps.vocab_size, caps.eos_token_ids)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})

    def reqs() -> list[GenRequest]:
        out = requests(12, seed=3)
        for i in (1, 6):
            r = out[i]
            out[i] = GenRequest(
                r.request_id,
                r.prompt_ids,
                30,
                method=MTP,
                grammar=compiler.compile("json_schema", schema),
            )
        return out

    plain = serve(engine, reqs(), pipeline=False)
    piped = serve(engine, reqs(), pipeline=True)
    assert [o.tokens for o in plain] == [o.tokens for o in piped]


def test_a_seeded_sampled_request_repeats(engine: Engine) -> None:
    def reqs() -> list[GenRequest]:
        sampled = GenRequest(
            "s", (70, 71, 72), 24, method=MTP, sampling=SamplingParams(0.8, seed=5)
        )
        return [sampled, *requests(6, seed=4)]

    first, second = serve(engine, reqs(), True), serve(engine, reqs(), True)
    assert [o.tokens for o in first] == [o.tokens for o in second]


def test_cancellations_at_random_points_change_no_one_else(engine: Engine) -> None:
    """Every fourth request is cancelled after a random number of its tokens arrive: what it
    streamed is a prefix of its own uncancelled output, the others are unchanged, and every
    slot is free afterwards."""
    reqs = requests(16, seed=7)
    plain = serve(engine, reqs, pipeline=False)
    rng = random.Random(9)
    s = Scheduler(lambda: engine, TOK, SchedulerOptions(), Env())
    outs = [Outcome() for _ in reqs]
    cut = {i: rng.randint(1, 6) for i in range(0, 16, 4)}

    def sink(i: int):
        def on(ev) -> None:
            outs[i](ev)
            if i in cut and isinstance(ev, Delta) and len(outs[i].tokens) >= cut[i]:
                s.cancel(reqs[i].request_id)

        return on

    s.start()
    try:
        for i, r in enumerate(reqs):
            s.submit(r, sink(i))
        for o in outs:
            assert o.done.wait(120)
    finally:
        s.stop()
    for i, (a, b) in enumerate(zip(plain, outs, strict=True)):
        if i in cut:
            assert a.tokens[: len(b.tokens)] == b.tokens
        else:
            assert a.tokens == b.tokens
    assert engine.capabilities().free_slots == engine.capabilities().num_slots


@pytest.mark.parametrize("plan_steps", [1, 4])
def test_a_stop_string_found_one_step_late_streams_nothing_after_it(
    engine: Engine, plan_steps: int
) -> None:
    """The steps after the one that meets the stop string were already planned (one, or
    the rest of a plan of four and the plan after it); their tokens never reach the client."""
    reqs = [GenRequest(f"q{i}", (80 + i, 81, 82), 40, method=MTP, stop=("a",)) for i in range(4)]
    piped = serve(engine, reqs, True, plan_steps=plan_steps)
    for a, b in zip(serve(engine, reqs, False), piped, strict=True):
        assert (a.tokens, a.text) == (b.tokens, b.text)
        assert "a" not in b.text


def test_plans_continuing_a_freed_or_moved_sequence_refuse_it_alone(engine: Engine) -> None:
    a, b, c = (engine.alloc_sequence() for _ in range(3))
    first = engine.prefill([a, b, c], [[65, 66], [67, 68], [69, 70]]).argmax
    engine.decode_step(first, [1, 1, 1], [a, b, c], [True] * 3, 2)
    steps = engine.open_steps()
    try:
        engine.free_sequence(a)  # freed while its next plan is on its way
        engine.prefill([c], [[71]])  # moved on by another call: nothing to continue from
        steps.send(StepPlan([a, b, c], [True] * 3, [], [0, 0, 0], [True] * 3, 2, repeat=2))
        results = [steps.recv(), steps.recv()]
    finally:
        steps.close()
    for result in results:  # refused at each step of the plan, the other one ran on
        assert result.ran == [1]
        assert [(i, code) for i, code, _ in result.refused] == [
            (0, "NOT_FOUND"),
            (2, "FAILED_PRECONDITION"),
        ]
        assert "continue" in result.refused[1][2]
    assert results[1].rows[0] == results[0].step.argmax[results[0].step.accepted[0]]
    for h in (b, c):
        engine.free_sequence(h)


def test_a_sequence_cancelled_with_its_next_plan_in_flight_is_freed_after_it(
    engine: Engine,
) -> None:
    """Cancelled from another thread while the pipeline runs: its slot comes back only once
    the plan that still names it is read back, and nothing is refused."""
    s = Scheduler(lambda: engine, TOK, SchedulerOptions(), Env())
    frees: list[int] = []
    free = engine.free_sequence

    def recording(h) -> None:
        frees.append(h.seq_id)
        free(h)

    engine.free_sequence = recording  # type: ignore[method-assign]
    done = threading.Event()
    out = Outcome()

    def sink(ev) -> None:
        out(ev)
        if isinstance(ev, Delta) and len(out.tokens) >= 3 and not done.is_set():
            done.set()
            s.cancel("c")

    s.start()
    try:
        s.submit(GenRequest("c", (90, 91), 200, method=MTP, ignore_eos=True), sink)
        assert out.done.wait(120)
    finally:
        s.stop()
        del engine.free_sequence
    assert out.finish is not None and out.finish.reason == "cancelled" and out.failure is None
    assert len(frees) == 1
    assert engine.capabilities().free_slots == engine.capabilities().num_slots


def test_a_plan_is_cut_to_the_rows_it_gets_at_its_own_width() -> None:
    """Eight sequences get one draft each (16 rows); eight rows hold four of them, but four get
    three drafts from the ladder (16 rows again): the cut is taken again at that width."""
    from control_plane.scheduler.ahead import Pipeline
    from control_plane.scheduler.arms import step_width
    from control_plane.scheduler.context import StepContext
    from tests.control_plane.scheduler.test_step import seqs
    from tests.fake_model import FakeModel

    model = FakeModel(caps=(3,) * 8, max_rows=8)
    active = seqs(model, 8)
    ctx = StepContext.build(model.capabilities(), SchedulerOptions(k_ladder="4:3,8:1"))
    assert step_width(active, ctx, 3) == 1
    cut = Pipeline(lambda h: None, lambda w: None).fits(active, ctx, 3)
    assert len(cut) * (step_width(cut, ctx, 3) + 1) <= 8
    assert cut == active[:2], "two sequences of four rows each"


@pytest.fixture(scope="module")
def dflash_engine(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    drafter = write_drafter(tmp_path_factory.mktemp("dflash"), TINY, taps=(0, 3), scale=0.2)
    return Engine(tiny_dir, SERVICE, drafter=drafter)


def test_dflash_requests_run_ahead_beside_the_others(dflash_engine: Engine) -> None:
    """DFlash requests join the plans of none and mtp ones, each sequence named with its
    drafter, at a count a block gives; every output is the unpipelined step's."""
    reqs = requests(12, methods=(NONE, MTP, DFLASH))
    plain = serve(dflash_engine, reqs, pipeline=False)
    with counting_plans(dflash_engine) as plans:
        piped = serve(dflash_engine, reqs, pipeline=True, plan_steps=2)
    for r, a, b in zip(reqs, plain, piped, strict=True):
        assert (a.tokens, a.text, a.finish.reason) == (b.tokens, b.text, b.finish.reason), r
    mixed = [p for p in plans if {DFLASH, MTP} <= set(p.drafters)]
    assert mixed and all(len(p.drafters) == len(p.seqs) for p in plans)
    block = dflash_engine.capabilities().dflash_block
    assert all(p.num_drafts <= block - 1 for p in plans)
    assert dflash_engine.capabilities().free_slots == dflash_engine.capabilities().num_slots
