"""`POST /v1/responses` bodies (OpenAI's Responses API, as vLLM serves it) as the chat request
they ask for: `instructions` and `input` (text, or items: messages, function calls, their
outputs and reasoning) as messages, the flat function tools and `tool_choice` in the chat's
shape, `text.format` as `response_format`, `max_output_tokens` as the budget; that chat body is
then read by `openai_body.chat_request`, so each knob is read in one place. vLLM's own
parameters are taken as its chat endpoint takes them.

What the Responses API has and this server does not (stored responses, built-in tools, files
and audio, encrypted reasoning, log-probabilities) is refused by name; nothing is dropped. An
`input_image` is read no further than its URL here, as the chat endpoint's `image_url`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from control_plane.fronts.openai_body import INERT, Ask, chat_request
from control_plane.fronts.openai_fields import (
    InvalidParam,
    bool_field,
    int_field,
    list_field,
    object_field,
    shown,
    str_field,
    typed_field,
)
from control_plane.fronts.openai_prompts import DETAIL_AUTO
from protos.params import ContentPart, ImagePart

# Parameters taken only at a value that changes nothing: name -> (those values, what this
# server does instead). An absent or null parameter is always taken.
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": (
        (),
        "keeps no responses (store is off); send the whole conversation in input",
    ),
    "store": ((False,), "keeps no responses; send store: false or leave it out"),
    "conversation": ((), "keeps no conversations; send the whole conversation in input"),
    "background": ((False,), "answers in the foreground only (background: false)"),
    "prompt": ((), "keeps no prompt templates; send instructions and input"),
    "truncation": (("disabled",), "never truncates the input (truncation: disabled)"),
    "max_tool_calls": ((), "does not count tool calls (parallel_tool_calls: false asks one)"),
    "top_logprobs": ((0,), "returns no log-probabilities here (see /v1/chat/completions)"),
    "include": (([],), "adds nothing to the output (include: [])"),
}
# Read here, and turned into the chat body's own names.
READ = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "stream_options",
        "reasoning",
    }
)
# vLLM's parameters and this server's own, read as the chat endpoint reads them.
PASSED = frozenset(
    {
        "top_k",
        "min_p",
        "min_tokens",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "include_stop_str_in_output",
        "request_id",
        "structured_outputs",
        "chat_template",
        "chat_template_kwargs",
        "speculative",
        "thinking_token_budget",
        "priority",
        "cache_salt",
        "skip_special_tokens",
        "vllm_xargs",
    }
)
INERT_HERE = INERT | {"prompt_cache_retention"}  # a cache's lifetime changes no output
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
CHOICES = ("auto", "none", "required")
TEXT_PARTS = {"input_text", "output_text"}
MEDIA_PARTS = {"input_image", "input_file", "input_audio"}
IMAGE_KEYS = frozenset({"type", "image_url", "file_id", "detail"})
FORMAT_FIELDS = (
    ("name", str, "a string"),
    ("description", str, "a string"),
    ("strict", bool, "true or false"),
)
FUNCTION_KEYS = {"type", "name", "description", "parameters", "strict"}
# `reasoning`'s fields, each taken only null: what this server does instead.
REASONING = {
    "effort": (
        "has no reasoning effort (chat_template_kwargs sets a template's own switches, such "
        "as enable_thinking)"
    ),
    "summary": "writes no reasoning summaries; the reasoning comes back whole as reasoning items",
    "generate_summary": (
        "writes no reasoning summaries; the reasoning comes back whole as reasoning items"
    ),
}
# What a refusal from the chat's reading names, in this endpoint's words.
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


@dataclasses.dataclass(frozen=True)
class Responses:
    """One `/v1/responses` request: the chat it asks (`ask`) and the settings its response
    echoes, in the Responses API's shapes."""

    ask: Ask
    echo: dict[str, Any]


def responses_request(body: Any) -> Responses:
    """A `/v1/responses` body; `InvalidParam` with a sentence (its `param` in this endpoint's
    names) when it cannot be taken."""
    if not isinstance(body, dict):
        raise InvalidParam(None, "the body must be a JSON object")
    _refuse_unsupported(body)
    chat = {k: body[k] for k in PASSED if k in body}
    chat |= _settings(body)
    chat["messages"] = _messages(body)
    chat |= _tools(body)
    try:
        ask = chat_request(chat)
    except InvalidParam as e:
        raise renamed(e) from None
    return Responses(ask, _echo(body, ask))


def renamed(e: InvalidParam) -> InvalidParam:
    """A refusal of the chat body in this endpoint's names."""
    if e.param not in PARAMS:
        return e
    return InvalidParam(PARAMS[e.param], str(e), e.code, e.status)


def _refuse_unsupported(body: dict) -> None:
    for name, value in body.items():
        if name in REFUSED:
            takes, instead = REFUSED[name]
            if value is not None and value not in takes:
                raise InvalidParam(name, f"{name} is {shown(value)}; this server {instead}")
        elif name not in READ and name not in PASSED and name not in INERT_HERE:
            raise InvalidParam(
                name, f"{name} is not a parameter of this endpoint; this server does not take it"
            )


def _settings(body: dict) -> dict[str, Any]:
    """The budget, sampling and streaming, and what `text` and `reasoning` ask."""
    chat: dict[str, Any] = {
        "max_completion_tokens": int_field(body, "max_output_tokens", least=1),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "stream": bool_field(body, "stream"),
        "model": body.get("model"),
    }
    options = object_field(body, "stream_options") or {}
    for key, value in options.items():
        if key != "include_obfuscation":
            raise InvalidParam(
                "stream_options",
                f"stream_options.{key} is not taken here; it takes include_obfuscation",
            )
        if value not in (None, False):
            raise InvalidParam(
                "stream_options",
                f"stream_options.include_obfuscation is {shown(value)}; this server pads no "
                "events (false)",
            )
    reasoning = object_field(body, "reasoning") or {}
    _refuse_keys(reasoning, "reasoning", REASONING)
    text = object_field(body, "text") or {}
    _refuse_keys(text, "text", {"format": None, "verbosity": "has no verbosity setting"})
    form = _format(object_field(text, "format", "text.format"))
    if form is not None:
        chat["response_format"] = form
    return {k: v for k, v in chat.items() if v is not None}


def _refuse_keys(obj: dict, where: str, known: Mapping[str, str | None]) -> None:
    """`obj`'s keys: those `known` with a sentence are taken only null; any other refused."""
    for key, value in obj.items():
        name = f"{where}.{key}"
        if key not in known:
            raise InvalidParam(where, f"{name} is not taken here; {where} takes {', '.join(known)}")
        if known[key] is not None and value is not None:
            raise InvalidParam(where, f"{name} is {shown(value)}; this server {known[key]}")


def _format(form: dict | None) -> dict | None:
    """`text.format` as the chat's `response_format`: text, json_object, or json_schema with
    its schema."""
    if form is None:
        return None
    kind = form.get("type")
    if kind == "json_schema":
        schema = form.get("schema")
        if not isinstance(schema, dict | bool):
            raise InvalidParam("text.format", "text.format.schema must be a JSON schema")
        for key, kind, what in FORMAT_FIELDS:
            typed_field(form, key, kind, what, f"text.format.{key}")
        return {"type": "json_schema", "json_schema": {"schema": schema}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise InvalidParam(
        "text.format",
        f"text.format type {shown(kind)} is unknown; use text, json_object or json_schema",
    )


def _tools(body: dict) -> dict[str, Any]:
    """The flat function tools and `tool_choice` in the chat's shapes."""
    tools = [_tool(t, i) for i, t in enumerate(list_field(body, "tools"))]
    chat: dict[str, Any] = {"tools": tools or None}
    choice = body.get("tool_choice")
    given = choice if isinstance(choice, dict) else {}
    if given.get("type") == "function" and isinstance(given.get("name"), str):
        choice = {"type": "function", "function": {"name": given["name"]}}
    elif choice is not None and choice not in CHOICES:
        raise InvalidParam(
            "tool_choice",
            f"tool_choice is {shown(choice)}; use auto, none, required or "
            '{"type": "function", "name": ...} (this server serves function tools only)',
        )
    chat["tool_choice"] = choice
    chat["parallel_tool_calls"] = bool_field(body, "parallel_tool_calls")
    return {k: v for k, v in chat.items() if v is not None}


def _tool(tool: Any, i: int) -> dict:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise InvalidParam(
            "tools",
            f"tools[{i}] is {shown(tool if kind is None else kind)}; this server serves "
            "function tools only ({type: function, name, parameters})",
        )
    for key, value in tool.items():
        if key not in FUNCTION_KEYS and value is not None:
            raise InvalidParam(
                "tools",
                f"tools[{i}].{key} is not taken here; a function tool takes "
                f"{', '.join(sorted(FUNCTION_KEYS))}",
            )
    # In the order given: the template renders the tool as JSON.
    fn = {k: v for k, v in tool.items() if k != "type" and v is not None}
    return {"type": "function", "function": fn}


def _messages(body: dict) -> list[dict]:
    """`instructions`, then `input`'s items, as chat messages: an assistant's text, reasoning
    and calls in one message, each call's output a tool message."""
    turns = Turns()
    instructions = str_field(body, "instructions")
    if instructions is not None:
        turns.add({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        turns.add({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            turns.item(item, i)
    else:
        raise InvalidParam("input", f"input is {shown(given)}; it must be text or a list of items")
    return turns.close()


class Turns:
    """Input items gathered into chat messages: consecutive calls join the assistant message
    before them; a reasoning item goes with the assistant message after it."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.reasoning = ""  # for the next assistant message
        self.joinable = False  # the last message is an assistant's that calls may join
        self.names: dict[str, str] = {}  # call id -> the function it called

    def add(self, message: dict) -> None:
        self.messages.append(message)
        self.joinable = False

    def item(self, item: Any, i: int) -> None:
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidParam("input", f"{where} is {shown(item)}; each item is an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._call(item, where)
        elif kind == "function_call_output":
            self._output(item, where)
        elif kind == "reasoning":
            self._reasoning(item, where)
        elif kind == "item_reference":
            raise InvalidParam(
                "input", f"{where} is an item_reference; this server keeps no items to refer to"
            )
        else:
            raise InvalidParam(
                "input",
                f"{where} is of type {shown(kind)}; this server takes message, function_call, "
                "function_call_output and reasoning items",
            )

    def _message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidParam(
                "input", f"{where}.role is {shown(role)}; use user, system, developer or assistant"
            )
        content = _content(item.get("content"), where)
        if ROLES[role] != "assistant":
            self.add({"role": ROLES[role], "content": content})
            return
        self._assistant({"role": "assistant", "content": content})

    def _assistant(self, message: dict) -> None:
        if self.reasoning:
            message["reasoning_content"], self.reasoning = self.reasoning, ""
        self.add(message)
        self.joinable = True

    def _call(self, item: dict, where: str) -> None:
        call_id = _text(item, "call_id", where)
        name = _text(item, "name", where)
        arguments = _text(item, "arguments", where)
        self.names[call_id] = name
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        if self.joinable and not self.reasoning:
            self.messages[-1].setdefault("tool_calls", []).append(call)
            return
        self._assistant({"role": "assistant", "content": "", "tool_calls": [call]})

    def _output(self, item: dict, where: str) -> None:
        call_id = _text(item, "call_id", where)
        output = item.get("output")
        text = output if isinstance(output, str) else _joined(output, f"{where}.output")
        message = {"role": "tool", "content": text, "tool_call_id": call_id}
        if call_id in self.names:
            message["name"] = self.names[call_id]
        self.add(message)

    def _reasoning(self, item: dict, where: str) -> None:
        if item.get("encrypted_content") is not None:
            raise InvalidParam(
                "input",
                f"{where}.encrypted_content is given; this server writes no encrypted reasoning "
                "and reads none (send the reasoning's content)",
            )
        parts = item.get("content") or item.get("summary") or []
        if not isinstance(parts, list):
            raise InvalidParam("input", f"{where}.content is {shown(parts)}; it must be a list")
        texts = [
            _text(p, "text", f"{where}.content[{j}]") if isinstance(p, dict) else p
            for j, p in enumerate(parts)
        ]
        if not all(isinstance(t, str) for t in texts):
            raise InvalidParam("input", f"{where}.content must be a list of text parts")
        self.reasoning += "\n".join(texts)
        self.joinable = False

    def close(self) -> list[dict]:
        """The messages; reasoning that no assistant item followed stands as its own."""
        if self.reasoning:
            self._assistant({"role": "assistant", "content": ""})
        return self.messages


def _text(obj: dict, key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise InvalidParam("input", f"{where}.{key} is {shown(value)}; it must be a string")
    return value


def _content(content: Any, where: str) -> str | list[ContentPart]:
    """A message's text: a string, or text parts joined with newlines (as the chat endpoint
    joins them), a refusal part's text too; or, when it holds an `input_image`, its parts in
    order. Files and audio are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParam(
            "input", f"{where}.content is {shown(content)}; it must be text or a list of parts"
        )
    parts = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
    if any(p.image is not None for p in parts):
        return parts
    return "\n".join(p.text for p in parts)


def _joined(content: Any, where: str) -> str:
    """A function call's output: text, or text parts."""
    parts = _content(content, where)
    if not isinstance(parts, str):
        raise InvalidParam(
            "input", f"{where} holds an image; this server takes images in a message's content"
        )
    return parts


def _part(part: Any, here: str) -> ContentPart:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        return ContentPart(text=_text(part, "text", here))
    if kind == "refusal":
        return ContentPart(text=_text(part, "refusal", here))
    if kind == "input_image":
        return ContentPart(image=ImagePart(url=_image_url(part, here), where=here))
    if kind in MEDIA_PARTS:
        raise InvalidParam(
            "input", f"{here} is of type {kind}; this server takes text and input_image parts"
        )
    raise InvalidParam(
        "input",
        f"{here} is {shown(part)}; this server takes input_text, output_text and input_image parts",
    )


def _image_url(part: dict, here: str) -> str:
    unknown = sorted(set(part) - IMAGE_KEYS)
    if unknown:
        raise InvalidParam("input", f"{here}.{unknown[0]} is not taken by an input_image")
    if part.get("file_id") is not None:
        raise InvalidParam(
            "input", f"{here}.file_id is given; this server keeps no files: send image_url"
        )
    detail = part.get("detail")
    if detail not in (None, "auto"):
        raise InvalidParam(
            "input",
            f"{here}.detail is {shown(detail)}; {DETAIL_AUTO}",
        )
    return _text(part, "image_url", here)


def _echo(body: dict, ask: Ask) -> dict[str, Any]:
    """The request's settings as a response carries them, in the Responses API's shapes; a
    value JSON cannot write back (NaN, an infinity, an unpaired surrogate) is refused."""
    r, s = ask.request, ask.request.sampling
    choice: str | dict = r.tool_choice or "auto"
    if choice not in CHOICES:
        choice = {"type": "function", "name": choice}
    tools = [{"type": "function", **t["function"]} for t in json.loads(r.tools or "[]")]
    echo = {
        "instructions": str_field(body, "instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": None,
        "metadata": _metadata(body),
        "parallel_tool_calls": r.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "background": False,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": choice,
        "tools": tools,
        "top_logprobs": 0,
        "truncation": "disabled",
        "user": str_field(body, "user"),
    }
    for key, value in echo.items():
        try:
            json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (ValueError, UnicodeEncodeError, RecursionError):
            raise InvalidParam(
                key,
                f"{key} holds a value JSON cannot carry back (NaN, an infinity, an unpaired "
                "surrogate, or nesting past what this server writes)",
            ) from None
    return echo


def _metadata(body: dict) -> dict[str, str]:
    """OpenAI's metadata: keys to strings, which the response carries back as given."""
    metadata = object_field(body, "metadata") or {}
    if not all(isinstance(v, str) for v in metadata.values()):
        raise InvalidParam("metadata", "metadata must map keys to strings")
    return metadata
