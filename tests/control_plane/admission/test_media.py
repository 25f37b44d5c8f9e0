"""A chat with images through the admission's preparation (`Preparer.prepare`, what a worker
runs): the prompt's ids equal transformers' Qwen3-VL processor's `input_ids` for the same chat
and images (Qwen3.6's template rendering `<|vision_start|><|image_pad|><|vision_end|>` for each
image, each pad repeated once per merged patch), and the images its `pixel_values` and
`image_grid_thw`, in order; what the server does not take is refused naming the part."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image as PILImage

from control_plane.admission.door import Admission, admit
from control_plane.admission.media import Vision
from control_plane.admission.refusal import BadRequest
from control_plane.admission.work import Prepared, Preparer
from control_plane.text.chat import ChatTemplate
from control_plane.text.images import MediaBounds
from control_plane.text.tokenizer import Tokenization
from protos.model import Capabilities
from protos.params import ChatMessage, ContentPart, ImagePart, RequestParams
from tests.fake_model import FakeModel
from tests.vision_files import data_url, encoded, picture, reference, write_vision_files

BOUNDS = MediaBounds()
FIRST, SECOND = encoded(picture(60, 40, seed=1)), encoded(picture(33, 97, seed=2), "JPEG")


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vision_files(tmp_path_factory.mktemp("vision"))


def caps(**served: Any) -> Capabilities:
    """A service that embeds images, with its default bounds (`served` overrides)."""
    fields = dict(vision_tower=True, max_images_per_prompt=999, max_image_pixels=4096 * 4096)
    return dataclasses.replace(
        FakeModel().capabilities(), vocab_size=512, max_context=4096, **{**fields, **served}
    )


def preparer(directory: Path, bounds: MediaBounds = BOUNDS) -> Preparer:
    tokenization = Tokenization.from_dir(directory)
    chat = ChatTemplate.from_files(tokenization.files)
    return Preparer(tokenization.tokenizer, chat, vision=Vision.of(tokenization.files, bounds))


def image(data: bytes, mime: str = "image/png") -> ContentPart:
    return ContentPart(image=ImagePart(url=data_url(data, mime)))


def text(t: str) -> ContentPart:
    return ContentPart(text=t)


def ours(*messages: ChatMessage) -> RequestParams:
    return RequestParams(messages=messages)


def theirs(*messages: ChatMessage) -> list[dict[str, Any]]:
    """The same chat as transformers' processor takes it: each image a PIL image, as loaded."""

    def item(p: ContentPart) -> dict[str, Any]:
        if p.image is None:
            return {"type": "text", "text": p.text}
        data = FIRST if p.image.url == data_url(FIRST) else SECOND
        return {"type": "image", "image": PILImage.open(io.BytesIO(data))}

    return [
        {"role": m.role, "content": [item(p) for p in m.parts] if m.parts else m.content}
        for m in messages
    ]


CHATS = {
    "one-image": (ChatMessage("user", "", parts=(image(FIRST), text("What is in this picture?"))),),
    "two-images-in-turns": (
        ChatMessage("system", "You describe pictures."),
        ChatMessage("user", "", parts=(text("Compare "), image(FIRST), text(" and "))),
        ChatMessage("assistant", "Send the second."),
        ChatMessage("user", "", parts=(image(SECOND, "image/jpeg"), text("Which is darker?"))),
    ),
}


@pytest.mark.parametrize("chat", CHATS.values(), ids=CHATS.keys())
def test_ids_and_images_are_transformers_processor_output(
    chat: tuple[ChatMessage, ...], vision_dir: Path
) -> None:
    prepared = preparer(vision_dir).prepare(ours(*chat), caps(), 1 << 20)
    want = reference(vision_dir).apply_chat_template(
        theirs(*chat), tokenize=True, return_dict=True, add_generation_prompt=True
    )
    assert list(prepared.ids) == list(want["input_ids"][0])
    assert [list(i.grid_thw) for i in prepared.images] == want["image_grid_thw"].tolist()
    assert np.array_equal(np.concatenate([i.pixels for i in prepared.images]), want["pixel_values"])
    assert prepared.ids.count(409) == sum(i.pixels.shape[0] // 4 for i in prepared.images)
    assert len(prepared.image_spans) == len(prepared.images)
    for span, one in zip(prepared.image_spans, prepared.images, strict=True):
        assert span.digest == one.digest and span.length == one.pixels.shape[0] // 4
        held = prepared.ids[span.start - 1 : span.start + span.length + 1]
        assert held == (406, *[409] * span.length, 407), "between vision start and end"


def prepare(directory: Path, *parts: ContentPart, bounds: MediaBounds = BOUNDS) -> Prepared:
    r = ours(ChatMessage("user", "", parts=parts))
    return preparer(directory, bounds).prepare(r, caps(), 1 << 20)


REFUSED = {
    "too-many": (
        [image(FIRST)] * 3,
        MediaBounds(max_images=2),
        "the messages hold 3 images; this server takes at most 2 a request (--limit-mm-per-prompt)",
    ),
    "not-an-image": (
        [text("x"), ContentPart(image=ImagePart(data=b"GIF89a", where="messages[0].content[1]"))],
        MediaBounds(),
        "messages[0].content[1] is not a PNG, JPEG or WebP image",
    ),
    "typed-placeholder": (
        [image(FIRST), text("<|image_pad|>")],
        MediaBounds(),
        "the prompt holds 2 image placeholders (token 409) for 1 image; the chat template "
        "writes one for each image part, and a message's text may hold none",
    ),
}


@pytest.mark.parametrize(("parts", "bounds", "sentence"), REFUSED.values(), ids=REFUSED.keys())
def test_refusals_name_the_part(
    parts: list[ContentPart], bounds: MediaBounds, sentence: str, vision_dir: Path
) -> None:
    with pytest.raises(BadRequest) as caught:
        prepare(vision_dir, *parts, bounds=bounds)
    assert str(caught.value) == sentence
    assert caught.value.param == "messages"


SERVICE_REFUSED = {
    "no-tower": (
        {"vision_tower": False, "max_images_per_prompt": 0, "max_image_pixels": 0},
        "messages[0].content[0] is an image; this server serves text only (the GPU service "
        "does not embed images)",
    ),
    "count": (
        {"max_images_per_prompt": 1},
        "the messages hold 2 images; this server takes at most 1 a request (the GPU service's "
        "--limit-images-per-prompt)",
    ),
    "pixels": (
        {"max_image_pixels": 64 * 40 - 1},
        "messages[0].content[0] is 2560 pixels after the preprocessor's resize; the GPU service "
        "takes images of at most 2559 (--max-image-pixels)",
    ),
}


@pytest.mark.parametrize(("served", "sentence"), SERVICE_REFUSED.values(), ids=SERVICE_REFUSED)
def test_what_the_service_would_refuse_is_refused_here(
    served: dict, sentence: str, vision_dir: Path
) -> None:
    r = ours(ChatMessage("user", "", parts=(image(FIRST), image(FIRST))))
    with pytest.raises(BadRequest) as caught:
        preparer(vision_dir).prepare(r, caps(**served), 1 << 20)
    assert str(caught.value) == sentence


def test_too_many_images_are_refused_before_any_is_read(
    vision_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def read(*args: Any) -> None:
        raise AssertionError("an image was read")

    monkeypatch.setattr("control_plane.admission.media.read_image", read)
    with pytest.raises(BadRequest, match="hold 100 images"):
        prepare(vision_dir, *[image(FIRST)] * 100)


def test_a_cut_through_an_image_is_refused(vision_dir: Path) -> None:
    r = dataclasses.replace(
        ours(ChatMessage("user", "", parts=(image(FIRST), text("What is it?")))),
        truncate_prompt_tokens=20,
    )
    with pytest.raises(BadRequest, match="truncate_prompt_tokens cuts into the prompt's images"):
        preparer(vision_dir).prepare(r, caps(), 1 << 20)


def test_a_model_without_a_tower_refuses_images_with_a_sentence(vision_dir: Path) -> None:
    tokenization = Tokenization.from_dir(vision_dir)
    text_only = Preparer(tokenization.tokenizer, ChatTemplate.from_files(tokenization.files))
    r = ours(ChatMessage("user", "", parts=(text("x"), image(FIRST))))
    with pytest.raises(BadRequest) as caught:
        text_only.prepare(r, caps(), 1 << 20)
    assert str(caught.value) == (
        "messages[0].content[1] is an image; this server serves text only (the checkpoint has "
        "no vision_config)"
    )


def test_the_admitted_request_carries_its_images_and_where_they_lie(vision_dir: Path) -> None:
    """The door hands the scheduler the images as the worker prepared them, beside their spans
    (the prefill sends each with the chunk holding its first placeholder)."""
    tokenization = Tokenization.from_dir(vision_dir)
    chat = ChatTemplate.from_files(tokenization.files)
    r = ours(
        ChatMessage("user", "", parts=(image(FIRST), text("and"), image(SECOND, "image/jpeg")))
    )
    req, _ = admit(
        r, tokenization.tokenizer, caps(), Admission(), "r", chat=chat, files=tokenization.files
    )
    prepared = preparer(vision_dir).prepare(r, caps(), 1 << 20)
    assert req.prompt_ids == prepared.ids and req.image_spans == prepared.image_spans
    assert [i.digest for i in req.images] == [s.digest for s in req.image_spans]
    assert [i.grid_thw for i in req.images] == [i.grid_thw for i in prepared.images]
    assert len(req.images) == 2


def test_the_image_bounds_are_serve_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from control_plane.cli.server import admission
    from met.main import build_parser

    base = ["control-plane", "serve", "--gpu-service", "x:1"]
    flags = ["--limit-mm-per-prompt", '{"image": 2, "video": 0}', "--max-image-bytes", "100"]
    flags += ["--max-image-file-pixels", "1000", "--allowed-local-media-path", str(tmp_path)]
    args = build_parser().parse_args([*base, *flags])
    assert admission(args).media == MediaBounds(2, 100, 1000, str(tmp_path.resolve()))
    for bad, sentence in [
        (["--limit-mm-per-prompt", '{"video": 1}'], "video cannot be taken"),
        (["--max-image-file-pixels", str(10**12)], "more pixels than PIL opens"),
        (["--allowed-local-media-path", str(tmp_path / "none")], "is not a directory"),
    ]:
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, *bad])
        assert sentence in capsys.readouterr().err


def test_a_continued_message_with_an_image_ends_where_transformers_cuts_it(
    vision_dir: Path,
) -> None:
    chat = (
        ChatMessage("user", "What is it?"),
        ChatMessage("assistant", "", parts=(image(FIRST), text("It is a"))),
    )
    r = dataclasses.replace(ours(*chat), continue_final_message=True, add_generation_prompt=False)
    prepared = preparer(vision_dir).prepare(r, caps(), 1 << 20)
    want = reference(vision_dir).apply_chat_template(
        theirs(*chat), tokenize=True, return_dict=True, continue_final_message=True
    )
    assert list(prepared.ids) == list(want["input_ids"][0])
