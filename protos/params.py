"""What a client asks for, as the fronts hand it to the `Door`: `SamplingParams` (the sampler
and the logits processors) inside `RequestParams` (the prompt, the budget, the stops, the
speculative method, the output's format). The HTTP front builds them from a JSON body; the
gRPC front converts a `GenerateRequest` with `from_pb`. Their fields are `GenerateRequest`'s by
name (and vLLM's where it has the knob), so a new knob is a field here and on the wire, and
both conversions follow. Nothing here imports torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from google.protobuf.message import Message

from protos.met.v1 import generate_pb2 as pb
from protos.model import DFLASH as DFLASH  # a method's name as the drafter's
from protos.model import MTP_HEAD, Penalties

NONE, MTP, PROMPT_LOOKUP, AUTO = "none", MTP_HEAD, "prompt_lookup", "auto"
METHODS = {
    pb.SPECULATIVE_METHOD_NONE: NONE,
    pb.SPECULATIVE_METHOD_MTP: MTP,
    pb.SPECULATIVE_METHOD_PROMPT_LOOKUP: PROMPT_LOOKUP,
    pb.SPECULATIVE_METHOD_DFLASH: DFLASH,
    pb.SPECULATIVE_METHOD_AUTO: AUTO,
}
FORMATS = ("json_schema", "regex", "lark")  # `ResponseFormat`'s kinds


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 0 is taken as 1: no cut (proto3 cannot tell an unset float from 0)
    top_k: int = 0  # 0 or -1 (vLLM's): no limit
    min_p: float = 0.0  # 0: no cut
    seed: int | None = None  # the uniforms' generator; None: an unseeded one
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: none (1)
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> bias
    allowed_token_ids: tuple[int, ...] = ()  # when given, the only ids it may generate

    def __post_init__(self) -> None:
        object.__setattr__(self, "top_p", self.top_p or 1.0)


@dataclass(frozen=True)
class ImagePart:
    """An image in a message: its file's bytes with their MIME type, or a URL (`data:` or
    `file://`) the control plane reads (`control_plane/text/images.py`)."""

    data: bytes = b""
    mime_type: str = ""  # of `data`; empty: read from the bytes
    url: str = ""
    # The part's place in the client's request (`messages[0].content[1]`), which a refusal
    # names; the front that read it sets it (not on the wire: the gRPC front derives it).
    where: str = ""


@dataclass(frozen=True)
class ContentPart:
    """One part of a message's content: text, or an image."""

    text: str = ""
    image: ImagePart | None = None


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: str = ""  # an assistant's calls: OpenAI's tool_calls as JSON text
    tool_call_id: str = ""  # a tool's result: the call it answers
    name: str = ""  # a tool's result: the tool's name
    reasoning_content: str = ""  # an assistant's reasoning
    # The content as parts in order, for a message that holds images (`content` then empty).
    parts: tuple[ContentPart, ...] = ()

    @property
    def images(self) -> tuple[ImagePart, ...]:
        return tuple(p.image for p in self.parts if p.image is not None)


@dataclass(frozen=True)
class RequestParams:
    # Exactly one of prompt, prompt_token_ids and messages.
    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    add_generation_prompt: bool | None = None  # with messages; None: true
    chat_template_kwargs: str = ""  # with messages: a JSON object, as text
    max_new_tokens: int | None = None  # None: the server's default, cut to the context
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: alternatives listed beside each generated token
    request_id: str = ""
    method: str | None = None  # one of METHODS' names; None: the server's (--method)
    num_drafts: int | None = None  # None: the server's
    response_format: tuple[str, str] | None = None  # (one of FORMATS, its text)
    tools: str = ""  # with messages: OpenAI's tool definitions, a JSON array as text
    tool_choice: str = ""  # "", auto, none, required, or a tool's name
    parallel_tool_calls: bool | None = None  # with required or a name: False, one call
    truncate_prompt_tokens: int | None = None  # keep the prompt's last this many tokens
    include_stop_str_in_output: bool = False
    chat_template: str = ""  # with messages: in place of the model's
    continue_final_message: bool = False  # with messages: the last one goes on
    prompt_logprobs: int | None = None  # score the prompt, this many alternatives a row
    # vLLM's: the most tokens of reasoning before its close is forced (None: a forced output's
    # default, else no bound).
    thinking_token_budget: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)


def penalties(s: SamplingParams, prompt_tokens: int) -> Penalties:
    """The logits processors of `s` as the GPU service applies them to a sequence whose first
    `prompt_tokens` tokens are its prompt."""
    bias = sorted(s.logit_bias.items())
    return Penalties(
        presence=s.presence_penalty,
        frequency=s.frequency_penalty,
        repetition=1.0 if s.repetition_penalty is None else s.repetition_penalty,
        prompt_tokens=prompt_tokens,
        bias_ids=tuple(t for t, _ in bias),
        bias_values=tuple(b for _, b in bias),
        allowed_ids=s.allowed_token_ids,
    )


# Fields whose wire form is not theirs by name, written out in `from_pb` / `to_pb`.
_SPECIAL = frozenset({"messages", "method", "response_format", "sampling"})


def _value(msg: Message, name: str) -> Any:
    """A field by name: None when it has presence and is unset; repeated as a tuple, maps as
    a dict."""
    desc = msg.DESCRIPTOR.fields_by_name[name]
    value = getattr(msg, name)
    if desc.message_type is not None and desc.message_type.GetOptions().map_entry:
        return dict(value)
    if desc.is_repeated:
        return tuple(value)
    if desc.has_presence and not msg.HasField(name):
        return None
    return value


def _plain(cls: type, msg: Message, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    return {f.name: _value(msg, f.name) for f in fields(cls) if f.name not in skip}


def from_pb(r: pb.GenerateRequest) -> RequestParams:
    """A `GenerateRequest` as the fronts' parameters; `ValueError` with a sentence for a
    speculative method this server does not know."""
    if r.speculative_method not in (pb.SPECULATIVE_METHOD_UNSPECIFIED, *METHODS):
        raise ValueError(
            f"speculative_method {r.speculative_method} is unknown; use NONE, MTP, "
            "PROMPT_LOOKUP or DFLASH"
        )
    kind = r.response_format.WhichOneof("format") if r.HasField("response_format") else None
    sampling = {k: v for k, v in _plain(SamplingParams, r).items() if v is not None}
    return RequestParams(
        **_plain(RequestParams, r, _SPECIAL),
        messages=tuple(_message_from_pb(m, i) for i, m in enumerate(r.messages)),
        method=METHODS.get(r.speculative_method),
        response_format=None if kind is None else (kind, getattr(r.response_format, kind)),
        sampling=SamplingParams(**sampling),
    )


def to_pb(p: RequestParams) -> pb.GenerateRequest:
    """`from_pb` backwards."""
    codes = {name: code for code, name in METHODS.items()}
    plain = {
        **{k: v for k, v in dataclasses.asdict(p.sampling).items()},
        **{f.name: getattr(p, f.name) for f in fields(p) if f.name not in _SPECIAL},
    }
    r = pb.GenerateRequest(**{k: v for k, v in plain.items() if v is not None})
    r.messages.extend(_message_to_pb(m) for m in p.messages)
    if p.method is not None:
        r.speculative_method = codes[p.method]
    if p.response_format is not None:
        kind, text = p.response_format
        setattr(r.response_format, kind, text)
    return r


def _message_from_pb(m: pb.ChatMessage, i: int) -> ChatMessage:
    """A wire message; its parts named as a refusal names them (`messages[0].parts[1]`)."""
    parts = []
    for j, part in enumerate(m.parts):
        kind = part.WhichOneof("part")
        if kind is None:
            raise ValueError(f"messages[{i}].parts[{j}] is empty; a part is text or an image")
        if kind == "text":
            parts.append(ContentPart(text=part.text))
            continue
        image = ImagePart(
            part.image.data, part.image.mime_type, part.image.url, f"messages[{i}].parts[{j}]"
        )
        parts.append(ContentPart(image=image))
    if parts and m.content:
        raise ValueError(f"messages[{i}] has both content and parts; give one")
    return ChatMessage(**_plain(ChatMessage, m, frozenset({"parts"})), parts=tuple(parts))


def _message_to_pb(m: ChatMessage) -> pb.ChatMessage:
    """`_message_from_pb` backwards (a part's `where` is the wire's own place)."""
    out = pb.ChatMessage(**{f.name: getattr(m, f.name) for f in fields(m) if f.name != "parts"})
    for part in m.parts:
        if part.image is None:
            out.parts.add(text=part.text)
        else:
            image = part.image
            out.parts.add(
                image=pb.ImagePart(data=image.data, mime_type=image.mime_type, url=image.url)
            )
    return out
