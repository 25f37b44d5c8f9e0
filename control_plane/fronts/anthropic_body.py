"""Anthropic Messages bodies (`POST /v1/messages` and `/v1/messages/count_tokens`) as the chat
front's: each field is checked in Anthropic's names, then the body is written as an OpenAI chat
body that `openai_body` reads as it reads any (as vLLM converts one to the other), so that a knob
has one reading.

`system` (text or text blocks) leads as a system message; a message's content is text or
blocks: `text`, a user's `image` (base64, or a URL the admission reads as the chat front's
`image_url`), an assistant's `tool_use` (its `tool_calls`) and `thinking` (its reasoning), a
user's `tool_result` (a `tool` message of its own, in its place among the texts). Consecutive
turns of one role are combined into one, as Anthropic combines them; a last assistant turn is
continued (prefill). `tool_choice` `auto`, `any` (required), `tool` (a named one) and `none`,
with `disable_parallel_tool_use`; `thinking` sets the template's `enable_thinking` where it
has that switch (refused where it cannot be honoured), its `budget_tokens` the reasoning's
budget (vLLM's `thinking_token_budget`). Every field is read, set aside as one that changes no
output (`INERT`: bookkeeping, routing, prompt-cache marks, which this server's prefix cache
makes needless), or refused with a sentence naming it: nothing is dropped."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from control_plane.admission.refusal import BadRequest
from control_plane.fronts.openai_body import BUDGET, Ask, chat_request, tokenize_request
from control_plane.fronts.openai_fields import (
    InvalidParam,
    bool_field,
    int_field,
    json_text,
    list_field,
    number_field,
    object_field,
    shown,
    str_field,
)
from control_plane.text.chat import KWARGS
from control_plane.text.tools import check_depth
from protos import checks
from protos.params import ContentPart, ImagePart, RequestParams

THINKING_SWITCH = "enable_thinking"  # the template variable Qwen's and others' templates read
# Tool names as `tools.read_tools` takes them (Anthropic's, and MCP's `server__tool`).
TOOL_NAME = re.compile(r"[\w.:-]+")
TOOL_CHOICES = ("auto", "any", "tool", "none")
THINKING_TYPES = ("enabled", "adaptive", "disabled")

# Fields that change no output: bookkeeping, routing, and prompt-cache marks (every prompt's
# prefix is cached here unasked).
INERT = frozenset(
    {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "user_profile_id"}
    | {"workspace_id"}
)
COUNT_INERT = frozenset({"cache_control", "speed", "user_profile_id", "workspace_id"})
# Fields of Anthropic's this server cannot serve, and why.
REFUSED = {
    "container": "runs no code-execution containers",
    "mcp_servers": "connects to no MCP servers",
    "context_management": "edits no context on its side",
    "diagnostics": "keeps no earlier requests to compare",
    "output_format": "takes a format as output_config.format",
}
CHAT = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})
# `speculative` (this server's own) and vLLM's `chat_template_kwargs` beside Anthropic's.
OWN = frozenset({"speculative", KWARGS, "output_config"})
COUNT_READ = CHAT | {KWARGS, "output_config"}
READ = CHAT | OWN | {"max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k"}

# A block's keys by its type; a block of another type is refused (documents: this server
# takes text and images; server tools' blocks: it runs none).
BLOCK_KEYS = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "image": frozenset({"type", "source", "cache_control"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
}
BLOCK_ROLES = {
    "tool_use": "assistant",
    "thinking": "assistant",
    "tool_result": "user",
    "image": "user",
}
MEDIA = {"document", "search_result"}
TOOL_KEYS = frozenset(
    {"type", "name", "description", "input_schema", "cache_control", "strict"}
    | {"eager_input_streaming", "input_examples", "defer_loading", "allowed_callers"}
)


@dataclasses.dataclass(frozen=True)
class ThinkingSwitch:
    """What the served chat template does with reasoning."""

    reasons: bool  # its output may open a reasoning block
    switch: bool  # it reads `enable_thinking`


@dataclasses.dataclass(frozen=True)
class MessagesAsk:
    """One Messages request: the chat front's `Ask`, and what shapes its reply."""

    ask: Ask
    model: str | None  # None or "": the served one
    stream: bool
    stop_sequences: tuple[str, ...]  # reported as `stop_sequence` when one ends the text
    show_thinking: bool = True  # `display: omitted`: thinking blocks come without their text
    lazy_tools: frozenset[str] = frozenset()  # `eager_input_streaming: false`: input whole


def messages_request(body: Any, template: ThinkingSwitch | None) -> MessagesAsk:
    """A `/v1/messages` body; `InvalidParam` with a sentence naming the field. `template`:
    what the served template does with reasoning (None: not known here)."""
    body = _object(body)
    _refuse_unsupported(body, READ, INERT)
    if body.get("max_tokens") is None:
        raise InvalidParam("max_tokens", "max_tokens is required")
    if int_field(body, "max_tokens") == 0:
        raise InvalidParam(
            "max_tokens", "max_tokens is 0; this server does not pre-warm caches: ask for a token"
        )
    chat, show, lazy = _chat(body, template)
    budget = chat.get(BUDGET)
    if budget is not None and budget >= body["max_tokens"]:
        raise InvalidParam(
            "max_tokens",
            f"max_tokens ({body['max_tokens']}) must be greater than thinking.budget_tokens "
            f"({budget}), as the reasoning counts within it",
        )
    stops = _stop_sequences(body)
    for name in ("temperature", "top_p"):
        value = number_field(body, name)
        if value is not None and not 0 <= value <= 1:
            raise InvalidParam(name, f"{name} is {value}; it must be from 0 to 1")
    top_k = int_field(body, "top_k")
    chat |= {
        "max_tokens": body["max_tokens"],
        "stop": list(stops),
        # The stop string stays in the text until the reply reports it (`stop_sequence`).
        "include_stop_str_in_output": bool(stops),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": top_k,
        "speculative": body.get("speculative"),
        "response_format": _format(body),
    }
    if chat["response_format"] is not None and chat["tool_choice"] not in (None, "auto", "none"):
        raise InvalidParam(
            "output_config.format",
            "output_config.format and tool_choice (any or tool) both constrain the output; "
            "give one",
        )
    ask = renamed(chat_request, chat)
    return MessagesAsk(
        ask,
        str_field(body, "model"),
        bool(bool_field(body, "stream")),
        stops,
        show,
        lazy,
    )


def count_request(body: Any, template: ThinkingSwitch | None) -> RequestParams:
    """A `/v1/messages/count_tokens` body: the prompt a `/v1/messages` body of these fields
    renders."""
    body = _object(body)
    _refuse_unsupported(body, COUNT_READ, COUNT_INERT)
    _format(body)
    chat, _, _ = _chat(body, template)
    # The choice shapes the output, not the prompt (its grammar is not built for a count).
    chat.pop("tool_choice")
    chat.pop("parallel_tool_calls")
    chat.pop(BUDGET, None)
    params, _ = renamed(tokenize_request, chat)
    return params


def renamed(read: Callable[[dict], Any], chat: dict) -> Any:
    """`read(chat)`, its refusals naming Anthropic's fields where the chat front's differ."""
    try:
        return read(chat)
    except BadRequest as e:
        raise anthropic_named(e) from None


OPENAI_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}


def anthropic_named(e: BadRequest) -> BadRequest:
    """A refusal of the chat front or the `Door` in Anthropic's field names."""
    own = OPENAI_NAMES.get(e.param or "")
    if own is None:
        return e
    message = str(e)
    if message.startswith(e.param or ""):
        message = own + message[len(e.param or "") :]
    return InvalidParam(own, message, e.code, getattr(e, "status", None))


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise InvalidParam(None, "the body must be a JSON object")
    return body


def _refuse_unsupported(body: dict, read: frozenset[str], inert: frozenset[str]) -> None:
    for name, value in body.items():
        if name in read or name in inert or value is None:
            continue
        if name in REFUSED:
            raise InvalidParam(name, f"{name} is not served: this server {REFUSED[name]}")
        raise InvalidParam(
            name, f"{name} is not a parameter of this endpoint; this server does not take it"
        )


def _chat(body: dict, template: ThinkingSwitch | None) -> tuple[dict, bool, frozenset[str]]:
    """The OpenAI chat fields of the body: messages, tools, tool choice, template variables,
    the reasoning's budget; whether thinking shows, and the tools whose input comes whole."""
    if body.get("model") is None:
        raise InvalidParam("model", "model is required")
    str_field(body, "model")
    tools, lazy, strict = _tools(body)
    choice, parallel = _tool_choice(body, tools)
    if strict and choice in (None, "auto"):
        raise InvalidParam(
            "tools",
            f"tools[{strict[0]}].strict is true; this server holds calls to their schema only "
            'when tool_choice is "any" or names the tool',
        )
    kwargs = dict(object_field(body, KWARGS) or {})
    show, budget = _thinking(body, template, kwargs)
    messages = _messages(body)
    last = messages[-1]["role"] == "assistant"
    chat: dict[str, Any] = {
        "messages": messages,
        "tools": [_openai_tool(t) for t in tools.values()] or None,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        KWARGS: kwargs or None,
        "add_generation_prompt": not last,
        "continue_final_message": last,
    }
    if budget is not None:
        chat[BUDGET] = budget
    return chat, show, lazy


def _tools(body: dict) -> tuple[dict[str, dict], frozenset[str], list[int]]:
    """The tools by name (each checked as Anthropic defines a client tool), the names whose
    input streams whole, and the places of the strict ones."""
    tools: dict[str, dict] = {}
    lazy, strict = set(), []
    for i, tool in enumerate(list_field(body, "tools")):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidParam("tools", f"{where} is {shown(tool)}; it must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise InvalidParam(
                "tools",
                f"{where} is Anthropic's server tool {shown(kind)}; this server runs no tools: "
                "define it as a client tool, with an input_schema",
            )
        _keys(tool, TOOL_KEYS, where, "tools")
        name = str_field(tool, "name", f"{where}.name")
        if not name or not TOOL_NAME.fullmatch(name):
            raise InvalidParam("tools", f"{where}.name must be letters, digits, _ . : or -")
        if name in tools:
            raise InvalidParam("tools", f"{where}.name {name!r} names a tool twice")
        schema = object_field(tool, "input_schema", f"{where}.input_schema")
        if schema is None:
            raise InvalidParam("tools", f"{where}.input_schema is required")
        try:
            check_depth(schema, f"{where}.input_schema")
        except ValueError as e:
            raise InvalidParam("tools", str(e)) from None
        str_field(tool, "description", f"{where}.description")
        _tool_options(tool, where)
        if bool_field(tool, "strict", f"{where}.strict"):
            strict.append(i)
        if bool_field(tool, "eager_input_streaming", f"{where}.eager_input_streaming") is False:
            lazy.add(name)
        tools[name] = tool
    return tools, frozenset(lazy), strict


def _tool_options(tool: dict, where: str) -> None:
    """The options of a client tool this server does not serve, refused when set."""
    if tool.get("input_examples"):
        raise InvalidParam(
            "tools", f"{where}.input_examples is not served: the chat template shows no examples"
        )
    if tool.get("defer_loading"):
        raise InvalidParam(
            "tools", f"{where}.defer_loading is true; this server has no tool search"
        )
    callers = tool.get("allowed_callers")
    if callers is not None and callers != ["direct"]:
        raise InvalidParam(
            "tools",
            f"{where}.allowed_callers is {shown(callers)}; only the model calls tools here "
            '(["direct"])',
        )


def _openai_tool(tool: dict) -> dict:
    fn = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(body: dict, tools: dict[str, dict]) -> tuple[str | dict | None, bool | None]:
    """Anthropic's `tool_choice` as the chat front's, and `parallel_tool_calls`."""
    choice = object_field(body, "tool_choice")
    if choice is None:
        return None, None
    _keys(choice, frozenset({"type", "name", "disable_parallel_tool_use"}), "tool_choice")
    kind = choice.get("type")
    if kind not in TOOL_CHOICES:
        raise InvalidParam(
            "tool_choice",
            f"tool_choice.type is {shown(kind)}; use {', '.join(TOOL_CHOICES)}",
        )
    single = bool_field(
        choice, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use"
    )
    if kind in ("any", "tool") and not tools:
        raise InvalidParam("tool_choice", f"tool_choice is {kind!r}; the request has no tools")
    if kind == "tool":
        name = str_field(choice, "name", "tool_choice.name")
        if name not in tools:
            names = ", ".join(sorted(tools))
            raise InvalidParam(
                "tool_choice",
                f"tool_choice.name is {shown(name)}, not one of the request's tools ({names})",
            )
        return {"type": "function", "function": {"name": name}}, False if single else None
    if choice.get("name") is not None:
        raise InvalidParam("tool_choice", f"tool_choice.name goes with type tool, not {kind!r}")
    openai = {"any": "required", "auto": "auto", "none": "none"}[kind]
    return openai, False if single else None


def _thinking(body: dict, template: ThinkingSwitch | None, kwargs: dict) -> tuple[bool, int | None]:
    """`thinking` onto the template's switch (in `kwargs`): whether thinking text shows, and
    the reasoning's budget of tokens (vLLM's `thinking_token_budget`: its block is closed once
    they are spent)."""
    thinking = object_field(body, "thinking")
    if thinking is None:
        return True, None
    _keys(thinking, frozenset({"type", "budget_tokens", "display"}), "thinking")
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise InvalidParam(
            "thinking", f"thinking.type is {shown(kind)}; use {', '.join(THINKING_TYPES)}"
        )
    budget = int_field(thinking, "budget_tokens", "thinking.budget_tokens")
    if budget is not None and kind != "enabled":
        raise InvalidParam("thinking", f"thinking.budget_tokens goes with type enabled, not {kind}")
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise InvalidParam(
            "thinking", f"thinking.display is {shown(display)}; use summarized or omitted"
        )
    if kind != "adaptive":
        _switch(kind == "enabled", template, kwargs)
    return display != "omitted", budget


def _switch(on: bool, template: ThinkingSwitch | None, kwargs: dict) -> None:
    """The template's thinking switch set, where it has one; refused where it cannot be."""
    kind = "enabled" if on else "disabled"
    if template is not None and on and not template.reasons:
        raise InvalidParam(
            "thinking",
            "thinking.type is enabled; the served model's chat template writes no reasoning",
        )
    if template is not None and not on and template.reasons and not template.switch:
        raise InvalidParam(
            "thinking",
            "thinking.type is disabled; the served model's chat template always reasons "
            f"(it reads no {THINKING_SWITCH})",
        )
    if template is not None and not template.switch:
        return
    if kwargs.get(THINKING_SWITCH, on) != on:
        raise InvalidParam(
            "thinking",
            f"thinking.type is {kind}; {KWARGS}.{THINKING_SWITCH} says otherwise: give one",
        )
    kwargs[THINKING_SWITCH] = on


def _format(body: dict) -> dict | None:
    """`output_config.format` (a JSON schema) as the chat front's `response_format`;
    `effort` refused."""
    config = object_field(body, "output_config")
    if config is None:
        return None
    _keys(config, frozenset({"effort", "format"}), "output_config")
    if config.get("effort") is not None:
        raise InvalidParam(
            "output_config.effort",
            f"output_config.effort is {shown(config['effort'])}; this server has no reasoning "
            "effort (thinking turns the template's reasoning on or off)",
        )
    form = object_field(config, "format", "output_config.format")
    if form is None:
        return None
    _keys(form, frozenset({"type", "schema"}), "output_config.format")
    schema = form.get("schema")
    if form.get("type") != "json_schema" or not isinstance(schema, dict):
        raise InvalidParam(
            "output_config.format",
            f"output_config.format is {shown(form)}; it must be "
            '{"type": "json_schema", "schema": {...}}',
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _stop_sequences(body: dict) -> tuple[str, ...]:
    stops = list_field(body, "stop_sequences")
    if not all(isinstance(s, str) for s in stops):
        raise InvalidParam(
            "stop_sequences", f"stop_sequences is {shown(stops)}; it must be a list of strings"
        )
    if (problem := checks.limit_problem("stop", len(stops))) is not None:
        raise InvalidParam("stop_sequences", "stop_sequences" + problem[len("stop") :])
    chars = sum(len(s) for s in stops)
    if (problem := checks.limit_problem("stop_chars", chars)) is not None:
        raise InvalidParam("stop_sequences", "stop_sequences" + problem[len("stop") :])
    return tuple(s for s in stops if s)


def _keys(obj: dict, known: frozenset[str], where: str, param: str | None = None) -> None:
    """Every key of `obj` is one of `known`, or null."""
    for key, value in obj.items():
        if key not in known and value is not None:
            raise InvalidParam(
                param or where, f"{where}.{key} is not taken here; this server does not serve it"
            )


def _messages(body: dict) -> list[dict]:
    """`system` and the messages as the chat front's, consecutive turns of a role combined."""
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise InvalidParam("messages", "messages must be a non-empty list of {role, content}")
    turns: list[tuple[str, list[dict]]] = []
    for i, message in enumerate(given):
        role, blocks = _turn(message, i)
        if turns and turns[-1][0] == role != "system":
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    out = []
    system = _system(body.get("system"))
    if system is not None:
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}  # tool_use id -> its tool's name, for the results
    for role, blocks in turns:
        if role == "assistant":
            out.append(_assistant(blocks, names))
        elif role == "user":
            out += _user(blocks, names)
        else:
            out.append({"role": role, "content": _joined(b["text"] for b in blocks)})
    return out


def _system(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise InvalidParam("system", f"system is {shown(system)}; it must be text or text blocks")
    return _joined(
        _block(b, "system", f"system[{j}]", "text")["text"] for j, b in enumerate(system)
    )


def _turn(message: Any, i: int) -> tuple[str, list[dict]]:
    """One message's role and blocks, each checked."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidParam("messages", f"{where} is {shown(message)}; it must be {{role, content}}")
    _keys(message, frozenset({"role", "content"}), where, "messages")
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise InvalidParam(
            "messages", f"{where}.role is {shown(role)}; it must be user, assistant or system"
        )
    content = message.get("content")
    if isinstance(content, str):
        return role, [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidParam(
            "messages", f"{where}.content is {shown(content)}; it must be text or blocks"
        )
    only = "text" if role == "system" else None
    return role, [_block(b, role, f"{where}.content[{j}]", only) for j, b in enumerate(content)]


def _block(block: Any, role: str, where: str, only: str | None = None) -> dict:
    """One content block, checked: its type served, in a role that may hold it, its keys
    known."""
    kind = block.get("type") if isinstance(block, dict) else None
    param = "system" if role == "system" and where.startswith("system") else "messages"
    if not isinstance(kind, str):
        raise InvalidParam(param, f"{where} is {shown(block)}; a block is {{type, ...}}")
    if kind in MEDIA:
        raise InvalidParam(param, f"{where} is a {kind} block; this server takes text and images")
    if kind == "image" and only is not None:
        raise InvalidParam(
            param, f"{where} is an image block; this server takes images in a user's message only"
        )
    if kind == "redacted_thinking":
        raise InvalidParam(
            param, f"{where} is a redacted_thinking block; this server cannot read one"
        )
    if kind not in BLOCK_KEYS or (only is not None and kind != only):
        raise InvalidParam(
            param,
            f"{where} is a {shown(kind)} block; this server takes text, tool_use, tool_result and "
            "thinking blocks (it runs no server tools)",
        )
    owner = BLOCK_ROLES.get(kind)
    if owner is not None and owner != role:
        raise InvalidParam(param, f"{where} is a {kind} block, which only a {owner} message holds")
    _keys(block, BLOCK_KEYS[kind], where, param)
    return _checked(block, kind, where, param)


def _checked(block: dict, kind: str, where: str, param: str) -> dict:
    """A block's own fields, typed."""
    if kind == "text":
        if block.get("citations"):
            raise InvalidParam(param, f"{where}.citations is not served: this server cites nothing")
        text = str_field(block, "text", f"{where}.text")
        return {"type": kind, "text": text or ""}
    if kind == "thinking":
        return {"type": kind, "text": str_field(block, "thinking", f"{where}.thinking") or ""}
    if kind == "image":
        return {"type": kind, "part": ContentPart(image=_image(block.get("source"), where))}
    if kind == "tool_use":
        caller = block.get("caller")
        if caller is not None and caller != {"type": "direct"}:
            raise InvalidParam(param, f"{where}.caller is {shown(caller)}; only the model calls")
        args = object_field(block, "input", f"{where}.input")
        return {
            "type": kind,
            "id": str_field(block, "id", f"{where}.id") or "",
            "name": str_field(block, "name", f"{where}.name") or "",
            "arguments": json_text(args or {}, param),
        }
    bool_field(block, "is_error", f"{where}.is_error")
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        parts = [_block(b, "user", f"{where}.content[{k}]", "text") for k, b in enumerate(content)]
        text = _joined(p["text"] for p in parts)
    else:
        raise InvalidParam(param, f"{where}.content is {shown(content)}; it must be text or blocks")
    return {
        "type": kind,
        "id": str_field(block, "tool_use_id", f"{where}.tool_use_id") or "",
        "text": text,
    }


def _assistant(blocks: list[dict], names: dict[str, str]) -> dict:
    calls = [b for b in blocks if b["type"] == "tool_use"]
    for call in calls:
        names[call["id"]] = call["name"]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": _joined(b["text"] for b in blocks if b["type"] == "text"),
    }
    reasoning = _joined(b["text"] for b in blocks if b["type"] == "thinking")
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in calls
        ]
    return message


def _image(source: Any, where: str) -> ImagePart:
    """An image block's source: base64 data (as a data: URL, which the admission decodes) or
    a URL, which it reads as the chat front's `image_url` (http(s) refused there)."""
    kind = source.get("type") if isinstance(source, dict) else None
    where_source = f"{where}.source"
    if kind == "base64":
        mime = str_field(source, "media_type", f"{where_source}.media_type")
        data = str_field(source, "data", f"{where_source}.data")
        return ImagePart(url=f"data:{mime or ''};base64,{data or ''}", where=where)
    if kind == "url":
        return ImagePart(url=str_field(source, "url", f"{where_source}.url") or "", where=where)
    if kind == "file":
        raise InvalidParam(
            "messages", f"{where_source} is a file; this server keeps no files: send base64 data"
        )
    raise InvalidParam(
        "messages",
        f"{where_source} is {shown(source)}; it must be {{type: base64, media_type, data}} or "
        "{type: url, url}",
    )


def _user(blocks: list[dict], names: dict[str, str]) -> list[dict]:
    """A user turn: its texts and images, and each tool result as a `tool` message in its
    place."""
    out: list[dict] = []
    held: list[dict] = []  # text and image blocks, up to the next tool result
    for block in blocks:
        if block["type"] in ("text", "image"):
            held.append(block)
            continue
        if held:
            out.append({"role": "user", "content": _user_content(held)})
            held = []
        result = {"role": "tool", "tool_call_id": block["id"], "content": block["text"]}
        if block["id"] in names:
            result["name"] = names[block["id"]]
        out.append(result)
    if held or not out:
        out.append({"role": "user", "content": _user_content(held)})
    return out


def _user_content(blocks: list[dict]) -> str | list[ContentPart]:
    """Texts joined, or, with an image among them, the blocks as parts in order."""
    if any(b["type"] == "image" for b in blocks):
        return [b["part"] if b["type"] == "image" else ContentPart(text=b["text"]) for b in blocks]
    return _joined(b["text"] for b in blocks)


def _joined(texts: Any) -> str:
    """Blocks' texts as one, joined with newlines as the chat front joins text parts."""
    return "\n".join(texts)
