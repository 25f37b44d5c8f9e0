"""A chat's images against the served model: refused where it has no vision tower, counted
against the server's bound before any is read, then read and preprocessed in order and their
placeholders expanded in the prompt's ids (`control_plane/text/images.py`). Each refusal is a
`BadRequest` naming the part."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from control_plane.admission.refusal import INVALID, BadRequest
from control_plane.text.images import (
    LIMIT_FLAG,
    Image,
    ImageSpan,
    MediaBounds,
    expanded,
    read_image,
    spans,
)
from control_plane.text.preprocessor import Preprocessor, preprocessor_of
from protos.params import ImagePart, RequestParams

PARAM = "messages"  # the field image refusals blame


@dataclass(frozen=True)
class Vision:
    """The served model's image side: its preprocessing (None: it takes no images, `why`
    says why) and the server's bounds on a request's images."""

    pre: Preprocessor | None = None
    why: str = "the checkpoint has no vision_config"
    bounds: MediaBounds = field(default_factory=MediaBounds)

    @classmethod
    def of(cls, files: Mapping[str, bytes], bounds: MediaBounds) -> Vision:
        """From the checkpoint's files (config.json and preprocessor_config.json, by name)."""
        pre, why = preprocessor_of(files)
        return cls(pre, why, bounds)


def image_parts(r: RequestParams) -> list[ImagePart]:
    """The request's images in the order its chat renders them, each named (`where`) as a
    refusal names it."""
    out = []
    for i, m in enumerate(r.messages):
        for j, p in enumerate(m.parts):
            if p.image is not None:
                where = p.image.where or f"messages[{i}].content[{j}]"
                out.append(replace(p.image, where=where))
    return out


def check_images(parts: Sequence[ImagePart], vision: Vision) -> None:
    """Before the chat is rendered: the model takes images, and no more than the bound."""
    if not parts:
        return
    if vision.pre is None:
        sentence = f"{parts[0].where} is an image; this server serves text only ({vision.why})"
        raise BadRequest(INVALID, sentence, PARAM)
    most = vision.bounds.max_images
    if len(parts) > most:
        raise BadRequest(
            INVALID,
            f"the messages hold {len(parts)} images; this server takes at most {most} a request "
            f"({LIMIT_FLAG})",
            PARAM,
        )


def read_images(parts: Sequence[ImagePart], vision: Vision) -> tuple[Image, ...]:
    """Each image read, decoded and preprocessed, in order."""
    if not parts:
        return ()
    pre = vision.pre
    assert pre is not None, "check_images refuses images to a model without a vision tower"
    try:
        return tuple(read_image(p, p.where, pre, vision.bounds) for p in parts)
    except ValueError as e:
        raise BadRequest(INVALID, str(e), PARAM) from None


def expander(vision: Vision, images: Sequence[Image]) -> Callable[[list[int]], list[int]]:
    """What makes a tokenized prompt's ids the model's: each image placeholder repeated once
    per merged patch of its image (a model without images: the ids as they are)."""
    pre = vision.pre
    if pre is None:
        return list

    def expand(ids: list[int]) -> list[int]:
        try:
            return expanded(ids, pre, images)
        except ValueError as e:
            raise BadRequest(INVALID, str(e), PARAM) from None

    return expand


def check_kept(
    ids: Sequence[int], vision: Vision, images: Sequence[Image]
) -> tuple[ImageSpan, ...]:
    """Where each image's placeholders lie in the prompt's final ids; a prompt cut to its last
    tokens (`truncate_prompt_tokens`) must keep every image whole."""
    if vision.pre is None or not images:
        return ()
    pad = vision.pre.image_token_id
    kept = sum(1 for t in ids if t == pad)
    if kept != sum(vision.pre.tokens(image.grid_thw) for image in images):
        raise BadRequest(
            INVALID,
            "truncate_prompt_tokens cuts into the prompt's images; keep them whole, or send "
            "fewer messages",
            "truncate_prompt_tokens",
        )
    return spans(ids, vision.pre, images)
