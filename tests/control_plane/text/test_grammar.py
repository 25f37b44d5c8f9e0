"""Grammars: the llguidance engine behind `Grammar`, the scheduler's serial path with draft
truncation and per-row masks, and JSON-schema requests end to end with `mtp` on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from opentelemetry.trace import INVALID_SPAN

from control_plane.admission import door as door_module
from control_plane.admission.door import BadRequest, Door
from control_plane.admission.work import Preparer
from control_plane.scheduler.arms import step_mtp
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.grammar import GrammarCompiler
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.met.v1 import generate_pb2 as pb
from protos.params import MTP, from_pb
from tests.collect import run_all
from tests.control_plane.scheduler.test_step import seqs
from tests.fake_model import FakeModel

TOK = ByteTokenizer.default()
COLOR = json.dumps(
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOK, 320, (257,))


def test_engine_masks_and_prefixes(compiler: GrammarCompiler) -> None:
    g = compiler.compile("regex", "ab[cd]")
    assert g.valid_prefix([97, 98, 101]) == 2
    bits = g.mask_after([97, 98])
    allowed = [t for t in range(320) if bits[t // 8] >> (t % 8) & 1]
    assert allowed == [99, 100]
    assert g.valid_prefix([97]) == 1, "mask_after leaves the state as it was"
    g.advance([97, 98, 99])
    assert g.is_done()


@pytest.mark.parametrize(
    ("kind", "spec"),
    [("json_schema", "{nope"), ("regex", "[a-"), ("json_schema", '{"type": 5}'), ("yaml", "x")],
)
def test_bad_grammars_are_refused(compiler: GrammarCompiler, kind: str, spec: str) -> None:
    with pytest.raises(ValueError, match=r"\w+ \w+"):
        compiler.compile(kind, spec)


def test_grammar_sequence_joins_the_batch_truncated_and_masked(compiler: GrammarCompiler) -> None:
    model = FakeModel()
    active = seqs(model, 3, drafts=[3, 3, 3])
    grammar = compiler.compile("regex", "[0-9a-z]+")
    # Sequence 1 generated 11 so far; its drafts (12, 13, 14) are not in [0-9a-z]: cut to 0.
    g = active[1]
    g.grammar = grammar
    step_mtp(model, active, StepContext.build(model.capabilities(), SchedulerOptions()), 3)
    calls = model.verify_calls()
    assert [c[1] for c in calls] == [[4, 4, 1]], "one batch, the grammar's sequence at its depth"
    assert g.stats.grammar_truncations == 1
    assert 48 <= g.generated[-1] <= 122, "the bonus token obeys the grammar's mask"


def _color_requests(n: int) -> list[GenRequest]:
    out = []
    for i in range(n):
        req = GenRequest(f"c{i}", tuple(TOK.encode(f"color {i}: ")), 40, method=MTP)
        out.append(req)
    return out


def test_json_schema_requests_with_mtp(tiny_dir: Path, compiler: GrammarCompiler) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3,8:2", max_context=256))
    s = Scheduler(lambda: engine, TOK, SchedulerOptions(), Env())
    s.start()
    try:
        reqs = [
            GenRequest(
                r.request_id,
                r.prompt_ids,
                r.max_new_tokens,
                method=MTP,
                grammar=compiler.compile("json_schema", COLOR),
            )
            for r in _color_requests(4)
        ]
        outs = run_all(s, reqs)
    finally:
        s.stop()
    for o in outs:
        value = json.loads(o.text)
        assert value["color"] in ("red", "green") and set(value) == {"color"}
        assert o.finish.reason == "stop"
    assert sum(o.finish.stats.grammar_truncations for o in outs) > 0


def test_json_schema_over_the_api(stub) -> None:
    request = pb.GenerateRequest(
        prompt="pick: ", max_new_tokens=40, response_format=pb.ResponseFormat(json_schema=COLOR)
    )
    text, last = "", None
    for msg in stub.Generate(request, timeout=120):
        text += msg.text
        last = msg
    assert json.loads(text)["color"] in ("red", "green")
    assert last.finish_reason == "stop"
    assert last.speculative_stats.grammar_truncations > 0, "random drafts fall to the grammar"
    bad = pb.GenerateRequest(prompt="x", response_format=pb.ResponseFormat(regex="[a-"))
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(bad, timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format" in caught.value.details()


def test_grammar_that_keeps_every_draft(compiler: GrammarCompiler) -> None:
    model = FakeModel()
    (a,) = seqs(model, 1, drafts=[3])
    a.grammar = compiler.compile("regex", "(.|\\n)*")  # any text: the drafts all stand
    step_mtp(model, [a], StepContext.build(model.capabilities(), SchedulerOptions()), 3)
    assert a.stats.grammar_truncations == 0 and a.stats.drafted == 3


class Submitted:
    """The part of a scheduler the door uses; a request is kept instead of scheduled."""

    def __init__(self) -> None:
        self.model, self.tokenizer, self.got = FakeModel(), TOK, []

    def capabilities(self):
        return self.model.capabilities()

    def submit(self, req: GenRequest, sink, on_queued, tokenizer=None) -> None:
        self.got.append(req)


def convert(door: Door, request: pb.GenerateRequest) -> GenRequest:
    asyncio.run(door.enter(from_pb(request), "k", INVALID_SPAN))
    return door.scheduler.got[-1]  # type: ignore[attr-defined]


def test_requests_without_a_grammar_never_build_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the grammar engine was built")

    monkeypatch.setattr(door_module, "GrammarCompiler", refuse)
    door = Door(Submitted())  # type: ignore[arg-type]
    req = convert(door, pb.GenerateRequest(prompt="hi", max_new_tokens=4))
    assert req.grammar is None and door._compiler is None


def test_a_grammar_that_does_not_compile_fails_its_request_alone() -> None:
    door = Door(Submitted())  # type: ignore[arg-type]
    bad = pb.GenerateRequest(prompt="x", response_format=pb.ResponseFormat(regex="[a-"))
    with pytest.raises(BadRequest) as caught:
        convert(door, bad)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    good = pb.GenerateRequest(prompt="x", response_format=pb.ResponseFormat(regex="[ab]+"))
    assert convert(door, good).grammar is not None
    assert convert(door, pb.GenerateRequest(prompt="x")).grammar is None


def test_a_model_without_eos_refuses_grammars_with_a_sentence() -> None:
    """llguidance needs an EOS to end a grammar's output; a model that names none gets a
    refusal that says so, never the library's error as a 500."""
    with pytest.raises(ValueError, match="names no EOS token"):
        GrammarCompiler(TOK, 320, ())
    preparer = Preparer(TOK, None, lambda: GrammarCompiler(TOK, 320, ()))
    caps = FakeModel().capabilities()
    request = from_pb(pb.GenerateRequest(prompt="x", response_format=pb.ResponseFormat(regex="a")))
    with pytest.raises(BadRequest) as caught:
        preparer.prepare(request, caps, 1 << 20)
    assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert caught.value.param == "response_format" and "names no EOS token" in str(caught.value)
