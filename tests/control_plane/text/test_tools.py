"""Tool calls and reasoning parsed back from text: both call forms, whole and streamed cut at
every pair of positions; the grammars of `required` and a named tool, in both forms, write
only calls that parse and fit their schemas; tools render as transformers renders them."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from control_plane.text.chat import ChatTemplate
from control_plane.text.grammar import GrammarCompiler
from control_plane.text.tokenizer import ByteTokenizer
from control_plane.text.tools import (
    JSON_FORM,
    XML_FORM,
    ChatOutput,
    call_grammar,
    merge,
    read_tools,
    template_form,
)
from protos.defaults import DEFAULT_MODEL_DIR

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city", "days"],
}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS_JSON = json.dumps(
    [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
        {"type": "function", "function": {"name": "ping", "parameters": NOTHING}},
    ]
)
TOOLS = read_tools(TOOLS_JSON)
QWEN3_6 = Path(__file__).parents[2] / "fixtures/qwen3.6/chat_template.jinja"

SAMPLES: dict[str, tuple[str, dict[str, Any]]] = {
    "json-after-words": (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 2}}\n</tool_call>\n',
        {"content": "Let me look.", "calls": [("get_weather", {"city": "Paris", "days": 2})]},
    ),
    "xml-two-calls-and-reasoning": (
        "<think>\nweather, so </thi the tool</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nNew\nYork\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>",
        {
            "reasoning": "\nweather, so </thi the tool",
            "content": None,
            "calls": [("get_weather", {"city": "New\nYork", "days": 3}), ("ping", {})],
        },
    ),
    "arguments-as-text": (
        '<tool_call>{"name": "ping", "arguments": "{\\"a\\": 1}"}</tool_call> done',
        {"content": "done", "calls": [("ping", {"a": 1})]},
    ),
    "unparsed-block-stays-text": (
        "a <tool_call>{not json}</tool_call> b",
        {"content": "a <tool_call>{not json}</tool_call> b", "calls": []},
    ),
    "cut-short": (
        'so <tool_call>\n{"name": "ping"',
        {"content": 'so <tool_call>\n{"name": "ping"', "calls": []},
    ),
    "markers-halfway": ("x <tool_ca <thi", {"content": "x <tool_ca <thi", "calls": []}),
    "think-unclosed": (
        "<think>still going",
        {"reasoning": "still going", "content": "", "calls": []},
    ),
}


def parsed(message: dict[str, Any]) -> dict[str, Any]:
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls", ())
    ]
    out = {"content": message["content"], "calls": calls}
    if "reasoning_content" in message:
        out["reasoning"] = message["reasoning_content"]
    return out


def run(text: str, cuts: tuple[int, ...]) -> dict[str, Any]:
    out = ChatOutput(TOOLS, reasoning=True)
    deltas = []
    for a, b in zip((0, *cuts), (*cuts, len(text)), strict=True):
        deltas += out.push(text[a:b])
    return parsed(merge(deltas + out.close()))


@pytest.mark.parametrize(("text", "want"), SAMPLES.values(), ids=SAMPLES.keys())
def test_every_cut_gives_the_whole_parse(text: str, want: dict[str, Any]) -> None:
    assert run(text, ()) == want
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert run(text, (i, j)) == want, (i, j)


def test_a_call_nested_past_the_stack_stays_text() -> None:
    text = '<tool_call>{"name": "ping", "arguments": ' + "[" * 100000 + "</tool_call>"
    assert run(text, ()) == {"content": text, "calls": []}


def test_a_prompt_that_opened_the_reasoning() -> None:
    out = ChatOutput(None, reasoning=True, opened=True)
    message = merge(out.push("plan</think>\n\nanswer") + out.close())
    assert message == {"content": "answer", "reasoning_content": "plan"}


def test_streamed_calls_carry_their_index() -> None:
    text, _ = SAMPLES["xml-two-calls-and-reasoning"]
    out = ChatOutput(TOOLS, reasoning=True)
    calls = [c for d in out.push(text) + out.close() for c in d.get("tool_calls", ())]
    assert [c["index"] for c in calls] == [0, 1]


def walk(grammar: str, rng: random.Random, most: int = 400) -> str:
    """A random sentence of `grammar`: each byte drawn uniformly from those its mask allows,
    as a model sampling under it draws (its EOS once allowed, half the time)."""
    tok = ByteTokenizer.default()
    compiled = GrammarCompiler(tok, 320, (tok.eos_token_id,)).compile("lark", grammar)
    out: list[int] = []
    for _ in range(most):
        if compiled.is_done():
            break
        bits = compiled.mask()
        allowed = [t for t in range(320) if bits[t // 8] >> (t % 8) & 1]
        if tok.eos_token_id in allowed and rng.random() < 0.5:
            break
        t = rng.choice([t for t in allowed if t != tok.eos_token_id] or allowed)
        compiled.advance([t])
        out.append(t)
    return bytes(out).decode()


@pytest.mark.parametrize("form", [JSON_FORM, XML_FORM])
@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_the_grammar_writes_only_calls_that_fit(form: str, choice: str) -> None:
    rng = random.Random(5)
    grammar = call_grammar(TOOLS, choice, form, parallel=False)
    assert grammar is not None
    for _ in range(20):
        text = walk(grammar, rng)
        out = ChatOutput(TOOLS, reasoning=False)
        message = merge(out.push(text) + out.close())
        assert message["content"] is None and len(message["tool_calls"]) == 1, text
        for call in message["tool_calls"]:
            name = call["function"]["name"]
            assert choice in ("required", name)
            args = json.loads(call["function"]["arguments"])
            jsonschema.validate(args, WEATHER if name == "get_weather" else NOTHING)


def test_auto_and_none_constrain_nothing() -> None:
    assert call_grammar(TOOLS, "auto", JSON_FORM, True) is None
    assert call_grammar(TOOLS, "none", XML_FORM, True) is None


def test_the_templates_forms() -> None:
    assert template_form((DEFAULT_MODEL_DIR / "chat_template.jinja").read_text()) == JSON_FORM
    assert template_form(QWEN3_6.read_text()) == XML_FORM


def test_tools_render_as_transformers_renders_them() -> None:
    """The bundled template and Qwen3.6's, a call and its result in the chat."""
    transformers = pytest.importorskip("transformers")
    tools = json.loads(TOOLS_JSON)
    chat = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    for source in ((DEFAULT_MODEL_DIR / "chat_template.jinja").read_text(), QWEN3_6.read_text()):
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json"), bos_token="<|bos|>"
        )
        tok.chat_template = source
        want = tok.apply_chat_template(
            chat, tools=tools, tokenize=False, add_generation_prompt=True
        )
        got = ChatTemplate(source, {"bos_token": "<|bos|>"}).render(chat, True, None, tools)
        assert got == want and "Oslo" in got and "cold" in got


def test_bad_tools_are_refused() -> None:
    for text, sentence in (
        ("{}", "tools must be a list"),
        ('[{"type": "function", "function": {"name": "a b"}}]', "tools[0].function.name must be"),
        ('[{"type": "function", "function": {"name": "a", "parameters": 3}}]', "parameters must"),
    ):
        with pytest.raises(ValueError, match=sentence.replace("[", r"\[").replace("]", r"\]")):
            read_tools(text)
