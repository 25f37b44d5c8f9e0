"""`POST /v1/responses` through the official `openai` client and openai-agents on a real socket:
text, a forced function call, `text.format` json_schema and `.parse()`, reasoning items, input
items (calls, their outputs, reasoning) rendered as the chat's messages, the typed stream with
its sequence numbers and a call's arguments in pieces that join to the whole; every field not
served refused by name, and malformed bodies a 400, never a 500.

The bundled model writes random text: calls are forced with `tool_choice` "required" and the
shapes are checked, not the words."""

from __future__ import annotations

import asyncio
import json
import math
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx2
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from control_plane.fronts.openai_responses_reply import Items
from control_plane.text.chat import TEMPLATE_FILE
from control_plane.text.tools import ChatOutput
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from tests.control_plane.fronts.test_forced_after_reasoning import QWEN3_6
from tests.control_plane.fronts.test_openai_http import COLOR, KEY, Fronts, serving
from tests.control_plane.fronts.test_openai_tools import SCHEMAS, TIME, WEATHER
from tests.qwen3_5_checkpoint import make

TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "description": "The time.", "parameters": TIME},
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
]
ASK = "Weather in Paris?"
FORCED = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
# A connection a request: on a kept one, a small POST waits out the peer's delayed ACK (40 ms).
HEADERS = {
    "authorization": f"Bearer {KEY}",
    "content-type": "application/json",
    "connection": "close",
}
# The bundled template with a reasoning block the prompt opens, as Qwen3.6's with thinking on.
THINKING = (
    "{% for message in messages %}<|{{ message.role }}|>\n"
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n"
    "{% endif %}{{ message.content }}\n{% endfor %}<|assistant|>\n<think>\n"
)


@pytest.fixture(scope="module")
def fronts(tiny_dir: Path) -> Iterator[Fronts]:
    """Both fronts on an in-process engine of four slots, a queue of 16."""
    with serving(Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=2048)), 16) as f:
        yield f


def post(fronts: Fronts, body: Any) -> httpx2.Response:
    with httpx2.Client(headers=HEADERS, timeout=60) as http:
        return http.post(f"{fronts.http}/responses", content=json.dumps(body))


def check_call(item: Any) -> str:
    """A function call item's tool, once its arguments fit that tool's schema."""
    assert item.type == "function_call" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])
    return item.name


def test_text_comes_as_a_message_with_its_usage(fronts: Fronts) -> None:
    done = fronts.client.responses.create(
        model="", input="Hello", instructions="Be brief.", max_output_tokens=6, temperature=0
    )
    assert done.object == "response" and done.id.startswith("resp_")
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    (message,) = done.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "incomplete" and done.output_text == message.content[0].text
    usage = done.usage
    assert usage.output_tokens == 6 and usage.total_tokens == usage.input_tokens + 6
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert done.instructions == "Be brief." and done.max_output_tokens == 6


def test_input_items_render_as_the_chats_messages(fronts: Fronts) -> None:
    """Instructions, a developer message, an assistant's reasoning, text and two calls, their
    outputs: the prompt is the chat's with the same messages, token for token, and the
    endpoint's own count (`input_tokens.count`) says so."""
    items = [
        {"role": "developer", "content": "Answer with tools."},
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [
            {"type": "reasoning_text", "text": "Two calls."}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Looking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris", "days": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "noon"}]},
    ]  # fmt: skip
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer with tools."},
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": "Looking.",
            "reasoning_content": "Two calls.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}},
                {"id": "c2", "type": "function", "function": {
                    "name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "Sunny", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "tool", "content": "noon", "tool_call_id": "c2", "name": "get_time"},
    ]  # fmt: skip
    done = fronts.client.responses.create(
        model="", input=items, instructions="Be brief.", tools=TOOLS, max_output_tokens=1
    )
    with httpx2.Client(headers=HEADERS, timeout=60) as http:
        chat = {"messages": messages, "tools": CHAT_TOOLS, "add_generation_prompt": True}
        counted = http.post(f"{fronts.http[:-3]}/tokenize", json=chat).json()["count"]
    assert done.usage.input_tokens == counted
    count = fronts.client.responses.input_tokens.count(
        model="", input=items, instructions="Be brief.", tools=TOOLS
    )
    assert count.object == "response.input_tokens" and count.input_tokens == counted


def test_a_required_call_is_a_function_call_item(fronts: Fronts) -> None:
    done = fronts.client.responses.create(model="", input=ASK, max_output_tokens=120, **FORCED)
    (call,) = done.output
    assert check_call(call) in SCHEMAS and done.status == "completed"
    named = fronts.client.responses.create(
        model="",
        input=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False,
        max_output_tokens=120,
    )
    assert {check_call(c) for c in named.output} == {"get_time"}
    assert named.tool_choice.name == "get_time" and [t.name for t in named.tools] == [
        "get_weather",
        "get_time",
    ]


class Color(BaseModel):
    color: Literal["red", "green"]


def test_json_schema_text_format_and_parse(fronts: Fronts) -> None:
    form = {"type": "json_schema", "name": "color", "schema": COLOR, "strict": True}
    done = fronts.client.responses.create(
        model="", input="A color?", text={"format": form}, max_output_tokens=40
    )
    jsonschema.validate(json.loads(done.output_text), COLOR)
    assert done.text.format.type == "json_schema"
    parsed = fronts.client.responses.parse(
        model="", input="A color?", text_format=Color, max_output_tokens=40
    )
    assert isinstance(parsed.output_parsed, Color)


def events_of(stream: Any) -> list[Any]:
    """A stream's events, numbered 0, 1, ... in order, opened and closed as OpenAI's are."""
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    return events


def test_a_streamed_call_comes_in_pieces_that_join_to_its_arguments(fronts: Fronts) -> None:
    stream = fronts.client.responses.create(
        model="", input=ASK, max_output_tokens=120, stream=True, **FORCED
    )
    events = events_of(stream)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds[2] == "response.output_item.added" and events[2].item.arguments == ""
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds[3:-3] == ["response.function_call_arguments.delta"] * len(deltas)
    assert len(deltas) > 3, "the arguments came whole, not as they were generated"
    done, item, completed = events[-3].arguments, events[-2].item, events[-1].response
    assert "".join(deltas) == done == item.arguments == completed.output[0].arguments
    assert check_call(item) == events[2].item.name and item.call_id == events[2].item.call_id
    assert completed.usage.output_tokens > 0


def test_streamed_text_is_the_whole_response(fronts: Fronts) -> None:
    """Greedy: the same text whole and in deltas, its part opened and closed around them; the
    SDK's own stream helper rebuilds a response from the events (a call, which completes)."""
    fields: dict[str, Any] = dict(model="", input="Hello", temperature=0, max_output_tokens=12)
    whole = fronts.client.responses.create(**fields)
    events = events_of(fronts.client.responses.create(**fields, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == whole.output_text == events[-1].response.output_text
    forced = {**fields, **FORCED, "input": ASK, "max_output_tokens": 120}
    with fronts.client.responses.stream(**forced) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed" and check_call(final.output[0])


def test_reasoning_comes_as_a_reasoning_item(fronts: Fronts) -> None:
    """A template that opens `<think>`: what the model writes before `</think>` (all of it,
    here) is a reasoning item's text, counted as reasoning tokens; streamed the same."""
    fields: dict[str, Any] = dict(model="", input="Hi", temperature=0, max_output_tokens=10)
    fields["extra_body"] = {"chat_template": THINKING}
    done = fronts.client.responses.create(**fields)
    (item,) = done.output
    assert item.type == "reasoning" and item.summary == [] and item.content[0].text
    assert done.usage.output_tokens_details.reasoning_tokens == 10
    events = events_of(fronts.client.responses.create(**fields, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == item.content[0].text == events[-2].item.content[0].text
    turns = [
        {"role": "user", "content": "Hi"},
        item.model_dump(),
        {"role": "user", "content": "More"},
    ]
    again = fronts.client.responses.create(**{**fields, "input": turns})
    assert again.usage.input_tokens > done.usage.input_tokens


def split(text: str, cuts: list[int], parallel: bool = True) -> tuple[list[dict], list[dict]]:
    """`text` through `Items` in pieces cut at `cuts`: -> (the items, the events)."""
    items = Items(ChatOutput(SCHEMAS, True, opened=True, parallel=parallel))
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += items.push(text[a:b], 1)
    return items.items, events + items.close("completed")


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]


def test_items_are_the_same_however_the_text_is_cut() -> None:
    """Reasoning, text, a call, text again: the same items from any cut, each added, told and
    done once in order, a call's pieces joining to its arguments."""
    text = (
        'Hmm.</think>\n\nSure. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
        "\n</tool_call>\nDone."
    )
    whole, _ = split(text, [])
    assert [(i["type"], i["status"]) for i in whole] == [
        ("reasoning", "completed"),
        ("message", "completed"),
        ("function_call", "completed"),
        ("message", "completed"),
    ]
    assert whole[2]["arguments"] == '{"zone": "UTC"}' and whole[3]["content"][0]["text"] == "Done."
    rng = random.Random(3)
    for _ in range(50):
        items, events = split(text, sorted(rng.sample(range(1, len(text)), rng.randint(1, 30))))
        assert without_ids(items) == without_ids(whole)
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
        assert added == done == [0, 1, 2, 3]
        pieces = [e["delta"] for e in events if e["type"].endswith("arguments.delta")]
        assert "".join(pieces) == items[2]["arguments"]


def test_a_call_cut_short_ends_incomplete_and_its_text_follows() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zo'
    items, _ = split("</think>" + text, [9, 40])
    assert [(i["type"], i["status"]) for i in items] == [
        ("function_call", "incomplete"),
        ("message", "completed"),
    ]
    assert items[0]["arguments"] == '{"zo' and items[1]["content"][0]["text"] == text


REFUSED = {
    "previous_response_id": ({"previous_response_id": "resp_1"}, "keeps no responses"),
    "store": ({"store": True}, "keeps no responses"),
    "conversation": ({"conversation": "conv_1"}, "keeps no conversations"),
    "background": ({"background": True}, "foreground only"),
    "prompt": ({"prompt": {"id": "pmpt_1"}}, "prompt templates"),
    "truncation": ({"truncation": "auto"}, "never truncates"),
    "max_tool_calls": ({"max_tool_calls": 2}, "does not count tool calls"),
    "top_logprobs": ({"top_logprobs": 2}, "no log-probabilities"),
    "include": ({"include": ["reasoning.encrypted_content"]}, "adds nothing"),
    "reasoning": ({"reasoning": {"effort": "high"}}, "no reasoning effort"),
    "reasoning-summary": ({"reasoning": {"summary": "auto"}}, "no reasoning summaries"),
    "text": ({"text": {"verbosity": "low"}}, "no verbosity"),
    "text.format": ({"text": {"format": {"type": "grammar"}}}, "unknown"),
    "stream_options": ({"stream_options": {"include_obfuscation": True}}, "pads no events"),
    "tools": ({"tools": [{"type": "web_search"}]}, "function tools only"),
    "tools-key": ({"tools": [{**TOOLS[1], "defer_loading": True}]}, "defer_loading"),
    "tool_choice": ({"tool_choice": {"type": "file_search"}}, "function tools only"),
    "input": ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "keeps no items"),
    "input-image": (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "text only",
    ),
    "input-encrypted": (
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
        "encrypted",
    ),
    "input-type": ({"input": [{"type": "computer_call_output"}]}, "computer_call_output"),
    "max_output_tokens": ({"max_output_tokens": 0}, "max_output_tokens is 0"),
    "moderation": ({"moderation": {}}, "not a parameter of this endpoint"),
    "best_of": ({"best_of": 1}, "not a parameter of this endpoint"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_what_is_not_served_is_refused_by_name(fronts: Fronts, name: str) -> None:
    """A 400 in OpenAI's shape, `param` the field (the id's part before any dash)."""
    fields, words = REFUSED[name]
    sent = post(fronts, {"model": "", "input": "hi", **fields})
    assert sent.status_code == 400, sent.text
    error = sent.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"]
    assert error["param"] == name.split("-")[0], error


def test_a_refusal_names_the_fields_of_this_endpoint(fronts: Fronts) -> None:
    """The chat's reading and the Door refuse in the chat's names; here they say these."""
    sent = post(fronts, {"input": "hi", "max_output_tokens": 10**6})
    assert sent.status_code == 400 and sent.json()["error"]["param"] == "max_output_tokens"
    sent = post(fronts, {"input": "hi", "tools": [{"type": "function", "name": "bad name"}]})
    assert sent.status_code == 400 and sent.json()["error"]["param"] == "tools"
    assert post(fronts, {"input": "hi", "model": "other"}).status_code == 404


def test_no_response_is_stored_to_retrieve_or_delete(fronts: Fronts) -> None:
    for call in (fronts.client.responses.retrieve, fronts.client.responses.delete):
        with pytest.raises(openai.NotFoundError) as caught:
            call("resp_1")
        assert "keeps no responses" in caught.value.body["message"]


WRONG = [None, [], {}, [1.5], {"a": 1}, "x", True, -1, 1.5, 10**30, "9" * 300, [{}], [None]]
FIELDS = [
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
    "max_output_tokens", "temperature", "top_p", "stream", "stream_options", "reasoning",
    "include", "store", "metadata", "top_k", "seed", "stop", "chat_template_kwargs",
]  # fmt: skip
EDGES = [math.nan, math.inf, -math.inf, 1e-45, 1e38, 1e308, -0.0, 0.5, 10**400]


FORMAT = {"type": "json_schema", "name": "color", "schema": COLOR}
DEEP = "[" * 900 + "]" * 900  # near the JSON parser's bound, past the writer's once wrapped


def mutations(rng: random.Random) -> Iterator[str]:
    """Bodies near a valid one, as JSON text: a field of the wrong type, an input item's, a
    tool's or a format's field of the wrong type, a number at an edge, a value nested deep,
    NaN or an unpaired surrogate where the response would carry it back, or not an object."""
    # Seeded: a body that leaves the budget out runs the same tokens every time.
    base = {"model": "", "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2}
    base["seed"] = 1
    for name in FIELDS:
        for value in WRONG:
            yield json.dumps({**base, name: value})
    item = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    places = {
        "input": lambda v: [{**item, rng.choice([*item, "content", "role"]): v}],
        "tools": lambda v: [{**TOOLS[1], rng.choice(["name", "parameters", "type"]): v}],
        "text": lambda v: {"format": {**FORMAT, rng.choice(["name", "schema", "strict"]): v}},
        "tool_choice": lambda v: {"type": "function", "name": v},
        "metadata": lambda v: {"k": v},
    }  # fmt: skip
    for _ in range(150):
        name = rng.choice(list(places))
        yield json.dumps({**base, name: places[name](rng.choice(WRONG))})
    for name in [*places, "user", "instructions", "reasoning"]:
        for value in ("NaN", '"\\ud800"', DEEP):
            shaped = json.dumps({**base, name: places.get(name, lambda v: v)("@")})
            yield shaped.replace('"@"', value)
    for name in ("temperature", "top_p", "seed", "top_k"):
        for value in EDGES:
            yield json.dumps({**base, name: value})
    yield from ("[]", '"text"', "3", "null", "{", DEEP)


def strict(text: str) -> Any:
    """JSON as RFC 8259 has it: NaN and Infinity are not JSON."""

    def refuse(name: str) -> None:
        raise AssertionError(f"a reply carries a bare {name}: {text[:200]}")

    return json.loads(text, parse_constant=refuse)


def test_malformed_bodies_are_a_400_never_a_500(fronts: Fronts) -> None:
    """Every reply a 400 naming a sentence (a 404 for another model's name), or a response
    whole or streamed to its end, in strict JSON."""
    statuses: dict[int, int] = {}
    with httpx2.Client(headers=HEADERS, timeout=60) as http:
        for i, body in enumerate(mutations(random.Random(7))):
            if body.startswith("{") and body.endswith("}"):  # every other one streamed
                body = body[:-1] + f', "stream": {json.dumps(i % 2 == 0)}}}'
            sent = http.post(f"{fronts.http}/responses", content=body)
            statuses[sent.status_code] = statuses.get(sent.status_code, 0) + 1
            assert sent.status_code in (200, 400, 404), (body[:300], sent.text)
            if sent.status_code == 404:
                assert strict(sent.text)["error"]["param"] == "model", body
            elif sent.status_code == 400:
                assert strict(sent.text)["error"]["message"], body
            elif sent.headers["content-type"].startswith("text/event-stream"):
                events = [
                    strict(e.split("data: ", 1)[1])
                    for e in sent.text.split("\n\n")
                    if "data: " in e
                ]
                assert events[-1]["type"] in ("response.completed", "response.incomplete"), body
            else:
                assert strict(sent.text)["object"] == "response", body
    assert statuses[200] and statuses[400] > statuses[200], statuses


def test_openai_agents_runs_a_function_tool(fronts: Fronts) -> None:
    """openai-agents' default model, `OpenAIResponsesModel`, on this server: a forced call of
    a function tool, run whole and streamed; the tool gets its arguments parsed."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        asked.append(zone)
        return f"noon {zone}"

    async def run() -> tuple[Any, Any]:
        client = openai.AsyncOpenAI(base_url=fronts.http, api_key=KEY, max_retries=0)
        model = OpenAIResponsesModel(
            model=fronts.engine.capabilities().model_name, openai_client=client
        )
        agent = Agent(
            name="clock",
            instructions="Tell the time.",
            model=model,
            tools=[get_time],
            model_settings=ModelSettings(
                tool_choice="required", max_tokens=120, parallel_tool_calls=False
            ),
            tool_use_behavior="stop_on_first_tool",
        )
        whole = await Runner.run(agent, "Time in Paris?")
        streamed = Runner.run_streamed(agent, "Time in Paris?")
        async for _ in streamed.stream_events():
            pass
        return whole, streamed

    whole, streamed = asyncio.run(run())
    assert len(asked) == 2 and set(asked) <= {"UTC", "CET"}
    assert whole.final_output == f"noon {asked[0]}" and streamed.final_output == f"noon {asked[1]}"


# -- on Qwen3.6's template, thinking on ----------------------------------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fronts]:
    """A Qwen3.5 checkpoint written by transformers with Qwen3.6's template (the prompt opens
    `<think>`; calls in the XML form) on an in-process engine."""
    directory = tmp_path_factory.mktemp("qwen3.6") / "model"
    directory.mkdir()
    make(directory, "dense")
    shutil.copy(QWEN3_6, directory / TEMPLATE_FILE)
    with serving(Engine(directory, ServiceConfig(verify_tiers="2:3", max_context=2048)), 4) as f:
        yield f


QWEN_FORCED = {**FORCED, "tools": [TOOLS[0]], "temperature": 0, "max_output_tokens": 200}
QWEN_FORCED["extra_body"] = {"thinking_token_budget": 6}


def test_reasoning_then_a_call_whole_and_streamed(qwen: Fronts) -> None:
    """The reasoning item, then the call; streamed, the XML form's arguments come in pieces
    (a text value character by character) that join to the whole call's."""
    done = qwen.client.responses.create(model="", input=ASK, **QWEN_FORCED)
    reasoning, call = done.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert check_call(call) == "get_weather" and done.status == "completed"
    assert 6 <= done.usage.output_tokens_details.reasoning_tokens < done.usage.output_tokens
    events = events_of(
        qwen.client.responses.create(model="", input=ASK, stream=True, **QWEN_FORCED)
    )
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == 2
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == reasoning.content[0].text
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3 and "".join(deltas) == events[-1].response.output[1].arguments
    assert events[-1].response.output[1].arguments == call.arguments  # greedy: the same call


def test_openai_agents_gets_the_call_and_the_reasoning_apart(qwen: Fronts) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from agents.items import ReasoningItem, ToolCallItem

    set_tracing_disabled(True)

    def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: Literal[1, 2, 3]) -> str:
        """The weather in a city for some days."""
        return f"sun in {city} for {days} days"

    async def run() -> Any:
        from agents import function_tool

        client = openai.AsyncOpenAI(base_url=qwen.http, api_key=KEY, max_retries=0)
        model = OpenAIResponsesModel(
            model=qwen.engine.capabilities().model_name, openai_client=client
        )
        settings = ModelSettings(
            tool_choice="required",
            max_tokens=200,
            temperature=0,
            extra_body={"thinking_token_budget": 6},
        )
        agent = Agent(
            name="weather",
            model=model,
            tools=[function_tool(get_weather)],
            model_settings=settings,
            tool_use_behavior="stop_on_first_tool",
        )
        return await Runner.run(agent, ASK)

    result = asyncio.run(run())
    assert result.final_output.startswith("sun in ")
    kinds = {type(item) for item in result.new_items}
    assert {ReasoningItem, ToolCallItem} <= kinds
