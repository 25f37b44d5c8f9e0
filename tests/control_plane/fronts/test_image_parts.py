"""Image parts as each front reads them: OpenAI's `image_url` (`{url, detail}` or the URL
alone, detail auto), the Responses API's `input_image`, Anthropic's `image` blocks (base64 or a
URL) and the gRPC `ChatMessage`'s parts, each as the message's parts in order, named as the
client named it; what a front does not take refused with a sentence. Reading the image is the
admission's (tests/control_plane/admission/test_media.py)."""

from __future__ import annotations

from typing import Any

import pytest

from control_plane.fronts.anthropic_body import messages_request
from control_plane.fronts.openai_body import chat_request
from control_plane.fronts.openai_fields import InvalidParam
from control_plane.fronts.openai_responses_body import responses_request
from protos.met.v1 import generate_pb2 as pb
from protos.params import ContentPart, ImagePart, from_pb, to_pb

URL = "data:image/png;base64,iVBORw0KGgo="
TEXT = {"type": "text", "text": "What is it?"}


def chat(*content: Any) -> tuple[str, tuple[ContentPart, ...]]:
    ask = chat_request({"messages": [{"role": "user", "content": list(content)}]})
    (message,) = ask.request.messages
    return message.content, message.parts


def image(where: str, url: str = URL) -> ContentPart:
    return ContentPart(image=ImagePart(url=url, where=where))


def test_openai_image_url_parts_are_parts_in_order() -> None:
    content, parts = chat(
        TEXT,
        {"type": "image_url", "image_url": {"url": URL, "detail": "auto"}},
        {"type": "image_url", "image_url": "file:///media/cat.png"},
        {"type": "text", "text": "And this?"},
    )
    assert content == ""
    assert parts == (
        ContentPart(text="What is it?"),
        image("messages[0].content[1]"),
        image("messages[0].content[2]", "file:///media/cat.png"),
        ContentPart(text="And this?"),
    )


def test_openai_text_parts_alone_stay_joined_text() -> None:
    assert chat(TEXT, TEXT) == ("What is it?\nWhat is it?", ())


OPENAI_REFUSED = {
    "detail": (
        {"type": "image_url", "image_url": {"url": URL, "detail": "low"}},
        'messages[0].content[0].image_url.detail is "low"; this server sizes every image by '
        "the model's preprocessor (its least and most pixels), as detail auto",
    ),
    "key": (
        {"type": "image_url", "image_url": {"url": URL, "uuid": "x"}},
        "messages[0].content[0].image_url.uuid is not taken; give url and detail",
    ),
    "no-url": (
        {"type": "image_url", "image_url": {"detail": "auto"}},
        'messages[0].content[0].image_url is {"detail": "auto"}; it must be {url, detail} or a URL',
    ),
    "video": (
        {"type": "video_url", "video_url": {"url": URL}},
        "messages[0].content[0] is of type video_url; this server takes text and images (it "
        "reads no video)",
    ),
    "unknown": ({"type": "image_pil"}, "this server takes text and image_url parts"),
}


@pytest.mark.parametrize(("part", "sentence"), OPENAI_REFUSED.values(), ids=OPENAI_REFUSED.keys())
def test_openai_refusals(part: dict, sentence: str) -> None:
    with pytest.raises(InvalidParam) as caught:
        chat(part)
    assert caught.value.param == "messages"
    assert sentence in str(caught.value)


def responses(*content: Any) -> tuple[str, tuple[ContentPart, ...]]:
    body = {"model": "m", "input": [{"role": "user", "content": list(content)}]}
    (message,) = responses_request(body).ask.request.messages
    return message.content, message.parts


def test_responses_input_image_is_a_part() -> None:
    content, parts = responses(
        {"type": "input_text", "text": "What is it?"},
        {"type": "input_image", "image_url": URL, "detail": "auto"},
    )
    assert content == ""
    assert parts == (ContentPart(text="What is it?"), image("input[0].content[1]"))


@pytest.mark.parametrize(
    ("part", "sentence"),
    [
        ({"type": "input_image", "file_id": "f1"}, "file_id is given; this server keeps no files"),
        ({"type": "input_image", "image_url": URL, "detail": "high"}, "as detail auto"),
        ({"type": "input_image"}, "input.0..content.0..image_url is null; it must be a string"),
        ({"type": "input_file", "file_id": "f1"}, "text and input_image parts"),
    ],
)
def test_responses_refusals(part: dict, sentence: str) -> None:
    with pytest.raises(InvalidParam, match=sentence) as caught:
        responses(part)
    assert caught.value.param == "input"


def test_responses_an_image_in_a_call_output_is_refused() -> None:
    body = {
        "model": "m",
        "input": [
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [{"type": "input_image", "image_url": URL}],
            },
        ],
    }
    with pytest.raises(InvalidParam, match="input\\[1\\].output holds an image"):
        responses_request(body)


def anthropic(*content: Any) -> list[Any]:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": list(content)}]}
    return list(messages_request(body, None).ask.request.messages)


def test_anthropic_image_blocks_are_parts_with_tool_results_in_place() -> None:
    blocks = [
        {"type": "text", "text": "Look:"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
    ]
    (message,) = anthropic(*blocks)
    assert message.parts == (
        ContentPart(text="Look:"),
        image("messages[0].content[1]", "data:image/png;base64,QUJD"),
        image("messages[0].content[2]", "https://example.com/a.png"),
    )


@pytest.mark.parametrize(
    ("block", "sentence"),
    [
        (
            {"type": "image", "source": {"type": "file", "file_id": "f"}},
            "messages[0].content[0].source is a file; this server keeps no files",
        ),
        ({"type": "image", "source": {}}, "messages[0].content[0].source is {}; it must be"),
        ({"type": "image", "source": None, "x": 1}, "messages[0].content[0].x"),
        ({"type": "document", "source": {}}, "is a document block; this server takes text and"),
        (
            {
                "type": "tool_result",
                "tool_use_id": "t",
                "content": [{"type": "image", "source": {}}],
            },
            "messages[0].content[0].content[0] is an image block; this server takes images in "
            "a user's message only",
        ),
    ],
)
def test_anthropic_refusals(block: dict, sentence: str) -> None:
    with pytest.raises(InvalidParam, match=sentence.replace("[", "\\[").replace("]", "\\]")):
        anthropic(block)


def grpc_message(*parts: pb.ContentPart, content: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=content, parts=list(parts))]
    )


def test_grpc_parts_are_read_and_written_back() -> None:
    wire = grpc_message(
        pb.ContentPart(text="What is it?"),
        pb.ContentPart(image=pb.ImagePart(data=b"\x89PNG", mime_type="image/png")),
        pb.ContentPart(image=pb.ImagePart(url=URL)),
    )
    params = from_pb(wire)
    assert params.messages[0].parts == (
        ContentPart(text="What is it?"),
        ContentPart(image=ImagePart(b"\x89PNG", "image/png", where="messages[0].parts[1]")),
        ContentPart(image=ImagePart(url=URL, where="messages[0].parts[2]")),
    )
    assert to_pb(params).messages == wire.messages


@pytest.mark.parametrize(
    ("wire", "sentence"),
    [
        (grpc_message(pb.ContentPart()), "messages[0].parts[0] is empty"),
        (grpc_message(pb.ContentPart(text="x"), content="y"), "has both content and parts"),
    ],
)
def test_grpc_refusals(wire: pb.GenerateRequest, sentence: str) -> None:
    with pytest.raises(ValueError, match=sentence.replace("[", "\\[").replace("]", "\\]")):
        from_pb(wire)
