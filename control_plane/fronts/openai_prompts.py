"""An OpenAI request's prompt: text, token ids or a batch of either (completions), or
messages with their parts, calls and tool results (chat), as `RequestParams` fields."""

from __future__ import annotations

from typing import Any

from control_plane.fronts.openai_fields import (
    InvalidParam,
    bool_field,
    ids_field,
    is_int,
    json_text,
    object_field,
    shown,
    str_field,
)
from control_plane.text.chat import KWARGS
from protos.params import ChatMessage

# Content parts of other media than text, and why none is taken.
MEDIA_PARTS = {
    "image_url": "the checkpoint's vision tower is not loaded",
    "video_url": "the checkpoint's vision tower is not loaded",
    "input_audio": "no audio encoder is loaded",
}


def prompt_fields(body: dict) -> dict[str, Any]:
    """The first prompt (`prompts_fields` reads them all)."""
    return prompts_fields(body)[0]


def prompts_fields(body: dict) -> list[dict[str, Any]]:
    """Text, token ids, or a batch of either (each a prompt of its own)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
        return [_one_prompt(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise InvalidParam(
        "prompt",
        f"prompt is {shown(prompt)}; it must be text, a list of token ids, or a non-empty "
        "list of either",
    )


def check_batch(body: Any, most: int) -> None:
    """A completions batch of at most `most` prompts, counted before any is read; `most` is
    what the wait queue holds, so a larger batch could never be taken whole."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and len(prompt) > most and not _is_ids(prompt):
        raise InvalidParam(
            "prompt",
            f"prompt holds {len(prompt)} prompts; this server takes at most {most} "
            "at once, what its queue holds (--max-queue)",
        )


def check_choices(prompts: int, n: int, most: int) -> None:
    """n choices for each of `prompts` prompts, each a request: at most `most` in all."""
    if prompts * n > most:
        held = f"{prompts} prompts: {prompts * n} requests" if prompts > 1 else "one prompt"
        raise InvalidParam(
            "n",
            f"n is {n} for {held}; this server takes at most {most} at once, what its queue "
            "holds (--max-queue)",
        )


def _is_ids(values: list) -> bool:
    return all(is_int(t) for t in values)


def _one_prompt(prompt: str | list, where: str) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if _is_ids(prompt):
        return {"prompt_token_ids": tuple(ids_field(prompt, "prompt"))}
    raise InvalidParam(
        "prompt", f"{where} is {shown(prompt)}; it must be text or a list of token ids"
    )


def messages_fields(body: dict) -> dict[str, Any]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidParam("messages", "messages must be a non-empty list of {role, content}")
    out = [_message(m, i) for i, m in enumerate(messages)]
    kwargs = object_field(body, KWARGS)
    text = "" if kwargs is None else json_text(kwargs, KWARGS)
    return {
        "messages": tuple(out),
        "add_generation_prompt": bool_field(body, "add_generation_prompt"),
        "chat_template_kwargs": text,
        "chat_template": str_field(body, "chat_template") or "",
        "continue_final_message": bool(bool_field(body, "continue_final_message")),
    }


def _message(m: Any, i: int) -> ChatMessage:
    """One message: its role and text, an assistant's calls and reasoning, a tool result's
    call id and name."""
    role = m.get("role") if isinstance(m, dict) else None
    if not isinstance(role, str):
        raise InvalidParam("messages", f"messages[{i}] has no role; each needs one")
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise InvalidParam(
            "messages", f"messages[{i}].tool_calls is {shown(calls)}; it must be a list"
        )
    where = f"messages[{i}]."
    return ChatMessage(
        role,
        _content(m.get("content"), i),
        tool_calls=json_text(calls, f"messages[{i}].tool_calls") if calls else "",
        tool_call_id=str_field(m, "tool_call_id", where + "tool_call_id") or "",
        name=str_field(m, "name", where + "name") or "",
        # vLLM takes `reasoning` too.
        reasoning_content=str_field(m, "reasoning_content", where + "reasoning_content")
        or str_field(m, "reasoning", where + "reasoning")
        or "",
    )


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or text parts, joined with newlines as vLLM joins them."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidParam(
            "messages", f"messages[{i}].content is {shown(content)}; it must be text or parts"
        )
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind in MEDIA_PARTS:
            raise InvalidParam(
                "messages",
                f"messages[{i}].content[{j}] is of type {kind}; this server serves text only "
                f"({MEDIA_PARTS[kind]})",
            )
        if kind != "text":
            raise InvalidParam(
                "messages",
                f"messages[{i}].content[{j}] is {shown(part)}; this server takes text parts only",
            )
    texts = [
        str_field(p, "text", f"messages[{i}].content[{j}].text") for j, p in enumerate(content)
    ]
    return "\n".join(t or "" for t in texts)
