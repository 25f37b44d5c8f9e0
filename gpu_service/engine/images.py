"""A prefill's images: checked against the tower and the service's bounds, placed among the
chunk's tokens, embedded by the tower, and turned into what the forward reads (`ImageRows`).

An image comes with the prefill whose chunk holds its first image token (the config's
`image_token_id`), in the order of those first tokens. Its t * h * w / merge ** 2 tokens may run
on into the sequence's next prefills, which do not send it again: the sequence keeps its
embeddings (`SeqImage.embeds`) until its last token is in. A sequence that never had an image
reads the image token as text (transformers' model does, given no pixels); once it has one,
every image token must be one of an image's.

Placing a chunk is host work on token ids and grids alone; the tower runs only once every
sequence's chunk placed without a refusal, so a refused prefill leaves no trace."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from gpu_service.memory.sequence import SeqState
from gpu_service.model.backend import upload
from gpu_service.model.batch import Segment
from gpu_service.model.config import ServiceConfig
from gpu_service.model.hybrid import HybridModel
from gpu_service.model.mrope import ImageRows, SeqImage, positions, shift_after
from gpu_service.model.state import DeviceState
from gpu_service.model.vision import grid_problem
from gpu_service.model.vision_config import VisionConfig
from protos.handles import ImageInput
from protos.model import FailedPrecondition, InvalidArgument

NO_TOWER = "this model has no vision tower (its checkpoint holds no model.visual.* tensors)"


def name(image: ImageInput, k: int, seq_id: int) -> str:
    """How a refusal names an image: its index in the prefill item, its digest's start."""
    digest = f" (sha256 {image.digest.hex()[:12]})" if image.digest else ""
    return f"image {k}{digest} of sequence {seq_id}'s prefill"


def check_images(
    model: HybridModel,
    svc: ServiceConfig,
    states: Sequence[SeqState],
    images: Sequence[Sequence[ImageInput]],
) -> None:
    """InvalidArgument naming the first image the tower cannot take or the bounds refuse."""
    v = model.cfg.vision
    if any(images) and (v is None or model.vision is None):
        raise InvalidArgument(f"the prefill sends images, but {NO_TOWER}")
    if v is None:
        return
    if any(images) and not v.mrope_interleaved:
        raise InvalidArgument(
            "config.json's rope_parameters.mrope_interleaved is false, which this engine does "
            "not place images by (transformers' Qwen3.5 interleaves)"
        )
    for s, sent in zip(states, images, strict=True):
        held = len(s.images) + len(sent)
        if held > svc.max_images_per_prompt:
            raise InvalidArgument(
                f"sequence {s.seq_id} would hold {held} images; this service takes at most "
                f"{svc.max_images_per_prompt} per prompt (--limit-images-per-prompt)"
            )
        for k, image in enumerate(sent):
            _check_image(v, svc, image, name(image, k, s.seq_id))


def _check_image(v: VisionConfig, svc: ServiceConfig, image: ImageInput, what: str) -> None:
    grid = tuple(int(g) for g in image.grid_thw)
    width = v.patch_dim * 4
    if len(image.pixels) % width:
        raise InvalidArgument(
            f"{what} has {len(image.pixels)} bytes of pixels, not a whole number of patch rows "
            f"of {v.patch_dim} float32 values"
        )
    problem = grid_problem(v, grid, len(image.pixels) // width)
    if problem is not None:
        raise InvalidArgument(f"{what}: {problem}")
    pixels = grid[0] * grid[1] * grid[2] * v.patch_size**2
    if pixels > svc.max_image_pixels:
        raise InvalidArgument(
            f"{what} covers {pixels} pixels; this service takes at most {svc.max_image_pixels} "
            "per image (--max-image-pixels)"
        )


@dataclass
class Placed:
    """A sequence's chunk with its images placed."""

    spans: list[SeqImage]  # the sequence's images after the chunk (new ones not embedded)
    new: dict[int, int] = field(default_factory=dict)  # span index -> its image's in the item
    rows: list[int] = field(default_factory=list)  # the chunk's rows that are image tokens
    sources: list[tuple[int, int]] = field(default_factory=list)  # each: (span, its token)


def place(
    v: VisionConfig, s: SeqState, tokens: Sequence[int], sent: Sequence[ImageInput]
) -> Placed:
    """Which of the chunk's rows are image tokens, and whose; InvalidArgument where the image
    tokens and the images disagree."""
    out = Placed(list(s.images))
    if not s.images and not sent:
        return out  # text alone: every token at its own position
    images = iter(enumerate(sent))
    reading = bool(s.images) or bool(sent)  # a sequence without images reads them as text
    m = v.spatial_merge_size
    for i, token in enumerate(tokens):
        p = s.seq_len + i
        last = out.spans[-1] if out.spans else None
        if last is not None and p < last.end:
            if token != v.image_token_id:
                raise InvalidArgument(
                    f"sequence {s.seq_id}'s image {len(out.spans) - 1} has {last.count} tokens "
                    f"from position {last.first}, but position {p} holds token {token}"
                )
        elif token == v.image_token_id and reading:
            k, image = next(images, (None, None))
            if image is None or k is None:
                raise InvalidArgument(
                    f"sequence {s.seq_id}'s prefill holds an image token at position {p} that no "
                    "image of the prefill starts (send each image with the prefill that holds "
                    "its first token)"
                )
            t, h, w = (int(g) for g in image.grid_thw)
            start = p + shift_after(out.spans)
            out.new[len(out.spans)] = k
            out.spans.append(SeqImage(p, (t, h // m, w // m), start))
        else:
            continue
        out.rows.append(i)
        out.sources.append((len(out.spans) - 1, p - out.spans[-1].first))
    left = next(images, None)
    if left is not None:
        raise InvalidArgument(
            f"{name(left[1], left[0], s.seq_id)} starts at no image token: the prompt's image "
            f"tokens ({v.image_token_id}) account for {len(out.new)} of its "
            f"{len(sent)} images"
        )
    return out


def mid_image(s: SeqState) -> bool:
    """Whether the sequence's last image has tokens still to prefill."""
    return bool(s.images) and s.images[-1].end > s.seq_len


def check_not_mid_image(s: SeqState, what: str) -> None:
    if mid_image(s):
        span = s.images[-1]
        raise FailedPrecondition(
            f"sequence {s.seq_id} holds {s.seq_len} tokens, inside its image of {span.count} "
            f"tokens from position {span.first}; prefill the rest of them before {what}"
        )


def embed_new(
    model: HybridModel,
    placed: Sequence[Placed],
    images: Sequence[Sequence[ImageInput]],
) -> None:
    """The tower over every image the chunks start, one image at a time; each new span takes
    its embeddings."""
    assert model.vision is not None
    for p, sent in zip(placed, images, strict=True):
        for at, k in p.new.items():
            image = sent[k]
            rows = np.frombuffer(image.pixels, dtype="<f4").reshape(-1, model.vision.v.patch_dim)
            grid = tuple(int(g) for g in image.grid_thw)
            assert len(grid) == 3
            embeds = model.vision.embed(torch.from_numpy(rows.copy()), (grid[0], grid[1], grid[2]))
            p.spans[at] = replace(p.spans[at], embeds=embeds)


def image_rows(
    model: HybridModel,
    placed: Sequence[Placed],
    segs: Sequence[Segment],
) -> ImageRows | None:
    """What the forward of these sequences' chunks (rows `segs`, spans after them in
    `placed`) reads; None where no sequence has an image (every row at its plain position)."""
    if not any(p.spans for p in placed):
        return None
    pos = [
        positions(p.spans, range(g.start, g.start + g.count))
        for p, g in zip(placed, segs, strict=True)
    ]
    rope = model.image_rope(torch.from_numpy(np.concatenate(pos, 1)))
    rows = [g.row + r for p, g in zip(placed, segs, strict=True) for r in p.rows]
    if not rows:
        return ImageRows(rope)
    embeds = torch.cat([run for p in placed for run in _runs(p)])
    return ImageRows(rope, torch.tensor(rows, device=model.device), embeds)


def _runs(p: Placed) -> list[torch.Tensor]:
    """The embeddings of the chunk's image rows, in row order, as slices of each image's."""
    out: list[torch.Tensor] = []
    first = 0
    for n in range(1, len(p.sources) + 1):
        span, j = p.sources[n - 1]
        if n == len(p.sources) or p.sources[n] != (span, j + 1):
            embeds = p.spans[span].embeds
            assert embeds is not None  # every span a chunk reads is embedded by then
            out.append(embeds[p.sources[first][1] : j + 1])
            first = n
    return out


def settle(state: DeviceState, states: Sequence[SeqState], placed: Sequence[Placed]) -> None:
    """After the prefill (the tokens extended): each sequence keeps its spans, an image's
    embeddings dropped once all its tokens are in, and its RoPE shift goes on the device."""
    shifts: dict[int, int] = {}
    for s, p in zip(states, placed, strict=True):
        s.images = tuple(sp if sp.end > s.seq_len else replace(sp, embeds=None) for sp in p.spans)
        if s.images:
            shifts[s.slot] = shift_after(s.images)
    if shifts:
        slots, values = upload(state.rope_shift.device, list(shifts), list(shifts.values()))
        state.rope_shift[slots] = values
