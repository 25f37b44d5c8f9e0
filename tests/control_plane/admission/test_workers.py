"""Admission work a request chooses the cost of (its own template, its tools' schemas, its
grammar) runs in worker processes under a deadline and a memory bound: each hostile request of
issue 60 is refused with INVALID_ARGUMENT and a sentence naming the part, within the bound plus
a second, while a canary request beside it is never held past a second, and the next chat is
served by a fresh worker."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from control_plane.admission.door import Admission
from control_plane.admission.workers import AdmissionBounds
from control_plane.scheduler.scheduler import Scheduler
from control_plane.text.chat import MAX_TEMPLATE_BYTES
from control_plane.text.grammar import MAX_GRAMMAR_BYTES
from control_plane.text.tools import MAX_SCHEMA_DEPTH
from gpu_service.engine.facade import Engine
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import TINY_SERVICE
from tests.servers import serving

TIMEOUT_S = 1.0  # the admission deadline these tests run under
MEMORY_MB = 64
USER = [pb.ChatMessage(role="user", content="hi")]
CANARY = pb.GenerateRequest(prompt_token_ids=[3, 4, 5], max_new_tokens=2, ignore_eos=True)
# Two nested loops of the sandbox's longest range: about 10^10 steps, no output.
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
PLAIN_TEMPLATE = "{{ messages[0].content }}"
# About 170 MB of lists held at once, past MEMORY_MB.
HOARD = (
    "{% set ns = namespace(kept=[]) %}{% for i in range(60) %}"
    "{% set ns.kept = ns.kept + [range(100000)|list] %}{% endfor %}{{ ns.kept|length }}"
)


@dataclass
class Api:
    stub: pb_grpc.GenerationServiceStub


@pytest.fixture(scope="module")
def api(tiny_dir: Path) -> Iterator[Api]:
    """The generation API over an in-process engine whose tokenizer files reach the workers."""
    engine = Engine(tiny_dir, TINY_SERVICE)
    admission = Admission(bounds=AdmissionBounds(TIMEOUT_S, MEMORY_MB, workers=2))
    with (
        serving(Scheduler(lambda: engine), admission=admission) as target,
        grpc.insecure_channel(target) as channel,
    ):
        yield Api(pb_grpc.GenerationServiceStub(channel))


def chat(**fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=USER, max_new_tokens=2, **fields)  # type: ignore[arg-type]


def nested(levels: int, via: str = "properties") -> str:
    """A tool parameter schema nested `levels` deep through `properties` or `items`, as text
    (too deep for `json.dumps` to write)."""
    opening = '{"type":"object","properties":{"a":' if via == "properties" else '{"items":'
    closing = "}}" if via == "properties" else "}"
    return opening * levels + '{"type":"string"}' + closing * levels


def tools(parameters: str) -> str:
    return '[{"type":"function","function":{"name":"f","parameters":' + parameters + "}}]"


@dataclass
class Probe:
    code: grpc.StatusCode | None
    details: str
    seconds: float
    canary_worst: float


def probe(stub: pb_grpc.GenerationServiceStub, request: pb.GenerateRequest) -> Probe:
    """The request's outcome and time, with a canary generation sent every tenth of a second
    beside it; the canary's worst latency."""
    done, worst = threading.Event(), [0.0]

    def canaries() -> None:
        while not done.is_set():
            start = time.monotonic()
            list(stub.Generate(CANARY, timeout=30))
            worst[0] = max(worst[0], time.monotonic() - start)
            done.wait(0.1)

    thread = threading.Thread(target=canaries)
    thread.start()
    start = time.monotonic()
    try:
        list(stub.Generate(request, timeout=60))
        code, details = None, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    seconds = time.monotonic() - start
    done.set()
    thread.join()
    return Probe(code, details, seconds, worst[0])


HOSTILE = {
    "template-loops": (
        chat(chat_template=LOOPS),
        f"rendering the chat template took longer than {TIMEOUT_S:g} s, this server's bound",
    ),
    "template-memory": (
        chat(chat_template=HOARD),
        f"rendering the chat template needed more than {MEMORY_MB} MiB",
    ),
    "template-repeat": (
        chat(chat_template='{{ "a" * 200000000 }}'),
        "a chat template may not repeat text past",
    ),
    "template-deep": (
        chat(chat_template="{% if 1 %}" * 3000 + "x" + "{% endif %}" * 3000),
        "chat_template: the chat template nests too deep to compile",
    ),
    "template-huge": (
        chat(chat_template="{# #}" * (MAX_TEMPLATE_BYTES // 5 + 1)),
        f"this server takes at most {MAX_TEMPLATE_BYTES}",
    ),
    "schema-40-deep-properties": (
        chat(tools=tools(nested(40)), tool_choice="required"),
        f"tools[0].function.parameters nests 81 levels deep; this server takes at most "
        f"{MAX_SCHEMA_DEPTH}",
    ),
    "schema-600-deep-items": (
        chat(tools=tools(nested(600, "items")), tool_choice="required"),
        "tools[0].function.parameters nests 601 levels deep",
    ),
    "lark-120000": (
        pb.GenerateRequest(
            prompt="x",
            max_new_tokens=2,
            response_format=pb.ResponseFormat(
                lark="start: " + " | ".join(f'"w{i}"' for i in range(120_000))
            ),
        ),
        f"this server takes at most {MAX_GRAMMAR_BYTES}",
    ),
}


@pytest.mark.parametrize(("request_", "sentence"), HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_admission_work_is_refused_within_its_bound_beside_a_canary(
    api: Api, request_: pb.GenerateRequest, sentence: str
) -> None:
    got = probe(api.stub, request_)
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT, got
    assert sentence in got.details
    assert "backtrace" not in got.details and len(got.details) < 400
    assert got.seconds < TIMEOUT_S + 1.0
    assert got.canary_worst < 1.0
    # The worker it killed or held is replaced: the next chat is served.
    assert list(api.stub.Generate(chat(), timeout=30))


def test_a_schema_within_the_depth_closes_at_once(api: Api) -> None:
    """17 and 21 levels through `properties` took 0.46 s and 4.59 s when every level was
    walked twice; now each node is visited once."""
    for levels in (17, 21, 31):
        # A template that leaves the tools out of the prompt, which the tiny context would not
        # hold: the call grammar is still built from them.
        request = chat(
            tools=tools(nested(levels)), tool_choice="required", chat_template=PLAIN_TEMPLATE
        )
        got = probe(api.stub, request)
        assert got.code is None, got
        assert got.seconds < 1.0 + TIMEOUT_S


def test_grammars_are_built_whole_at_admission(api: Api) -> None:
    """An `anyOf` of 3,000 builds at once; a regex whose lexer needs more than the worker's
    memory is refused at admission, before any prefill (under 1 GiB it builds)."""
    schema = {"anyOf": [{"const": f"k{i}"} for i in range(3_000)]}
    wide = pb.ResponseFormat(json_schema=json.dumps(schema))
    got = probe(api.stub, pb.GenerateRequest(prompt="x", max_new_tokens=2, response_format=wide))
    assert got.code is None and got.seconds < TIMEOUT_S + 1.0, got
    regex = pb.ResponseFormat(regex="(a{1000}){1000}")
    got = probe(api.stub, pb.GenerateRequest(prompt="x", max_new_tokens=2, response_format=regex))
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT, got
    assert got.details.startswith("building the response_format's grammar ended its worker")
    assert f"{MEMORY_MB} MiB" in got.details
    assert got.seconds < TIMEOUT_S + 1.0 and got.canary_worst < 1.0
