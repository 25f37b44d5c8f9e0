"""`POST /v1/messages` and `/v1/messages/count_tokens` through the official `anthropic` client on
a real socket, over the in-process engine the OpenAI front's tests serve: plain messages whole
and streamed (Anthropic's event sequence), a forced tool call whose streamed `input_json_delta`
pieces join to its input, a stop sequence reported, thinking blocks and the template's switch
(Qwen3.6's template, whose calls are XML), token counts, `x-api-key`, and refusals in
Anthropic's shape with their statuses; malformed bodies never a 5xx. The tiny model writes
random text: the tests check shapes, and force calls with tool_choice any."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import jsonschema
import pytest

from control_plane.text.chat import TEMPLATE_FILE
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from tests.control_plane.fronts.test_openai_http import KEY, Fronts, serving

QWEN3_6 = Path(__file__).parents[2] / "fixtures/qwen3.6/chat_template.jinja"
WIDE = ServiceConfig(verify_tiers="4:3", max_context=2048)
# Every value bounded, so that a call the grammar writes ends within its budget.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
NOTE = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 12}},
    "required": ["text"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "The weather.", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}
FORMAT = {"type": "json_schema", "schema": {"type": "object"}}
GREEDY = {"temperature": 0}  # the SDK sends it as vLLM's clients do, in the body


def client(fronts: Fronts, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{fronts.port}", api_key=key, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def fronts(tiny_dir: Path) -> Iterator[Fronts]:
    """The fronts on the bundled template, whose calls are Qwen3's JSON form."""
    with serving(Engine(tiny_dir, WIDE), 16) as f:
        yield f


@pytest.fixture(scope="module")
def qwen(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fronts]:
    """The fronts on the tiny checkpoint with Qwen3.6's template: thinking on by default,
    calls in the XML form."""
    directory = tmp_path_factory.mktemp("qwen3.6") / "model"
    shutil.copytree(tiny_dir, directory)
    (directory / TEMPLATE_FILE).write_text(QWEN3_6.read_text())
    with serving(Engine(directory, WIDE), 16) as f:
        yield f


def post(fronts: Fronts, body: Any, path: str = "/v1/messages", **headers: str) -> httpx2.Response:
    return httpx2.post(
        f"http://127.0.0.1:{fronts.port}{path}",
        json=body,
        headers={"x-api-key": KEY, **headers},
        timeout=120,
    )


def streamed(
    sdk: anthropic.resources.Messages, **fields: Any
) -> tuple[list[Any], anthropic.types.Message]:
    with sdk.stream(**fields) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def test_a_message_whole_and_streamed(fronts: Fronts) -> None:
    """A greedy message is the same text whole and streamed; the stream is Anthropic's
    sequence of events, its usage that of the whole."""
    messages = client(fronts).messages
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    fields: dict[str, Any] = dict(
        model="", max_tokens=12, system=system, messages=ASK, extra_body=GREEDY
    )
    whole = messages.create(**fields, metadata={"user_id": "u"})
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    (block,) = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert whole.usage.output_tokens <= 12
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) > 0
    events, final = streamed(messages, **fields)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(kinds)
    assert [b.model_dump() for b in final.content] == [block.model_dump()]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_call_streams_its_input_piece_by_piece(fronts: Fronts) -> None:
    """tool_choice any gives one tool_use block whose input fits its schema; streamed, its
    input_json_delta pieces come one event each as generated and join to the input."""
    messages = client(fronts).messages
    fields: dict[str, Any] = dict(
        model="", max_tokens=200, messages=ASK, tools=TOOLS, tool_choice=ONE_CALL
    )
    whole = messages.create(**fields)
    (call,) = whole.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    assert whole.stop_reason == "tool_use"
    events, final = streamed(messages, **fields)
    pieces = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    (block,) = final.content
    assert len(pieces) > 5 and json.loads("".join(pieces)) == block.input
    jsonschema.validate(block.input, WEATHER)
    assert final.stop_reason == "tool_use"


def test_a_tool_result_goes_back_in(fronts: Fronts) -> None:
    """The assistant's tool_use and the user's tool_result, as the SDK sends them back:
    rendered, so the prompt grows by them."""
    sdk = client(fronts)
    first = sdk.messages.create(
        model="", max_tokens=200, messages=ASK, tools=TOOLS, tool_choice=ONE_CALL
    )
    (call,) = first.content
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}
    follow = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [result]},
    ]
    before = sdk.messages.count_tokens(model="", messages=ASK, tools=TOOLS).input_tokens
    after = sdk.messages.count_tokens(model="", messages=follow, tools=TOOLS).input_tokens
    assert after - before >= len(json.dumps(call.input)) + len("sunny, 21 C")
    second = sdk.messages.create(model="", max_tokens=2, messages=follow, tools=TOOLS)
    used = second.usage
    assert used.input_tokens + (used.cache_read_input_tokens or 0) == after


def test_a_stop_sequence_is_reported(fronts: Fronts) -> None:
    """A stop sequence taken from the greedy text ends it there: reported as the stop
    sequence, not written, whole and streamed."""
    messages = client(fronts).messages
    fields: dict[str, Any] = dict(model="", max_tokens=16, messages=ASK, extra_body=GREEDY)
    text = messages.create(**fields).content[0].text
    stop = next(
        text[i : i + 2]
        for i in range(2, len(text) - 1)
        if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
    )
    for done in (
        messages.create(**fields, stop_sequences=[stop, "never written"]),
        streamed(messages, **fields, stop_sequences=[stop])[1],
    ):
        assert (done.stop_reason, done.stop_sequence) == ("stop_sequence", stop)
        assert "".join(b.text for b in done.content) == text[: text.index(stop)]


def test_thinking_blocks_and_the_templates_switch(qwen: Fronts) -> None:
    """Qwen3.6's template opens the reasoning: the output is a thinking block, signed; thinking
    disabled renders the template's closed block (a longer prompt) and gives no thinking;
    display omitted keeps the block without its text."""
    sdk = client(qwen)
    fields: dict[str, Any] = dict(model="", max_tokens=6, messages=ASK, extra_body=GREEDY)
    on = sdk.messages.create(**fields)
    assert [b.type for b in on.content] == ["thinking"] and on.content[0].signature
    off = sdk.messages.create(**fields, thinking={"type": "disabled"})
    assert "thinking" not in [b.type for b in off.content]
    counts = [
        sdk.messages.count_tokens(model="", messages=ASK, thinking=t).input_tokens
        for t in ({"type": "adaptive"}, {"type": "disabled"})
    ]
    assert counts[1] > counts[0]
    hidden = sdk.messages.create(**fields, thinking={"type": "adaptive", "display": "omitted"})
    assert hidden.content[0].type == "thinking" and hidden.content[0].thinking == ""
    events, final = streamed(sdk.messages, **fields)
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert kinds[-1] == "signature_delta" and "thinking_delta" in kinds
    assert final.content[0].thinking


def test_a_thinking_budget_closes_the_reasoning(qwen: Fronts) -> None:
    """budget_tokens bounds the reasoning: its block is closed once they are spent, and text
    follows."""
    done = client(qwen).messages.create(
        model="",
        max_tokens=24,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 4},
        extra_body=GREEDY,
    )
    assert [b.type for b in done.content] == ["thinking", "text"]


def test_a_named_tool_streams_its_xml_parameters(qwen: Fronts) -> None:
    """Qwen3.6's XML form: a text parameter streams character by character, its pieces
    joining to the input."""
    tools = [{"name": "note", "input_schema": NOTE}]
    events, final = streamed(
        client(qwen).messages,
        model="",
        max_tokens=200,
        messages=ASK,
        tools=tools,
        tool_choice={"type": "tool", "name": "note", "disable_parallel_tool_use": True},
        thinking={"type": "disabled"},
    )
    pieces = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    (block,) = [b for b in final.content if b.type == "tool_use"]
    assert block.name == "note" and json.loads("".join(pieces)) == block.input
    jsonschema.validate(block.input, NOTE)
    assert len(pieces) >= 3


def test_count_tokens(fronts: Fronts) -> None:
    sdk = client(fronts)
    plain = sdk.messages.count_tokens(model="", messages=ASK).input_tokens
    assert sdk.messages.count_tokens(model="", messages=ASK, tools=TOOLS).input_tokens > plain
    assert (
        sdk.messages.count_tokens(model="", messages=ASK, system="Be brief.").input_tokens > plain
    )


def test_keys(fronts: Fronts) -> None:
    """x-api-key is read as the key, beside authorization: Bearer; a wrong key is a 401 in
    Anthropic's shape."""
    body = {"model": "", "max_tokens": 1, "messages": ASK}
    assert post(fronts, body).status_code == 200
    bearer = {"authorization": f"Bearer {KEY}"}
    url = f"http://127.0.0.1:{fronts.port}/v1/messages"
    assert httpx2.post(url, json=body, headers=bearer, timeout=120).status_code == 200
    wrong = post(fronts, body, **{"x-api-key": "nope"})
    assert wrong.status_code == 401
    assert wrong.json() == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": "the API key in the x-api-key header is not one this server accepts.",
        },
    }
    with pytest.raises(anthropic.AuthenticationError):
        client(fronts, "nope").messages.count_tokens(model="", messages=ASK)
    assert client(fronts).messages.count_tokens(model="", messages=ASK).input_tokens > 0


@pytest.mark.parametrize(
    "fields, status, kind, named",
    [
        ({"model": "claude-opus"}, 404, "not_found_error", "model 'claude-opus'"),
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 100_000}, 400, "invalid_request_error", "maximum context length"),
        ({"top_k": -5}, 400, "invalid_request_error", "top_k"),
        ({"mcp_servers": [{"url": "x"}]}, 400, "invalid_request_error", "mcp_servers"),
        ({"output_format": {}}, 400, "invalid_request_error", "output_format"),
        ({"thinking": {"type": "enabled"}}, 400, "invalid_request_error", "thinking.type"),
        (
            {"tools": TOOLS, "tool_choice": ONE_CALL, "output_config": {"format": FORMAT}},
            400,
            "invalid_request_error",
            "output_config.format and tool_choice",
        ),
    ],
)
def test_refusals_in_anthropics_shape(
    fronts: Fronts, fields: dict, status: int, kind: str, named: str
) -> None:
    body = {k: v for k, v in {"model": "", "max_tokens": 4, "messages": ASK, **fields}.items()}
    reply = post(fronts, {k: v for k, v in body.items() if v is not None})
    assert reply.status_code == status
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert named in error["error"]["message"]


def test_a_refusal_through_the_sdk(fronts: Fronts) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(fronts).messages.create(model="", max_tokens=4, messages=ASK, container="c")
    assert caught.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "container is not served: this server runs no code-execution containers",
        },
    }


def test_methods_and_bodies_not_json(fronts: Fronts) -> None:
    url = f"http://127.0.0.1:{fronts.port}/v1/messages"
    got = httpx2.get(url, headers={"x-api-key": KEY})
    assert got.status_code == 405 and got.json()["error"]["type"] == "invalid_request_error"
    bad = httpx2.post(url, content=b"{not json", headers={"x-api-key": KEY})
    assert bad.status_code == 400 and bad.json()["type"] == "error"


def mutated(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """`value` with one part swapped for a value of another kind, or dropped."""
    junk = [None, 0, -1, 1.5, 1e300, "", "x", [], {}, [None], {"type": "x"}, True, "\ud800"]
    if isinstance(value, dict) and value and depth < 4 and rng.random() < 0.8:
        key = rng.choice(list(value))
        out = dict(value)
        if rng.random() < 0.2:
            del out[key]
        else:
            out[key] = mutated(rng, value[key], depth + 1)
        return out
    if isinstance(value, list) and value and depth < 4 and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return [*value[:i], mutated(rng, value[i], depth + 1), *value[i + 1 :]]
    return rng.choice(junk)


def test_malformed_bodies_are_never_a_5xx(fronts: Fronts) -> None:
    """40 seeded mutations of a full body (tools, results, thinking, blocks): each is taken
    or refused in Anthropic's shape with a 4xx, on both routes."""
    full = {
        "model": "",
        "max_tokens": 1,
        "system": [{"type": "text", "text": "S"}],
        "messages": [
            *ASK,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
        ],
        "tools": TOOLS,
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "adaptive"},
        "stop_sequences": ["x"],
        "temperature": 0.5,
    }
    rng = random.Random(61)
    statuses = []
    for i in range(40):
        body = mutated(rng, full)
        path = "/v1/messages" if i % 3 else "/v1/messages/count_tokens"
        if path.endswith("tokens") and isinstance(body, dict):
            body = {k: v for k, v in body.items() if k not in ("max_tokens", "stop_sequences")}
            body.pop("temperature", None)
        try:
            content = json.dumps(body).encode()
        except ValueError:
            continue
        reply = httpx2.post(
            f"http://127.0.0.1:{fronts.port}{path}",
            content=content,
            headers={"x-api-key": KEY, "content-type": "application/json"},
            timeout=120,
        )
        statuses.append(reply.status_code)
        assert reply.status_code < 500, (body, reply.text)
        if reply.status_code >= 400:
            assert reply.json()["type"] == "error", reply.text
    assert 200 in statuses and 400 in statuses
