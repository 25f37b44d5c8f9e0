"""The files of a Qwen3.5 checkpoint that the control plane reads for a chat with images,
written by transformers' own classes: the test checkpoints' tokenizer (Qwen's vision tokens at
the config's ids, `tests/qwen3_5_checkpoint.py`) with Qwen3.6's chat template, which renders
image parts; config.json of `Qwen3_5Config` with the test tower; and preprocessor_config.json
of transformers' Qwen2-VL image processor cut for that tower (patch 4, merge 2). Beside them,
transformers' Qwen3-VL processor over the same files, the reference for ids and pixels, and
small images encoded as a client sends them."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image as PILImage
from transformers import PreTrainedTokenizerFast, Qwen3_5Config, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.qwen3_5_checkpoint import TEXT, VISION, VISION_TOKENS, tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
QWEN36_TEMPLATE = (FIXTURES / "qwen3.6" / "chat_template.jinja").read_text()
# As Qwen publishes it for Qwen3.5 and Qwen3.6 (patch 16), beside the flagship's config.
PUBLISHED_PREPROCESSOR = FIXTURES / "qwen3.5" / "preprocessor_config.json"
PUBLISHED_CONFIG = Path(__file__).resolve().parents[1] / "gpu_service/models/qwen3.5-35b-a3b"
# The test tower's preprocessing: Qwen's normalisation, bounds small enough for a CPU (an
# image becomes 64 to 1024 patches of 4 x 4, 16 to 256 placeholder tokens).
PREPROCESSOR = dict(
    size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
    patch_size=VISION["patch_size"],
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)


def write_preprocessor(directory: Path) -> None:
    """preprocessor_config.json for the test tower, as transformers saves one."""
    Qwen2VLImageProcessorPil(**PREPROCESSOR).save_pretrained(directory)


def write_vision_files(directory: Path) -> Path:
    """The control plane's files of a test checkpoint with a vision tower (no weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    tok.chat_template = QWEN36_TEMPLATE
    tok.save_pretrained(directory)
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in VISION_TOKENS.items()}
    Qwen3_5Config(text_config=TEXT, vision_config=VISION, **ids).to_json_file(
        directory / "config.json"
    )
    write_preprocessor(directory)
    return directory


def files_of(directory: Path) -> dict[str, bytes]:
    from protos.model import read_tokenizer_files

    return read_tokenizer_files(directory)


class ImagesOnlyProcessor(Qwen3VLProcessor):
    """transformers' Qwen3-VL processor without its video processor, which needs torchvision
    (not installed): images and text go through its own code."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def reference(directory: Path) -> ImagesOnlyProcessor:
    """transformers' processor over the files `write_vision_files` wrote."""
    tok = PreTrainedTokenizerFast.from_pretrained(directory)
    images = Qwen2VLImageProcessorPil.from_pretrained(directory)
    return ImagesOnlyProcessor(images, tok, None, chat_template=QWEN36_TEMPLATE)


def picture(width: int, height: int, seed: int = 0, mode: str = "RGB") -> PILImage.Image:
    """A noisy gradient, so that resizing has something to blend."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    noise = rng.normal(0, 30, (height, width, 4))
    pixels = np.clip(x * 0.6 + y * 0.4 + noise, 0, 255).astype(np.uint8)
    return PILImage.fromarray(pixels, "RGBA").convert(mode)


def encoded(image: PILImage.Image, fmt: str = "PNG", **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims `width` x `height` pixels and holds none of them."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")
