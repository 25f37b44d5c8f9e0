"""A chat's images against the served model: refused where it has no vision tower (or the GPU
service embeds none), counted against the server's bound and the service's before any is
read, then read and preprocessed in order (one the service would refuse for its size refused
here) and their placeholders expanded in the prompt's ids (`control_plane/text/images.py`).
Each refusal is a `BadRequest` naming the part."""

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
from protos.model import Capabilities
from protos.params import ImagePart, RequestParams

PARAM = "messages"  # the field image refusals blame
NO_TOWER = "the GPU service does not embed images"
# The GPU service's flags of its bounds, which its capabilities report.
SERVICE_LIMIT_FLAG, SERVICE_PIXELS_FLAG = "--limit-images-per-prompt", "--max-image-pixels"


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


def check_images(parts: Sequence[ImagePart], vision: Vision, caps: Capabilities) -> None:
    """Before the chat is rendered: the model takes images, the GPU service embeds them, and
    there are no more than this server's bound and the service's."""
    if not parts:
        return
    why = vision.why if vision.pre is None else "" if caps.vision_tower else NO_TOWER
    if why:
        sentence = f"{parts[0].where} is an image; this server serves text only ({why})"
        raise BadRequest(INVALID, sentence, PARAM)
    most, flag = min(
        (vision.bounds.max_images, LIMIT_FLAG),
        (caps.max_images_per_prompt, f"the GPU service's {SERVICE_LIMIT_FLAG}"),
    )
    if len(parts) > most:
        raise BadRequest(
            INVALID,
            f"the messages hold {len(parts)} images; this server takes at most {most} a request "
            f"({flag})",
            PARAM,
        )


def read_images(
    parts: Sequence[ImagePart], vision: Vision, caps: Capabilities
) -> tuple[Image, ...]:
    """Each image read, decoded and preprocessed, in order; one the service would refuse for
    its size after the preprocessor's resize refused here."""
    if not parts:
        return ()
    pre = vision.pre
    assert pre is not None, "check_images refuses images to a model without a vision tower"
    out = []
    try:
        for p in parts:
            out.append(read_image(p, p.where, pre, vision.bounds))
            t, h, w = out[-1].grid_thw
            pixels = t * h * w * pre.patch_size**2
            if pixels > caps.max_image_pixels:
                raise ValueError(
                    f"{p.where} is {pixels} pixels after the preprocessor's resize; the GPU "
                    f"service takes images of at most {caps.max_image_pixels} "
                    f"({SERVICE_PIXELS_FLAG})"
                )
    except ValueError as e:
        raise BadRequest(INVALID, str(e), PARAM) from None
    return tuple(out)


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
