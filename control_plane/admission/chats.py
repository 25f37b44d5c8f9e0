"""A chat request as its template renders it: the messages (an assistant's calls with their
arguments as objects, a tool's result), the tools checked with `tool_choice`, and the grammar
a constraining `tool_choice` puts on the output, in the template's own call form."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from control_plane.admission.refusal import INVALID, BadRequest
from control_plane.text.chat import KWARGS, ChatTemplate, Refused, parse_kwargs
from control_plane.text.tools import call_grammar, check_choice, read_tools, template_form
from protos.params import ChatMessage, RequestParams


def check_tools(r: RequestParams) -> dict[str, dict[str, Any]]:
    """The request's tools by name, checked with its `tool_choice`."""
    if (r.tools or r.tool_choice) and not r.messages:
        raise BadRequest(
            INVALID, "tools and tool_choice go with messages; this request has none", "tools"
        )
    try:
        tools = read_tools(r.tools)
        check_choice(r.tool_choice, tools)
    except ValueError as e:
        # The sentence opens with the field it is about.
        field = "tool_choice" if str(e).startswith("tool_choice") else "tools"
        raise BadRequest(INVALID, str(e), field) from None
    return tools


def output_format(
    r: RequestParams, tools: dict[str, dict[str, Any]], chat: ChatTemplate | None
) -> tuple[str, str] | None:
    """The grammar the output follows: the calls a constraining `tool_choice` asks for, in
    the template's form, else the request's `response_format`. A forced call wins over a
    response format, as vLLM's tool parsers decide: the output is then the calls, with no text
    for the format to shape (pydantic-ai sends its output's schema beside a forced tool)."""
    if tools and chat is not None:
        parallel = r.parallel_tool_calls is not False
        calls = call_grammar(tools, r.tool_choice, template_form(chat.source), parallel)
        if calls is not None:
            return ("lark", calls)
    return r.response_format


def render(
    r: RequestParams,
    chat: ChatTemplate | None,
    max_bytes: int | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> str:
    """The request's messages as prompt text, by the model's chat template, never past
    `max_bytes` of UTF-8; `defaults` the server's template variables, which the request's
    own override name by name."""
    if chat is None:
        raise BadRequest(
            INVALID,
            "the model has no chat template, so it cannot take messages; send a prompt",
            "messages",
        )
    empty = next((i for i, m in enumerate(r.messages) if not m.role), None)
    if empty is not None:
        raise BadRequest(INVALID, f"messages[{empty}] has an empty role", "messages")
    if r.continue_final_message and r.add_generation_prompt:
        raise BadRequest(
            INVALID,
            "continue_final_message goes on with the last message; add_generation_prompt opens "
            "a new one: set one of them",
            "continue_final_message",
        )
    if r.continue_final_message and r.messages[-1].role != "assistant":
        raise BadRequest(
            INVALID,
            "continue_final_message goes on with an assistant's message; the last is not",
            "continue_final_message",
        )
    generation_prompt = not r.continue_final_message and r.add_generation_prompt is not False
    try:
        messages = [_message(m, i) for i, m in enumerate(r.messages)]
        tools = json.loads(r.tools) if r.tools else None  # checked by `check_tools` before
        kwargs = {**(defaults or {}), **parse_kwargs(r.chat_template_kwargs)}

        def rendered(chat_messages: list[dict[str, Any]]) -> str:
            assert chat is not None
            return chat.render(
                chat_messages, generation_prompt, kwargs, tools, r.continue_final_message, max_bytes
            )

        return _systems_merged_if_refused(messages, rendered)
    except ValueError as e:
        # The sentence opens with the field it is about, when it is not the messages.
        field = next((f for f in (KWARGS, "continue_final_message") if str(e).startswith(f)), None)
        raise BadRequest(INVALID, str(e), field or "messages") from None


def _systems_merged_if_refused(
    messages: list[dict[str, Any]], rendered: Callable[[list[dict[str, Any]]], str]
) -> str:
    """The chat rendered; where its template refuses it and it opens with several system
    messages, rendered again with them merged into one (their texts apart by a blank line), as
    clients that send several expect of templates that take one (Qwen3.5's, Qwen3.6's). A
    template that still refuses a chat with a system message after the first message is refused
    naming that message."""
    try:
        return rendered(messages)
    except Refused as refused:
        lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
        if lead > 1 and all(isinstance(m["content"], str) for m in messages[:lead]):
            joined = "\n\n".join(m["content"] for m in messages[:lead])
            merged = [{**messages[0], "content": joined}, *messages[lead:]]
            try:
                return rendered(merged)
            except Refused:
                pass
        late = next((i for i in range(lead, len(messages)) if messages[i]["role"] == "system"), 0)
        if not late:
            raise
        reason = str(refused).removeprefix("the chat template refuses these messages: ")
        raise ValueError(
            f"messages[{late}] is a system message after the conversation began; this model's "
            f"chat template takes system messages only at the start (it says: {reason}): send "
            "its text in the first system message, or as a user message"
        ) from None


def _message(m: ChatMessage, i: int) -> dict[str, Any]:
    """A message as templates read it: its calls' arguments as objects (vLLM hands them so:
    Qwen3.5's template iterates them), the optional fields only when given."""
    out: dict[str, Any] = {"role": m.role, "content": _content(m) if m.parts else m.content}
    if m.tool_calls:
        out["tool_calls"] = _calls(m.tool_calls, i)
    for name in ("tool_call_id", "name", "reasoning_content"):
        if value := getattr(m, name):
            out[name] = value
    return out


def _content(m: ChatMessage) -> list[dict[str, Any]]:
    """A message's parts as transformers hands them to a template: each text as a text item,
    each image as `{"type": "image"}`, whose placeholder the template writes in its place."""
    return [
        {"type": "text", "text": p.text} if p.image is None else {"type": "image"} for p in m.parts
    ]


def _calls(text: str, i: int) -> list[dict[str, Any]]:
    where = f"messages[{i}].tool_calls"
    try:
        calls = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{where} is not JSON text: {e}") from None
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}[{j}] must be {{id, type, function: {{name, arguments}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ValueError(f"{where}[{j}].function.arguments is not JSON text") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out
