"""The checkpoint's preprocessing against transformers' Qwen2-VL image processor (its PIL
backend, `Qwen2VLImageProcessorPil`; the fast one needs torchvision, not installed): the same
resized sizes for any image, the same pixel rows to the bit for images of every mode and
format, at Qwen's published settings; and the settings it does not follow refused by name."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
    smart_resize,
)

from control_plane.text.images import read_image
from control_plane.text.preprocessor import Preprocessor, preprocessor_of
from protos.params import ImagePart
from tests.vision_files import (
    PUBLISHED_CONFIG,
    PUBLISHED_PREPROCESSOR,
    encoded,
    files_of,
    picture,
    write_vision_files,
)


def published_files() -> dict[str, bytes]:
    """Qwen3.5-35B-A3B's config.json and the family's preprocessor_config.json, as published."""
    return {
        "config.json": (PUBLISHED_CONFIG / "config.json").read_bytes(),
        "preprocessor_config.json": PUBLISHED_PREPROCESSOR.read_bytes(),
    }


def published() -> Preprocessor:
    pre, why = preprocessor_of(published_files())
    assert pre is not None, why
    return pre


def reference() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(**json.loads(PUBLISHED_PREPROCESSOR.read_text()))


def test_published_settings_are_read() -> None:
    pre = published()
    assert (pre.patch_size, pre.temporal_patch_size, pre.merge_size) == (16, 2, 2)
    assert (pre.min_pixels, pre.max_pixels) == (65536, 16777216)
    assert pre.image_token_id == 248056
    assert pre.image_mean == pre.image_std == (0.5, 0.5, 0.5)
    assert pre.row_width == 3 * 2 * 16 * 16


@pytest.mark.parametrize("height", [1, 7, 31, 32, 100, 333, 1080, 4097, 9000])
@pytest.mark.parametrize("width", [3, 32, 47, 640, 1920, 5000])
def test_sizes_are_smart_resize(width: int, height: int) -> None:
    pre = published()
    if max(width, height) / min(width, height) > 200:
        with pytest.raises(ValueError, match="more than 200 times the other"):
            pre.size(height, width)
        return
    want = smart_resize(height, width, 32, pre.min_pixels, pre.max_pixels)
    assert pre.size(height, width) == want


# (width, height, PIL mode, format): upscaled to the least pixels, shrunk to a merge multiple,
# transparency composited over white, grey and palette images made RGB, lossy formats.
IMAGES = [
    (37, 53, "RGB", "PNG"),
    (300, 200, "RGBA", "PNG"),
    (640, 480, "L", "PNG"),
    (1001, 333, "P", "PNG"),
    (2000, 30, "RGB", "PNG"),
    (257, 256, "RGB", "JPEG"),
    (401, 299, "RGBA", "WEBP"),
]


@pytest.mark.parametrize(("width", "height", "mode", "fmt"), IMAGES, ids=lambda v: str(v))
def test_rows_are_transformers_pixel_values(width: int, height: int, mode: str, fmt: str) -> None:
    data = encoded(picture(width, height, seed=width, mode=mode), fmt)
    mime = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}[fmt]
    mine = read_image(ImagePart(data=data, mime_type=mime), "image", published())
    want = reference()(images=[PILImage.open(io.BytesIO(data))], return_tensors="np")
    assert [list(mine.grid_thw)] == want["image_grid_thw"].tolist()
    assert mine.pixels.dtype == np.float32
    assert np.array_equal(mine.pixels, want["pixel_values"])


def test_an_exif_rotated_photo_is_read_upright_as_transformers_loads_it() -> None:
    """A JPEG whose EXIF says "rotate 90": transformers' `load_image` turns it upright."""
    from PIL import ImageOps

    exif = PILImage.Exif()
    exif[0x0112] = 6  # Orientation: the stored pixels are a quarter turn off
    data = encoded(picture(320, 200), "JPEG", exif=exif)
    mine = read_image(ImagePart(data=data), "image", published())
    upright = ImageOps.exif_transpose(PILImage.open(io.BytesIO(data)))
    want = reference()(images=[upright], return_tensors="np")
    assert mine.grid_thw[1] > mine.grid_thw[2], "upright: taller than wide"
    assert np.array_equal(mine.pixels, want["pixel_values"])


def test_the_test_towers_files_are_read(tmp_path: Path) -> None:
    pre, why = preprocessor_of(files_of(write_vision_files(tmp_path)))
    assert pre is not None, why
    assert (pre.patch_size, pre.min_pixels, pre.max_pixels) == (4, 1024, 16384)
    assert pre.image_token_id == 409


def _edited(config: dict | None = None, processor: dict | None = None) -> dict[str, bytes]:
    files = published_files()
    raw = {k: json.loads(v) for k, v in files.items()}
    raw["config.json"] |= config or {}
    raw["preprocessor_config.json"] |= processor or {}
    return {k: json.dumps(v).encode() for k, v in raw.items()}


TEXT_ONLY = {
    "no-config": ({"preprocessor_config.json": b"{}"}, "has no config.json"),
    "no-vision": (_edited({"vision_config": None}), "has no vision_config"),
    "no-preprocessor": (
        {"config.json": (PUBLISHED_CONFIG / "config.json").read_bytes()},
        "a vision tower but no preprocessor_config.json",
    ),
    "not-json": ({**published_files(), "preprocessor_config.json": b"{"}, "is not JSON"),
    "model-type": (_edited({"model_type": "qwen2_vl"}), "model_type is 'qwen2_vl'"),
    "patch": (_edited(processor={"patch_size": 14}), "patch_size is 14, the vision tower's"),
    "merge": (_edited(processor={"merge_size": 4}), "merge_size is 4"),
    "processor": (
        _edited(processor={"image_processor_type": "SiglipImageProcessor"}),
        "image_processor_type 'SiglipImageProcessor'",
    ),
    "unknown": (_edited(processor={"do_pad": True}), "sets do_pad, which this server"),
    "rgb": (_edited(processor={"do_convert_rgb": False}), "do_convert_rgb false"),
    "mean": (_edited(processor={"image_mean": [0.5]}), "image_mean must list one value"),
    "pixels": (_edited(processor={"min_pixels": 10, "max_pixels": 5}), "10 .. 5 pixels"),
}


@pytest.mark.parametrize(("files", "why"), TEXT_ONLY.values(), ids=TEXT_ONLY.keys())
def test_what_is_not_followed_leaves_the_model_text_only(files: dict, why: str) -> None:
    pre, said = preprocessor_of(files)
    assert pre is None
    assert why in said


def test_min_and_max_pixels_override_size() -> None:
    pre, _ = preprocessor_of(_edited(processor={"min_pixels": 3136, "max_pixels": 12845056}))
    assert pre is not None and (pre.min_pixels, pre.max_pixels) == (3136, 12845056)
