"""The diff's prompts with images (`--images`): every other sequence's prompt holds an image,
so that each batch mixes image and text prompts. Each image is a picture of its own (a fixed
pattern, seeded by the sequence), turned into the tower's rows by the checkpoint's own
preprocessor (preprocessor_config.json, as a chat's images are) and placed across the point a
snapshot case cuts the prompt at, so that a restored prefix ends inside it. A prefill sends an
image with the chunk that holds its first placeholder, as the scheduler does."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from PIL import Image as PILImage

from control_plane.circuit.shapes import snapshot_prefix
from control_plane.text.images import Image, ImageSpan, starting_in
from control_plane.text.preprocessor import Preprocessor, preprocessor_of
from protos.handles import ImageInput
from protos.model import CircuitModel


@dataclass(frozen=True)
class PromptImages:
    """A diff prompt's images as a request holds them (`GenRequest.images`, `image_spans`)."""

    images: tuple[Image, ...] = ()
    spans: tuple[ImageSpan, ...] = ()

    def starting(self, start: int, end: int) -> list[ImageInput]:
        """The images whose first placeholder is among tokens `start .. end - 1`, as a prefill
        carries them."""
        return [i.to_input() for i in starting_in(self.spans, self.images, start, end)]


def preprocessor(model: CircuitModel) -> tuple[Preprocessor | None, str]:
    """The served checkpoint's preprocessing, or None and why the diff can give it no images:
    the service embeds none, or the checkpoint's files say it takes none."""
    if not model.capabilities().vision_tower:
        return None, "the service embeds no images (it has no vision tower)"
    return preprocessor_of(model.tokenizer_files())


def picture(pre: Preprocessor, seed: int) -> Image:
    """A square picture four merged patches wide, a pattern of `seed`, through the
    preprocessor (which may resize it within its bounds)."""
    side = 4 * pre.factor
    y, x = np.mgrid[0:side, 0:side]
    channels = [(x * (3 + seed) + y * (5 + 2 * seed) + 40 * c) % 256 for c in range(3)]
    rows, grid = pre.rows(PILImage.fromarray(np.stack(channels, -1).astype(np.uint8), "RGB"))
    return Image(rows, grid, hashlib.sha256(rows.tobytes()).digest())


def with_images(
    prompts: list[list[int]], pre: Preprocessor, block: int
) -> tuple[list[list[int]], list[PromptImages]]:
    """Every other prompt (the first, the third, ...) with an image's placeholders inserted
    across its snapshot cut (`block`), a stray placeholder id in its text made another token.
    -> (the prompts, each one's images)"""
    out: list[list[int]] = []
    images: list[PromptImages] = []
    for i, prompt in enumerate(prompts):
        if i % 2:
            out.append(list(prompt))
            images.append(PromptImages())
            continue
        image = picture(pre, i)
        n = pre.tokens(image.grid_thw)
        text = [t - 1 if t == pre.image_token_id else t for t in prompt]
        cut = snapshot_prefix([*text, *[pre.image_token_id] * n], block)
        start = min(max(1, cut - n // 2), len(text) - 1)
        out.append([*text[:start], *[pre.image_token_id] * n, *text[start:]])
        images.append(PromptImages((image,), (ImageSpan(start, n, image.digest),)))
    return out, images
