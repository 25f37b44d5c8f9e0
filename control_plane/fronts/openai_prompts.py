"""An OpenAI request's prompt: text, token ids or a batch of either (completions), or
messages with their parts (text, images), calls and tool results (chat), as `RequestParams`
fields. An image part is read no further than its URL here: the admission's worker reads the
image (`control_plane/text/images.py`), and refuses it where the model has no vision tower."""

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
from protos.params import ChatMessage, ContentPart, ImagePart

# Content parts of media this server does not take, and why.
MEDIA_PARTS = {
    "video_url": "it reads no video",
    "input_audio": "no audio encoder is loaded",
}
IMAGE_URL_KEYS = frozenset({"url", "detail"})
# What an image's `detail` other than auto is refused with.
DETAIL_AUTO = (
    "this server sizes every image by the model's preprocessor (its least and most pixels), "
    "as detail auto"
)


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
    text, parts = _content(m.get("content"), i)
    return ChatMessage(
        role,
        text,
        tool_calls=json_text(calls, f"messages[{i}].tool_calls") if calls else "",
        tool_call_id=str_field(m, "tool_call_id", where + "tool_call_id") or "",
        name=str_field(m, "name", where + "name") or "",
        # vLLM takes `reasoning` too.
        reasoning_content=str_field(m, "reasoning_content", where + "reasoning_content")
        or str_field(m, "reasoning", where + "reasoning")
        or "",
        parts=parts,
    )


def _content(content: Any, i: int) -> tuple[str, tuple[ContentPart, ...]]:
    """A message's text (a string, or text parts joined with newlines as vLLM joins them), or,
    when it holds an image, its parts in order."""
    if content is None or isinstance(content, str):
        return content or "", ()
    if not isinstance(content, list):
        raise InvalidParam(
            "messages", f"messages[{i}].content is {shown(content)}; it must be text or parts"
        )
    parts = tuple(_part(p, f"messages[{i}].content[{j}]") for j, p in enumerate(content))
    if any(p.image is not None for p in parts):
        return "", parts
    return "\n".join(p.text for p in parts), ()


def _part(part: Any, where: str) -> ContentPart:
    """A text part, or an image part (`{"url": ...}` or the URL alone, `detail` auto); parts
    another front read already (Anthropic's blocks, the Responses API's items) pass as given."""
    if isinstance(part, ContentPart):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        return ContentPart(text=str_field(part, "text", f"{where}.text") or "")
    if kind == "image_url":
        return ContentPart(
            image=ImagePart(url=_image_url(part.get("image_url"), where), where=where)
        )
    if isinstance(kind, str) and kind in MEDIA_PARTS:
        raise InvalidParam(
            "messages",
            f"{where} is of type {kind}; this server takes text and images ({MEDIA_PARTS[kind]})",
        )
    raise InvalidParam(
        "messages", f"{where} is {shown(part)}; this server takes text and image_url parts"
    )


def _image_url(given: Any, where: str) -> str:
    where += ".image_url"
    if isinstance(given, str):
        return given
    if not isinstance(given, dict) or not isinstance(given.get("url"), str):
        raise InvalidParam(
            "messages", f"{where} is {shown(given)}; it must be {{url, detail}} or a URL"
        )
    unknown = sorted(set(given) - IMAGE_URL_KEYS)
    if unknown:
        raise InvalidParam("messages", f"{where}.{unknown[0]} is not taken; give url and detail")
    detail = given.get("detail")
    if detail not in (None, "auto"):
        raise InvalidParam(
            "messages",
            f"{where}.detail is {shown(detail)}; {DETAIL_AUTO}",
        )
    return given["url"]
