"""Tools through the official `openai` client: the bundled model's template renders them,
`required` and a named tool give calls that parse and fit their schemas (sampled, streamed and
whole), a tool's result goes back in, and `auto` parses a call the model writes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from control_plane.fronts.openai_body import chat_request
from control_plane.fronts.openai_fields import InvalidParam
from control_plane.fronts.openai_formats import regex_literal
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from tests.control_plane.fronts.test_openai_http import Fronts, serving

# Every value bounded, so that a call the grammar writes always ends within its budget.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def wide(tiny_dir: Path) -> Iterator[Fronts]:
    """Both fronts on an in-process engine of eight slots, a queue of 128."""
    with serving(Engine(tiny_dir, ServiceConfig(verify_tiers="8:3", max_context=2048)), 128) as f:
        yield f


def check_call(call: object) -> str:
    """A call's tool name, once its arguments parse and fit that tool's schema."""
    fn = call.function  # type: ignore[attr-defined]
    jsonschema.validate(json.loads(fn.arguments), SCHEMAS[fn.name])
    return fn.name


def test_required_gives_calls_that_parse_sampled(wide: Fronts) -> None:
    """100 sampled choices under `required`, one call each: every one parses, fits its
    schema, and ends the choice with finish_reason tool_calls. (Without drafts: with them, a
    grammar's rows are verified one sequence at a time, seven times slower here.)"""
    done = wide.client.chat.completions.create(
        model="",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=7,
        n=100,
        max_tokens=120,
        extra_body={"speculative": {"method": "none"}},
    )
    names = set()
    for choice in done.choices:
        (call,) = choice.message.tool_calls or []
        names.add(check_call(call))
        assert choice.finish_reason == "tool_calls" and call.id.startswith("call_")
    assert names == {"get_weather", "get_time"}, "one tool never drawn in 100"


def test_a_named_tool_streamed_is_the_whole_call(wide: Fronts) -> None:
    fields = dict(
        model="",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0.8,
        seed=3,
        max_tokens=120,
    )
    whole = wide.client.chat.completions.create(**fields)
    calls = whole.choices[0].message.tool_calls or []
    assert calls and all(check_call(c) == "get_weather" for c in calls)
    chunks = list(wide.client.chat.completions.create(**fields, stream=True))
    streamed: dict[int, dict] = {}
    pieces: dict[int, int] = {}
    for chunk in chunks:
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if delta_call.index not in streamed:  # a call opens with its id and name
                assert delta_call.id and delta_call.function.name
            got = streamed.setdefault(delta_call.index, {"name": "", "arguments": ""})
            got["name"] += delta_call.function.name or ""
            got["arguments"] += delta_call.function.arguments or ""
            pieces[delta_call.index] = pieces.get(delta_call.index, 0) + 1
    # As vLLM streams them, the arguments piece by piece as they are generated, rebuilt as
    # OpenAI's docs rebuild them.
    assert [streamed[i] for i in sorted(streamed)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in calls
    ]
    assert all(n > 3 for n in pieces.values()), pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_result_goes_back_in(wide: Fronts) -> None:
    """The assistant's call and the tool's answer, as the SDK sends them back: rendered, so
    the prompt grows by them."""
    first = wide.client.chat.completions.create(
        model="",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    follow = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = wide.client.chat.completions.create(
        model="", messages=follow, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert first.usage is not None and second.usage is not None
    grown = second.usage.prompt_tokens - first.usage.prompt_tokens
    assert grown >= len(call.function.arguments) + len("sunny, 21 C")


def test_auto_parses_the_call_the_model_writes(wide: Fronts) -> None:
    """Under `auto` the model's own text decides; a regex (vLLM's structured outputs) makes it
    write a call after some words, which come back as content beside the parsed call."""
    call = '{"name": "get_time", "arguments": {"zone": "CET"}}'
    regex = regex_literal(f"Let me see.\n<tool_call>\n{call}\n</tool_call>")
    for stream in (False, True):
        body = dict(
            model="",
            messages=ASK,
            tools=TOOLS,
            max_tokens=120,
            extra_body={"structured_outputs": {"regex": regex}},
        )
        if not stream:
            done = wide.client.chat.completions.create(**body)
            message = done.choices[0].message
            assert message.content == "Let me see."
            (got,) = message.tool_calls or []
            assert (got.function.name, json.loads(got.function.arguments)) == (
                "get_time",
                {"zone": "CET"},
            )
            continue
        content, arguments = "", ""
        for chunk in wide.client.chat.completions.create(**body, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                arguments += "".join(t.function.arguments or "" for t in c.delta.tool_calls or [])
        assert content == "Let me see." and json.loads(arguments) == {"zone": "CET"}


def test_tool_choice_none_renders_tools_and_parses_nothing(wide: Fronts) -> None:
    done = wide.client.chat.completions.create(
        model="", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=6, temperature=0
    )
    plain = wide.client.chat.completions.create(model="", messages=ASK, max_tokens=6, temperature=0)
    assert done.choices[0].message.tool_calls is None
    assert done.usage is not None and plain.usage is not None
    assert done.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools were rendered


BAD_TOOLS = {
    "unknown-name": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice names 'nope', not one of the request's tools (get_time, get_weather)",
    ),
    "required-without-tools": (
        {"tool_choice": "required"},
        'tool_choice is "required"; the request has no tools',
    ),
    "not-a-function": (
        {"tools": [{"type": "retrieval"}]},
        "tools[0] must be {type: function, function: {name, ...}}",
    ),
}


@pytest.mark.parametrize(("fields", "sentence"), BAD_TOOLS.values(), ids=BAD_TOOLS.keys())
def test_bad_tools_are_refused_with_a_sentence(wide: Fronts, fields: dict, sentence: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        wide.client.chat.completions.create(model="", messages=ASK, max_tokens=4, **fields)
    assert caught.value.body["message"] == sentence


def test_tools_nested_past_the_encoder_are_a_400_naming_them() -> None:
    """A body's value can nest near the JSON parser's bound and past the encoder's once
    wrapped (OpenAI's `functions` become `tools`): refused naming the field, never a 500."""
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "functions": [{"name": "f", "parameters": deep}],
    }
    with pytest.raises(InvalidParam) as caught:
        chat_request(body)
    assert caught.value.param == "tools" and str(caught.value) == "tools nests too deep"
