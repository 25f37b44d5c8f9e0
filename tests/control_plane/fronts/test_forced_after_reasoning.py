"""Forced output after reasoning, on a Qwen3.5 checkpoint written by transformers with Qwen3.6's
chat template (thinking on by default: the prompt opens `<think>`), through both fronts in
process: a required or named tool's call and a response format arrive whole after the
reasoning, which comes apart (`reasoning_content`); with a budget of N the close is forced
after N tokens, so the call follows within N + the close + its own tokens, alike under `none`,
`mtp` and `dflash`; with thinking off (per request, or the server's default variables) the
grammar holds from the first token. A random model never closes its block itself, so every
close here is the budget's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest

from control_plane.admission.door import Admission, ChatShape, admit
from control_plane.scheduler.seq import GenRequest
from control_plane.text.chat import TEMPLATE_FILE, ChatTemplate
from control_plane.text.grammar import GrammarCompiler
from control_plane.text.reasoning import THINK, AfterReasoning
from control_plane.text.tokenizer import Tokenization
from control_plane.text.tools import ChatOutput, merge
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ModelConfig, ServiceConfig
from protos.met.v1 import generate_pb2 as pb
from protos.params import DFLASH, MTP, NONE, ChatMessage, RequestParams
from tests.control_plane.fronts.test_openai_http import KEY, Fronts, serving
from tests.gpu_service.dflash.drafter import write_drafter
from tests.qwen3_5_checkpoint import make

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Bergen"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}},
]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
BUDGET = 6
OFF = {"enable_thinking": False}
QWEN3_6 = Path(__file__).parents[2] / "fixtures/qwen3.6/chat_template.jinja"
METHODS = {NONE: pb.SPECULATIVE_METHOD_NONE, MTP: pb.SPECULATIVE_METHOD_MTP}
METHODS[DFLASH] = pb.SPECULATIVE_METHOD_DFLASH


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    warm: bool


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3.6") / "model"
    directory.mkdir()
    make(directory, "dense")
    shutil.copy(QWEN3_6, directory / TEMPLATE_FILE)
    return directory


@pytest.fixture(scope="module")
def fronts(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fronts]:
    target = ModelConfig.load(checkpoint)
    drafter = write_drafter(tmp_path_factory.mktemp("dflash"), target, taps=(0, 3))
    svc = ServiceConfig(verify_tiers="2:3", max_context=2048)
    with serving(Engine(checkpoint, svc, drafter=drafter), 4) as f:
        yield f


def close_ids(checkpoint: Path) -> list[int]:
    return Tokenization.from_dir(checkpoint).tokenizer.encode("</think>")


def generate(f: Fronts, drafted: list[int] | None = None, **fields) -> list[int]:
    """The ids a gRPC Generate streams (and its drafts' count onto `drafted`)."""
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in ASK],
        tools=json.dumps(TOOLS),
        **{"max_new_tokens": 300, **fields},
    )
    ids: list[int] = []
    for reply in f.stub.Generate(request, metadata=[("authorization", f"Bearer {KEY}")]):
        ids += reply.token_ids
        if reply.HasField("speculative_stats") and drafted is not None:
            drafted.append(reply.speculative_stats.drafted)
    return ids


def test_a_required_call_follows_the_budget_under_every_method(
    fronts: Fronts, checkpoint: Path
) -> None:
    """The close is forced at token N, the call follows it and nothing else; greedy, every
    method gives the same tokens."""
    tokenization = Tokenization.from_dir(checkpoint)
    close = close_ids(checkpoint)
    runs, drafted = {}, {}
    for name, code in METHODS.items():
        drafted[name] = []
        runs[name] = generate(
            fronts,
            drafted[name],
            tool_choice="required",
            thinking_token_budget=BUDGET,
            speculative_method=code,
        )
    ids = runs[NONE]
    assert runs[MTP] == ids and runs[DFLASH] == ids
    assert drafted[MTP][-1] > 0 and drafted[DFLASH][-1] > 0, drafted
    assert ids[BUDGET : BUDGET + len(close)] == close
    text = tokenization.tokenizer.decode(ids)
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    out = ChatOutput(tools, reasoning=True, opened=True)
    message = merge(out.push(text) + out.close())
    assert message["content"] is None and len(message["tool_calls"]) == 1
    assert message["reasoning_content"] == tokenization.tokenizer.decode(ids[:BUDGET]).rstrip()


def test_the_openai_sdk_gets_the_call_and_the_reasoning_apart(fronts: Fronts) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        done = fronts.client.chat.completions.create(
            model="",
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=200,
            temperature=0,
            extra_body={"thinking_token_budget": BUDGET},
        )
        choice_ = done.choices[0]
        assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
        assert choice_.message.model_extra["reasoning_content"]
        (call,) = choice_.message.tool_calls or []
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_parse_gets_the_object_and_the_reasoning_apart(fronts: Fronts) -> None:
    done = fronts.client.chat.completions.parse(
        model="",
        messages=ASK,
        response_format=Forecast,
        max_tokens=200,
        temperature=0,
        extra_body={"thinking_token_budget": BUDGET},
    )
    message = done.choices[0].message
    assert isinstance(message.parsed, Forecast), message.content
    assert message.model_extra["reasoning_content"]


def test_thinking_off_constrains_from_the_first_token(fronts: Fronts, checkpoint: Path) -> None:
    ids = generate(
        fronts, tool_choice="required", chat_template_kwargs=json.dumps(OFF), max_new_tokens=200
    )
    text = Tokenization.from_dir(checkpoint).tokenizer.decode(ids)
    assert text.startswith("<tool_call>\n<function=") and "</think>" not in text


def test_a_budget_alone_closes_the_block(fronts: Fronts, checkpoint: Path) -> None:
    """No forced output: the budget still closes the block; what follows is free."""
    close = close_ids(checkpoint)
    ids = generate(fronts, thinking_token_budget=3, max_new_tokens=20, ignore_eos=True)
    assert ids[3 : 3 + len(close)] == close


def test_refused_budgets(fronts: Fronts) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        fronts.client.chat.completions.create(
            model="", messages=ASK, max_tokens=4, extra_body={"thinking_token_budget": -1}
        )
    assert caught.value.body["param"] == "thinking_token_budget"


# -- admission, in this thread ---------------------------------------------------------------


def admitted(checkpoint: Path, admission: Admission, **fields) -> tuple[GenRequest, ChatShape]:
    """The request, its shape and its grammar, as the door admits them."""
    tokenization = Tokenization.from_dir(checkpoint)
    chat = ChatTemplate.from_files(tokenization.files)
    engine = Engine(checkpoint, ServiceConfig(verify_tiers="2:3", max_context=2048))
    caps = engine.capabilities()
    compiler = GrammarCompiler(tokenization.tokenizer, caps.vocab_size, caps.eos_token_ids)
    r = RequestParams(
        messages=tuple(ChatMessage(m["role"], m["content"]) for m in ASK),
        tools=json.dumps(TOOLS),
        **fields,
    )
    return admit(r, tokenization.tokenizer, caps, admission, "r", compiler, chat)


def test_the_servers_default_variables_and_a_requests_own(checkpoint: Path) -> None:
    """`--default-chat-template-kwargs {"enable_thinking": false}`: the grammar holds at once;
    a request's own `enable_thinking: true` wins, and its output reasons first; the default
    budget keeps half of max_tokens for the output."""
    off = Admission(chat_kwargs=OFF)
    req, shape = admitted(checkpoint, off, tool_choice="required", max_new_tokens=100)
    assert not shape.opened and not isinstance(req.grammar, AfterReasoning)
    on = '{"enable_thinking": true}'
    req, shape = admitted(
        checkpoint, off, tool_choice="required", chat_template_kwargs=on, max_new_tokens=100
    )
    assert shape.opened and isinstance(req.grammar, AfterReasoning)
    assert req.grammar.budget == 50 and req.grammar.state.phase == THINK
