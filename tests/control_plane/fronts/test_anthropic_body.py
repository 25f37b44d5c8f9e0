"""Anthropic Messages bodies as the chat front's requests, without a server: blocks, roles and
tool results converted as vLLM converts them, consecutive turns combined, `thinking` onto the
template's switch, every field not served refused by name; and a reply's events, streamed in
any cut, fold to the message a whole reply gives."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from control_plane.fronts.anthropic_body import (
    ThinkingSwitch,
    count_request,
    messages_request,
)
from control_plane.fronts.anthropic_reply import MessageReply, StopHold, fold
from control_plane.fronts.openai_fields import InvalidParam
from control_plane.scheduler.seq import Delta, Finish, SpecStats
from control_plane.text.tools import ChatOutput
from protos.params import ChatMessage

QWEN = ThinkingSwitch(reasons=True, switch=True)
ALWAYS = ThinkingSwitch(reasons=True, switch=False)
PLAIN = ThinkingSwitch(reasons=False, switch=False)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Weather.", "input_schema": WEATHER}
HI = [{"role": "user", "content": "hi"}]


def body(**fields: Any) -> dict:
    return {"model": "m", "max_tokens": 8, "messages": HI, **fields}


def test_blocks_become_the_chat_fronts_messages() -> None:
    """System blocks lead; a user turn's tool results become tool messages in place (named
    after their call); consecutive turns of one role combine; a last assistant turn is
    continued."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Rome"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "And"},
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "tomorrow?", "cache_control": {}}]},
        {"role": "assistant", "content": "It will"},
    ]
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    asked = messages_request(body(messages=messages, system=system, tools=[TOOL]), None)
    r = asked.ask.request
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather"}}
    assert [(m.role, m.content) for m in r.messages] == [
        ("system", "Be brief.\nBe kind."),
        ("user", "Weather?"),
        ("assistant", "Checking."),
        ("tool", "sunny"),
        ("user", "And\ntomorrow?"),
        ("assistant", "It will"),
    ]
    assistant, tool = r.messages[2], r.messages[3]
    assert assistant.reasoning_content == "Look it up."
    (written,) = json.loads(assistant.tool_calls)
    assert json.loads(written["function"].pop("arguments")) == {"city": "Rome"}
    assert {**written, "function": written["function"]} == call
    assert tool == ChatMessage("tool", "sunny", tool_call_id="toolu_1", name="get_weather")
    assert r.continue_final_message and r.add_generation_prompt is False
    assert json.loads(r.tools)[0]["function"] == {
        "name": "get_weather",
        "parameters": WEATHER,
        "description": "Weather.",
    }


@pytest.mark.parametrize(
    "choice, openai, parallel",
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any"}, "required", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "get_weather"}, "get_weather", None),
        ({"type": "none"}, "none", None),
    ],
)
def test_tool_choice(choice: dict, openai: str, parallel: bool | None) -> None:
    r = messages_request(body(tools=[TOOL], tool_choice=choice), None).ask.request
    assert (r.tool_choice, r.parallel_tool_calls) == (openai, parallel)


@pytest.mark.parametrize(
    "thinking, template, kwargs, show",
    [
        ({"type": "enabled"}, QWEN, {"enable_thinking": True}, True),
        ({"type": "disabled"}, QWEN, {"enable_thinking": False}, True),
        ({"type": "adaptive", "display": "omitted"}, QWEN, None, False),
        ({"type": "enabled"}, ALWAYS, None, True),
        ({"type": "disabled"}, PLAIN, None, True),
        ({"type": "disabled"}, None, {"enable_thinking": False}, True),
    ],
    ids=["on", "off", "omitted", "always-on", "never", "unknown-template"],
)
def test_thinking_sets_the_templates_switch(
    thinking: dict, template: ThinkingSwitch | None, kwargs: dict | None, show: bool
) -> None:
    asked = messages_request(body(thinking=thinking), template)
    given = asked.ask.request.chat_template_kwargs
    assert (json.loads(given) if given else None, asked.show_thinking) == (kwargs, show)


def test_a_thinking_budget_is_the_reasoning_budget() -> None:
    thinking = {"type": "enabled", "budget_tokens": 5}
    assert messages_request(body(thinking=thinking), QWEN).ask.request.thinking_token_budget == 5


def test_count_reads_the_prompt_fields() -> None:
    r = count_request({"model": "m", "messages": HI, "system": "S", "tools": [TOOL]}, None)
    assert [m.role for m in r.messages] == ["system", "user"] and r.tools
    with pytest.raises(InvalidParam) as caught:
        count_request({"model": "m", "messages": HI, "max_tokens": 3}, None)
    assert str(caught.value).startswith("max_tokens is not a parameter of this endpoint")


REFUSED = {
    "no max_tokens": ({"max_tokens": None}, "max_tokens is required"),
    "no model": ({"model": None}, "model is required"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens is 0"),
    "unknown field": ({"frobnicate": 1}, "frobnicate is not a parameter"),
    "container": ({"container": "c1"}, "container is not served"),
    "mcp_servers": ({"mcp_servers": [{}]}, "mcp_servers is not served"),
    "context_management": ({"context_management": {}}, "context_management is not served"),
    "temperature": ({"temperature": 1.5}, "temperature is 1.5; it must be from 0 to 1"),
    "top_p": ({"top_p": -0.1}, "top_p is -0.1"),
    "top_k": ({"top_k": "x"}, "top_k is"),
    "stop_sequences": ({"stop_sequences": "x"}, "stop_sequences is"),
    "too many stops": ({"stop_sequences": ["x"] * 200}, "stop_sequences holds 200 strings"),
    "effort": ({"output_config": {"effort": "high"}}, "output_config.effort is"),
    "format": ({"output_config": {"format": {"type": "x"}}}, "output_config.format is"),
    "image": (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0].source is {}; it must be {type: base64, media_type, data} or",
    ),
    "redacted": (
        {"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking"}]}]},
        "messages[0].content[0] is a redacted_thinking block",
    ),
    "server tool block": (
        {"messages": [{"role": "assistant", "content": [{"type": "server_tool_use"}]}]},
        'messages[0].content[0] is a "server_tool_use" block',
    ),
    "tool_use from the user": (
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t"}]}]},
        "messages[0].content[0] is a tool_use block, which only a assistant message holds",
    ),
    "unknown block key": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
        "messages[0].content[0].x is not taken here",
    ),
    "role": ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role is"),
    "citations": (
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a", "citations": [{}]}]}
            ]
        },
        "messages[0].content[0].citations is not served",
    ),
    "server tool": ({"tools": [{"type": "web_search_20250305", "name": "w"}]}, "tools[0] is"),
    "no input_schema": ({"tools": [{"name": "f"}]}, "tools[0].input_schema is required"),
    "tool twice": ({"tools": [TOOL, TOOL]}, "tools[1].name 'get_weather' names a tool twice"),
    "input_examples": (
        {"tools": [{**TOOL, "input_examples": [{}]}]},
        "tools[0].input_examples is not served",
    ),
    "strict under auto": ({"tools": [{**TOOL, "strict": True}]}, "tools[0].strict is true"),
    "tool_choice type": ({"tool_choice": {"type": "some"}}, "tool_choice.type is"),
    "any without tools": ({"tool_choice": {"type": "any"}}, "tool_choice is 'any'"),
    "unknown tool": (
        {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
        'tool_choice.name is "nope", not one of',
    ),
    "thinking type": ({"thinking": {"type": "deep"}}, "thinking.type is"),
    "budget past max_tokens": (
        {"thinking": {"type": "enabled", "budget_tokens": 8}},
        "max_tokens (8) must be greater than thinking.budget_tokens (8)",
    ),
    "budget with adaptive": (
        {"thinking": {"type": "adaptive", "budget_tokens": 2}},
        "thinking.budget_tokens goes with type enabled",
    ),
    "thinking against its kwarg": (
        {"thinking": {"type": "enabled"}, "chat_template_kwargs": {"enable_thinking": False}},
        "thinking.type is enabled; chat_template_kwargs.enable_thinking says otherwise",
    ),
    "not a list": ({"messages": {}}, "messages must be a non-empty list"),
    "not an object": ({"messages": [3]}, "messages[0] is 3"),
}


@pytest.mark.parametrize("fields, sentence", REFUSED.values(), ids=REFUSED.keys())
def test_what_is_not_served_is_refused_by_name(fields: dict, sentence: str) -> None:
    given = {k: v for k, v in body(**fields).items() if v is not None}
    with pytest.raises(InvalidParam) as caught:
        messages_request(given, QWEN)
    assert str(caught.value).startswith(sentence), str(caught.value)


@pytest.mark.parametrize(
    "thinking, template, sentence",
    [
        ("enabled", PLAIN, "thinking.type is enabled; the served model's chat template writes"),
        ("disabled", ALWAYS, "thinking.type is disabled; the served model's chat template always"),
    ],
)
def test_thinking_the_template_cannot_honour_is_refused(
    thinking: str, template: ThinkingSwitch, sentence: str
) -> None:
    with pytest.raises(InvalidParam) as caught:
        messages_request(body(thinking={"type": thinking}), template)
    assert str(caught.value).startswith(sentence)


def test_inert_fields_change_nothing() -> None:
    inert = {"metadata": {"user_id": "u"}, "service_tier": "auto", "cache_control": {}}
    assert messages_request(body(**inert), None) == messages_request(body(), None)


# -- replies -----------------------------------------------------------------------------------

TOOLS = {"get_weather": WEATHER}
ARGUMENTS = '{"city": "Ro\\"me", "n": [1, 2.5]}'
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n</tool_call>'
# text -> (the whole message's blocks, its stop reason, the streamed message's blocks)
TEXTS = {
    "reasoning, text, call": (
        "<think>Hmm.</think>\n\nSure.\n" + CALL,
        ["thinking", "text", "tool_use"],
        "tool_use",
        None,
    ),
    "two calls": (
        CALL + "\n" + CALL.replace("Ro", "Pa"),
        ["tool_use", "tool_use"],
        "tool_use",
        None,
    ),
    "cut short": ("Sure.\n" + CALL[:60], ["text"], "end_turn", ["text", "tool_use", "text"]),
    "not a call": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": tru}}\n</tool_call> ok',
        ["text"],
        "end_turn",
        ["tool_use", "text"],
    ),
}
FINISH = Finish("stop", 10, 20, SpecStats(), cached_tokens=4)


def without_ids(blocks: list[dict]) -> list[dict]:
    return [{k: v for k, v in b.items() if k not in ("id", "signature")} for b in blocks]


@pytest.mark.parametrize("text, kinds, reason, streamed", TEXTS.values(), ids=TEXTS.keys())
def test_a_stream_in_any_cut_folds_to_the_whole_message(
    text: str, kinds: list[str], reason: str, streamed: list[str] | None
) -> None:
    """The events of a stream fed in random cuts build what the whole reply holds, a call's
    input in more than one piece; a block that opened as a call and did not parse (cut short,
    or not a call) streams as its tool_use block closed as it stands, then its text."""
    whole = MessageReply("m", "x", ChatOutput(TOOLS, True)).whole(text, FINISH)
    assert [b["type"] for b in whole["content"]] == kinds
    assert whole["stop_reason"] == reason
    assert whole["usage"] == {
        "input_tokens": 6,
        "output_tokens": 20,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
    }
    rng = random.Random(5)
    for _ in range(20):
        reply = MessageReply("m", "x", ChatOutput(TOOLS, True), eager=lambda name: True)
        events, at = [], 0
        while at < len(text):
            n = rng.randrange(1, 7)
            events += reply.delta(Delta([0], text[at : at + n], []))
            at += n
        events += reply.finish(FINISH)
        if streamed is not None:
            assert [b["type"] for b in fold(events)] == streamed
            continue
        assert without_ids(fold(events)) == without_ids(whole["content"])
        pieces = [e for e in events if e.get("delta", {}).get("type") == "input_json_delta"]
        assert len(pieces) > 2 * kinds.count("tool_use")
        assert events[-2]["delta"] == {"stop_reason": reason, "stop_sequence": None}


def test_a_stop_sequence_is_reported_not_written() -> None:
    """The text a stop string ended arrives with the string whole (the detokenizer holds
    what may become one): held back, then reported, the longest that ends it."""
    hold = StopHold(("END", "D"))
    assert hold.push("abc") == "abc"
    assert hold.push("END") == ""
    assert hold.finish("stop") == ("", "END")
    hold = StopHold(("END",))
    assert hold.push("xEND") == "x" and hold.push("y") == "ENDy"
    assert hold.finish("length") == ("", None)
