"""A request's prompt as token ids, checked against the served model: one of its three forms
(text, ids, a chat rendered by its template), bounded in bytes before it is tokenized and in
tokens by the context."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from control_plane.admission.chats import render
from control_plane.admission.refusal import INVALID, BadRequest
from control_plane.text.chat import KWARGS, ChatTemplate
from control_plane.text.detok import Tokenizer
from control_plane.text.reasoning import MAY_OPEN, OPENED
from control_plane.text.tools import THINK_CLOSE, THINK_OPEN
from protos.model import Capabilities
from protos.params import RequestParams

PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")  # a request gives exactly one


def prompt_text(
    r: RequestParams,
    chat: ChatTemplate | None,
    max_bytes: int,
    chat_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The text to tokenize: the prompt, or the chat rendered (never past `max_bytes`, with
    the server's template variables `chat_kwargs` under the request's); `BadRequest` for a
    request with more than one prompt field, or past the bound."""
    given = [name for name in PROMPT_FIELDS if getattr(r, name)]
    if len(given) > 1:
        raise BadRequest(
            INVALID,
            f"give one of prompt, prompt_token_ids and messages; this request has "
            f"{' and '.join(given)}",
            "prompt",
        )
    if r.chat_template_kwargs and not r.messages:
        raise BadRequest(
            INVALID,
            f"{KWARGS} are variables of the chat template; this request has no messages",
            KWARGS,
        )
    text = render(r, chat, max_bytes, chat_kwargs) if r.messages else r.prompt
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        field = "the rendered chat" if r.messages else "prompt"
        raise BadRequest(
            INVALID,
            f"{field} is {size} bytes; this server takes at most {max_bytes}",
            "messages" if r.messages else "prompt",
        )
    return text


def opened(r: RequestParams, text: str) -> bool:
    """Whether a chat's prompt ends inside a reasoning block its template opened."""
    return bool(r.messages) and text.rstrip().endswith(THINK_OPEN)


def reasoning_start(r: RequestParams, text: str, thinks: bool) -> str:
    """Where a chat's output starts (`reasoning.OPENED`, `MAY_OPEN` or "": no reasoning): in a
    block its prompt opened; where the model may open one, with a template that knows them and
    a prompt that ends at a new turn (not one closed by the template, as Qwen's thinking-off
    form is, nor a message continued)."""
    if not thinks or not r.messages:
        return ""
    if opened(r, text):
        return OPENED
    if r.continue_final_message or text.rstrip().endswith(THINK_CLOSE):
        return ""
    return MAY_OPEN


def prompt_ids(
    r: RequestParams,
    text: str,
    tokenizer: Tokenizer,
    caps: Capabilities,
    expand: Callable[[list[int]], list[int]] = list,
) -> list[int]:
    """The prompt's ids: the request's own, or `text` tokenized (a chat as transformers
    tokenizes one: its template wrote the special tokens), made the model's by `expand` (a
    chat's image placeholders, `media.expander`), cut as the request asks and checked against
    the context and the vocabulary."""
    ids = expand(list(r.prompt_token_ids) or tokenizer.encode(text))
    if not ids:
        raise BadRequest(INVALID, "the prompt is empty", "prompt")
    if r.truncate_prompt_tokens is not None:
        # 0: as many as the context holds with room for one more (vLLM's -1).
        keep = r.truncate_prompt_tokens or caps.max_context - 1
        ids = ids[-keep:]
    # Before the vocabulary scan: a context's worth at most.
    room(len(ids), caps, "messages" if r.messages else "prompt")
    check_vocab(
        "prompt_token_ids" if r.prompt_token_ids else "the tokenized prompt", ids, caps, "prompt"
    )
    return ids


def overflow_sentence(max_context: int, asked: int, prompt_len: int, new: int) -> str:
    """vLLM's sentence for a request of `asked` tokens in all past a context of
    `max_context`, `prompt_len` of them the prompt's."""
    return (
        f"This model's maximum context length is {max_context} tokens. However, you requested "
        f"{asked} tokens ({prompt_len} in the messages, {new} in the completion). Please reduce "
        "the length of the messages or completion."
    )


def room(prompt_len: int, caps: Capabilities, param: str = "messages") -> int:
    """Context positions left after the prompt, at least one."""
    left = caps.max_context - prompt_len
    if left < 1:
        sentence = overflow_sentence(caps.max_context, prompt_len + 1, prompt_len, 1)
        raise BadRequest(INVALID, sentence, param)
    return left


def check_vocab(
    field: str, ids: Iterable[int], caps: Capabilities, param: str | None = None
) -> None:
    bad = next((t for t in ids if t >= caps.vocab_size), None)
    if bad is not None:
        raise BadRequest(
            INVALID,
            f"{field} holds token id {bad}, outside the vocabulary (0 .. {caps.vocab_size - 1})",
            param or field,
        )
