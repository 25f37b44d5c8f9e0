"""A checkpoint's image preprocessing, as transformers' Qwen2-VL image processor does it for
Qwen3-VL, Qwen3.5 and Qwen3.6 (`Qwen2VLImageProcessorPil`, the PIL backend): the image resized
by PIL within the preprocessor's min and max pixels to multiples of the patch size times the
merge size (`smart_resize`), rescaled, normalised with the image mean and std, then cut into
patches, a still image repeated over the temporal patch. The settings come from
`preprocessor_config.json`, checked against the model's `vision_config`; the placeholder token
from `config.json` (what the file leaves out takes transformers' default for its model type).

transformers' fast processor (torchvision's resize) gives slightly other pixels than its PIL
one; this follows the PIL one to the bit."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image as PILImage

from protos.vision import TOKEN_DEFAULTS, VISION_DEFAULTS, VISION_MODEL_TYPES

CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
# The tower's fields the preprocessor must agree with (`protos.vision`'s defaults for what
# config.json leaves out).
TOWER_FIELDS = ("in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size")
# Qwen2VLImageProcessor's class defaults, for what preprocessor_config.json leaves out.
PROCESSOR_DEFAULTS: dict[str, Any] = {
    "do_resize": True,
    "resample": int(PILImage.Resampling.BICUBIC),
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OpenAI CLIP's
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
}
PROCESSOR_CLASSES = {"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast"}
# Keys that name the processor or its companions, and change no pixel.
PROCESSOR_NAMES = {"image_processor_type", "processor_class"}
MAX_ASPECT = 200  # smart_resize refuses images longer than this many times their width


@dataclass(frozen=True)
class Preprocessor:
    """What turns an image into the vision tower's input rows, and the placeholder token a
    chat's images take in its ids."""

    image_token_id: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    do_resize: bool
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @property
    def factor(self) -> int:
        """What each side of a resized image is a multiple of."""
        return self.patch_size * self.merge_size

    @property
    def row_width(self) -> int:
        """Values in one patch row: channels x temporal patch x patch x patch."""
        return len(self.image_mean) * self.temporal_patch_size * self.patch_size**2

    def tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Placeholder tokens of an image of this grid: one per merged patch."""
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2

    def size(self, height: int, width: int) -> tuple[int, int]:
        """The resized (height, width): `smart_resize`, as transformers computes it. Raises
        `ValueError` for an image longer than 200 times its width, which it refuses."""
        if not self.do_resize:
            return height, width
        if max(height, width) / min(height, width) > MAX_ASPECT:
            raise ValueError(
                f"is {width}x{height} pixels, one side more than {MAX_ASPECT} times the other; "
                "the model's preprocessor takes no image that narrow"
            )
        factor = self.factor
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def rows(self, image: PILImage.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """An RGB image's patch rows, float32 [t*h*w, row_width], and its grid (t, h, w)."""
        height, width = self.size(image.height, image.width)
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), resample=self.resample)
        if height % self.factor or width % self.factor:
            raise ValueError(
                f"is {width}x{height} pixels, which the model's preprocessor (do_resize false) "
                f"does not cut into patches of {self.factor}"
            )
        pixels = np.asarray(image)  # [H, W, C] uint8
        grid = (1, height // self.patch_size, width // self.patch_size)
        return self._patches(pixels, self._table()), grid

    def _table(self) -> np.ndarray:
        """[C, 256] float32: each uint8 value as transformers' rescale (float64, then float32)
        and normalize (float32) turn it."""
        values = np.arange(256, dtype=np.uint8)
        channels = len(self.image_mean)
        if self.do_rescale:
            scaled = (values.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            scaled = values.astype(np.float32)
        table = np.broadcast_to(scaled, (channels, 256))
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=np.float32)
            std = np.array(self.image_std, dtype=np.float32)
            table = ((table.T - mean) / std).T
        return np.ascontiguousarray(table, dtype=np.float32)

    def _patches(self, pixels: np.ndarray, table: np.ndarray) -> np.ndarray:
        """[H, W, C] uint8 -> [gh*gw, C*T*P*P] float32, rows in merge-window order as
        transformers' patchify lays them ((gh/m, gw/m, m, m) over (C, T, P, P)); written a
        channel at a time, so that no copy of the whole image in float32 is made beside it."""
        height, width, channels = pixels.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        out = np.empty((gh // m, gw // m, m, m, channels, t, p, p), dtype=np.float32)
        for c in range(channels):
            plane = table[c][pixels[..., c]]  # [H, W] float32: the same values, elementwise
            windows = plane.reshape(gh // m, m, p, gw // m, m, p).transpose(0, 3, 1, 4, 2, 5)
            out[:, :, :, :, c] = windows[:, :, :, :, None]
        return out.reshape(gh * gw, channels * t * p * p)


def preprocessor_of(files: Mapping[str, bytes]) -> tuple[Preprocessor | None, str]:
    """The checkpoint's preprocessing from its files (by name), or None and why it takes no
    images: no `vision_config` in config.json, no preprocessor_config.json, or settings this
    server does not follow (named)."""
    if CONFIG_FILE not in files:
        return None, f"the checkpoint has no {CONFIG_FILE}"
    try:
        config = _json(files, CONFIG_FILE)
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            return None, "the checkpoint has no vision_config"
        if PREPROCESSOR_FILE not in files:
            return None, f"the checkpoint has a vision tower but no {PREPROCESSOR_FILE}"
        return _checked(config, vision, _json(files, PREPROCESSOR_FILE)), ""
    except ValueError as e:
        return None, str(e)


def _json(files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    try:
        value = json.loads(files[name])
    except (ValueError, RecursionError) as e:
        raise ValueError(f"the checkpoint's {name} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"the checkpoint's {name} is not a JSON object")
    return value


def _checked(config: dict, vision: dict, raw: dict) -> Preprocessor:
    """The preprocessor's settings, each one this server acts on, matching the tower's."""
    model_type = config.get("model_type")
    if model_type not in VISION_MODEL_TYPES:
        raise ValueError(
            f"the checkpoint's model_type is {model_type!r}; this server reads images for "
            f"{' and '.join(sorted(VISION_MODEL_TYPES))}"
        )
    image_token_id = config.get("image_token_id", TOKEN_DEFAULTS["image_token_id"])
    tower = {k: vision.get(k, VISION_DEFAULTS[k]) for k in TOWER_FIELDS}
    kind = raw.get("image_processor_type")
    if kind is not None and kind not in PROCESSOR_CLASSES:
        raise ValueError(
            f"{PREPROCESSOR_FILE} names image_processor_type {kind!r}; this server preprocesses "
            f"as {' or '.join(sorted(PROCESSOR_CLASSES))}"
        )
    unknown = sorted(set(raw) - set(PROCESSOR_DEFAULTS) - PROCESSOR_NAMES - _PIXEL_KEYS)
    if unknown:
        raise ValueError(
            f"{PREPROCESSOR_FILE} sets {', '.join(unknown)}, which this server does not follow"
        )
    s = {**PROCESSOR_DEFAULTS, **{k: v for k, v in raw.items() if k in PROCESSOR_DEFAULTS}}
    low, high = _pixels(raw)
    _match(s, tower)
    return Preprocessor(
        int(image_token_id),
        int(s["patch_size"]),
        int(s["temporal_patch_size"]),
        int(s["merge_size"]),
        low,
        high,
        bool(s["do_resize"]),
        int(s["resample"]),
        bool(s["do_rescale"]),
        float(s["rescale_factor"]),
        bool(s["do_normalize"]),
        tuple(float(x) for x in s["image_mean"]),
        tuple(float(x) for x in s["image_std"]),
    )


_PIXEL_KEYS = {"size", "min_pixels", "max_pixels"}
# Qwen2VLImageProcessor's `size` default: shortest_edge and longest_edge in pixels.
DEFAULT_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}


def _pixels(raw: dict) -> tuple[int, int]:
    """(min, max) pixels: `size`'s shortest and longest edge, which `min_pixels` and
    `max_pixels` override, as the processor's constructor reads them."""
    size = raw.get("size", DEFAULT_SIZE)
    if not isinstance(size, dict) or set(size) - {"shortest_edge", "longest_edge"}:
        raise ValueError(
            f"{PREPROCESSOR_FILE}'s size is {size!r}; this server takes "
            "{shortest_edge, longest_edge} in pixels"
        )
    low = raw.get("min_pixels", size.get("shortest_edge", DEFAULT_SIZE["shortest_edge"]))
    high = raw.get("max_pixels", size.get("longest_edge", DEFAULT_SIZE["longest_edge"]))
    if not (isinstance(low, int) and isinstance(high, int) and 0 < low <= high):
        raise ValueError(
            f"{PREPROCESSOR_FILE} bounds images to {low} .. {high} pixels; they must be "
            "whole numbers, the least no more than the most"
        )
    return low, high


def _match(settings: dict, tower: dict) -> None:
    """The preprocessor cuts the patches the tower embeds."""
    pairs = [
        ("patch_size", "patch_size"),
        ("temporal_patch_size", "temporal_patch_size"),
        ("merge_size", "spatial_merge_size"),
    ]
    for mine, theirs in pairs:
        if settings[mine] != tower[theirs]:
            raise ValueError(
                f"{PREPROCESSOR_FILE}'s {mine} is {settings[mine]}, the vision tower's "
                f"{theirs} {tower[theirs]}; they must agree"
            )
    if not settings["do_convert_rgb"]:
        raise ValueError(
            f"{PREPROCESSOR_FILE} sets do_convert_rgb false; this server reads every image as RGB"
        )
    channels = tower["in_channels"]
    if channels != 3:
        raise ValueError(f"the vision tower takes {channels} channels; this server feeds it RGB")
    for name in ("image_mean", "image_std"):
        if not isinstance(settings[name], list) or len(settings[name]) != channels:
            raise ValueError(
                f"{PREPROCESSOR_FILE}'s {name} must list one value for each of the tower's "
                f"{channels} channels"
            )
    if settings["resample"] not in {int(r) for r in PILImage.Resampling}:
        raise ValueError(f"{PREPROCESSOR_FILE}'s resample {settings['resample']!r} is not PIL's")
