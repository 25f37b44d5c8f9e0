"""A grammar after the output's reasoning (`control_plane.text.reasoning`) under `step_mtp`, with
a fake model whose output the test scripts: while the model reasons, its sequence batches and
fuses beside an unconstrained one with no mask, its drafts cut before the close; from the
close on, its rows carry masks, batched beside its neighbour; a spent budget forces the close;
a block the model opens itself; under the MTP arms and the DFlash arm, and through the
scheduler's loop beside a pipelined request under each method and the server's choice."""

from __future__ import annotations

import json
from typing import Any

import pytest

from control_plane.scheduler.arms import step_mtp
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import ActiveSeq, GenRequest, ModelFacts
from control_plane.text.grammar import GrammarCompiler
from control_plane.text.reasoning import AFTER, MAY_OPEN, OPENED, AfterReasoning, Marks, marks_of
from control_plane.text.tokenizer import ByteTokenizer
from protos.params import AUTO, DFLASH, MTP, NONE
from tests.collect import run_all
from tests.control_plane.scheduler.test_step import ctx
from tests.fake_model import FakeModel

TOK = ByteTokenizer.default()
EOS = 257
OPEN = 300  # `<think>` as one token, in the vocabularies of the tests that need it
COMPILER = GrammarCompiler(TOK, 320, (EOS,))
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
)
# What each prompt's model writes (its prompt is one token: its key).
SCRIPTS = {
    1: b"hmm, let me see</think>\n\n" + b'{"a":12}',  # reasons, closes, writes the object
    2: b"x" * 40,  # never closes
    3: b"1234567890" * 4,  # no grammar: its neighbour
}


def oracle(history: tuple[int, ...]) -> int:
    script = SCRIPTS[history[0]]
    at = len(history) - 1
    if history[0] == 1 and at and history[1] == OPEN:  # it opened its block itself: one later
        at -= 1
    return script[at] if at < len(script) else EOS


def json_after(start: str = OPENED, budget: int | None = None, marks: Marks | None = None):
    inner = COMPILER.matcher(COMPILER.grammar("json_schema", SCHEMA, lead=True))
    return AfterReasoning(inner, marks or marks_of(COMPILER), start, budget)


def admitted(model: FakeModel, key: int, grammar: Any, method: str = MTP) -> ActiveSeq:
    req = GenRequest(str(key), (key,), 200, method=method, grammar=grammar)
    a = ActiveSeq(req, lambda ev: None, TOK, ModelFacts.of(model.capabilities()))
    a.handle = model.alloc_sequence()
    first = model.prefill([a.handle], [[key]], [a.row_mask([])]).argmax[0]
    a.last = None
    a.gain([first])
    return a


def masked_rows(model: FakeModel) -> list[int]:
    """Each verify call's masked row count, in order (a fused step's verify included)."""
    seen: list[int] = []
    verify = model.decode_verify_batched

    def spy(*args, masks=None, **kwargs):
        seen.append(len(masks or {}))
        return verify(*args, masks=masks, **kwargs)

    model.decode_verify_batched = spy  # type: ignore[method-assign]
    return seen


def run(model: FakeModel, active: list[ActiveSeq], **opts: Any) -> list[dict]:
    """Steps until every sequence finishes; each step's calls and the reasoner's phase."""
    steps = []
    context = ctx(model, **opts)
    while any(a.finished is None for a in active):
        live = [a for a in active if a.finished is None]
        phase = getattr(active[0].grammar, "state", None)
        model.calls.clear()
        report = step_mtp(model, live, context, 3)
        steps.append({"phase": phase and phase.phase, "calls": list(model.calls), "r": report})
    return steps


def fused(calls: list[tuple]) -> bool:
    """Whether every verify of a step's calls was a fused step's (one round trip)."""
    names = [c[0] for c in calls]
    return names.count("verify") == names.count("step") > 0


def text(a: ActiveSeq) -> bytes:
    return bytes(a.generated)


def test_reasoning_batches_and_fuses_then_the_object_is_masked() -> None:
    model = FakeModel(caps=(4,) * 4, oracle=oracle)
    masks = masked_rows(model)
    a, b = admitted(model, 1, json_after()), admitted(model, 3, None)
    steps = run(model, [a, b])
    assert text(a) == SCRIPTS[1] and a.finished == "stop"
    assert a.grammar is not None and a.grammar.is_done(), "the grammar ended it, not EOS"
    thinking = [s for s in steps if s["phase"] == "think"]
    assert thinking and all(fused(s["calls"]) for s in thinking), "fused steps while it reasons"
    assert any(s["r"].batched_calls for s in thinking), "batched beside its neighbour"
    assert a.stats.grammar_truncations >= 1, "its drafts cut before the close"
    assert any(masks), "the object's rows masked"
    assert isinstance(a.grammar, AfterReasoning) is False, "past the reasoning: the inner grammar"


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_a_spent_budget_forces_the_close(budget: int) -> None:
    model = FakeModel(caps=(4,) * 4, oracle=oracle)
    regex = COMPILER.matcher(COMPILER.grammar("regex", "yes|no", lead=True))
    a = admitted(model, 2, AfterReasoning(regex, marks_of(COMPILER), OPENED, budget))
    run(model, [a, admitted(model, 3, None)])
    # The model would write x forever: the close is forced after `budget` of them, then the
    # lowest ids the grammar allows (the fake's rule): the blank line, then "no".
    assert text(a) == b"x" * budget + b"</think>\n\nno" and a.finished == "stop"


def test_thinking_off_constrains_from_the_first_token() -> None:
    model = FakeModel(caps=(4,) * 4, oracle=oracle)
    a = admitted(model, 1, COMPILER.compile("json_schema", SCHEMA))
    run(model, [a])
    # The grammar holds at once: the fake's model writes reasoning, masked to the object.
    assert text(a).startswith(b'{"a":') and json.loads(text(a))["a"] == 0


def opening_marks() -> Marks:
    def bytes_of(ids: list[int]) -> bytes:
        return b"".join(b"<think>" if t == OPEN else bytes([t]) for t in ids)

    return Marks(tuple(b"</think>"), OPEN, bytes_of, 320)


def test_a_block_the_model_opens_itself() -> None:
    model = FakeModel(caps=(4,) * 4, oracle=oracle)
    first = oracle
    model.oracle = lambda h: OPEN if len(h) == 1 and h[0] == 1 else first(h)
    a = admitted(model, 1, json_after(MAY_OPEN, marks=opening_marks()))
    run(model, [a])
    assert a.generated[0] == OPEN and bytes(a.generated[1:]) == SCRIPTS[1]
    # One that does not open one writes the grammar's output from its first token: at the
    # start the mask allows the grammar's first tokens and `<think>`.
    grammar = json_after(MAY_OPEN, marks=opening_marks())
    bits = int.from_bytes(grammar.mask(), "little")
    assert bits >> OPEN & 1 and bits >> ord("{") & 1 and not bits >> ord("x") & 1
    grammar.advance(list(b"\n{"))
    assert grammar.state.phase == AFTER


def test_the_dflash_arm_batches_a_reasoning_sequence() -> None:
    model = FakeModel(caps=(8,) * 4, dflash_block=8, oracle=oracle)
    masks = masked_rows(model)
    a = admitted(model, 1, json_after(), DFLASH)
    b = admitted(model, 3, None, DFLASH)
    steps = run(model, [a, b])
    assert text(a) == SCRIPTS[1]
    thinking = [s for s in steps if s["phase"] == "think"]
    assert any(s["r"].batched_calls for s in thinking)
    assert masks[: len(thinking)] == [0] * len(thinking) and any(masks)


@pytest.mark.parametrize("method", [NONE, MTP, DFLASH, AUTO])
def test_through_the_loop_beside_a_pipelined_request(method: str) -> None:
    """Each method, and the server's choice (whatever it picks step by step), writes the
    scripted reasoning, then the object its grammar holds, beside a free request."""
    model = FakeModel(caps=(8,) * 4, dflash_block=8, oracle=oracle)
    s = Scheduler(lambda: model, TOK, SchedulerOptions(max_queue=4))
    s.start()
    try:
        reqs = [
            GenRequest("a", (1,), 60, method=method, grammar=json_after()),
            GenRequest("b", (2,), 30, method=method, grammar=json_after(budget=3)),
            GenRequest("c", (3,), 30, method=method),
        ]
        outs = run_all(s, reqs)
    finally:
        s.stop()
    assert bytes(outs[0].tokens) == SCRIPTS[1]
    forced = bytes(outs[1].tokens)
    assert forced.startswith(b"xxx</think>") and json.loads(forced.split(b"</think>")[1])
    assert bytes(outs[2].tokens) == SCRIPTS[3][:30]
