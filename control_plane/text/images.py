"""A chat's images: each image part read to its file's bytes (a `data:` URL, a `file://` path
under `--allowed-local-media-path`, or bytes with their MIME type; http(s) URLs are refused, as
the server fetches nothing), decoded by PIL within the server's bounds (a header that claims too
many pixels is refused before any pixel is decoded), turned into the vision tower's rows
(`preprocessor.py`), and the placeholder each one's template rendered expanded in the prompt's
ids, one per merged patch, as transformers' processor expands `<|image_pad|>`.

Every refusal is a `ValueError` whose sentence opens with the part's name in the request
(`messages[0].content[1]`), which the fronts answer with 400 / INVALID_ARGUMENT."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
import stat
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
from PIL import Image as PILImage
from PIL import ImageOps

from control_plane.text.preprocessor import Preprocessor
from protos.handles import ImageInput
from protos.params import ImagePart

# The formats taken, by MIME type as a data: URL or a part names them (image/jpg: what some
# clients write for JPEG); PIL opens these and no other.
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
FORMAT_NAMES = "PNG, JPEG or WebP"
MIME_NAMES = "image/png, image/jpeg and image/webp"
DEFAULT_MAX_IMAGES = 8  # a request's images (vLLM's --limit-mm-per-prompt)
DEFAULT_MAX_IMAGE_BYTES = 20 << 20  # one image's file
# One image file's pixels, decoded: 4096 x 4096, Qwen3.5's and Qwen3.6's own most (their
# preprocessor's longest_edge), to which they would shrink a larger one.
DEFAULT_MAX_IMAGE_FILE_PIXELS = 4096 * 4096
# PIL's own bound (twice its MAX_IMAGE_PIXELS), past which it refuses to open an image at all.
PIL_MOST_PIXELS = 2 * (PILImage.MAX_IMAGE_PIXELS or 0)
LIMIT_FLAG = "--limit-mm-per-prompt"
LOCAL_FLAG = "--allowed-local-media-path"
NO_FETCH = "send the image in the request, as a data: URL (base64)"


@dataclass(frozen=True)
class Image:
    """One image of a request, as the vision tower takes it: exactly transformers'
    `pixel_values` rows and `image_grid_thw` for it."""

    pixels: np.ndarray  # float32 [t*h*w, channels * temporal_patch_size * patch_size**2]
    grid_thw: tuple[int, int, int]  # patches in time, height and width
    digest: bytes  # sha256 of the image file's bytes: what the prefix cache keys it by

    def to_input(self) -> ImageInput:
        """As a prefill carries it to the GPU service (`protos.handles.ImageInput`)."""
        rows = np.ascontiguousarray(self.pixels, dtype="<f4")
        return ImageInput(rows.tobytes(), self.grid_thw, self.digest)


@dataclass(frozen=True)
class ImageSpan:
    """Where an image's placeholders lie in a prompt's ids, and which image they stand for."""

    start: int  # the index of its first placeholder
    length: int  # its placeholders: one per merged patch
    digest: bytes  # its `Image.digest`


@dataclass(frozen=True)
class MediaBounds:
    """What a request's images may take: `max_images` a request (vLLM's
    `--limit-mm-per-prompt`), `max_image_bytes` and `max_image_file_pixels` each (a file's,
    before the preprocessor's resize), and the directory `file://` URLs may read under (None:
    none)."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_file_pixels: int = DEFAULT_MAX_IMAGE_FILE_PIXELS
    allowed_local_path: str | None = None


def read_image(
    part: ImagePart, where: str, pre: Preprocessor, bounds: MediaBounds = MediaBounds()
) -> Image:
    """The part's image, read, decoded and preprocessed; `ValueError` with a sentence naming
    `where` for any image the server will not take."""
    data, mime = image_file(part, where, bounds)
    picture = decoded(data, mime, where, bounds)
    try:
        pixels, grid = pre.rows(picture)
    except ValueError as e:
        raise ValueError(f"{where} {e}") from None
    return Image(pixels, grid, hashlib.sha256(data).digest())


def image_file(part: ImagePart, where: str, bounds: MediaBounds) -> tuple[bytes, str | None]:
    """The image file's bytes and the MIME type the request gave them (None: none given),
    at most `max_image_bytes`."""
    data, mime = _source(part, where, bounds)
    if len(data) > bounds.max_image_bytes:
        raise _too_large(where, len(data), bounds)
    return data, mime


def _source(part: ImagePart, where: str, bounds: MediaBounds) -> tuple[bytes, str | None]:
    if part.data and part.url:
        raise ValueError(f"{where} gives both data and a url; give one")
    if part.data:
        return part.data, _mime(part.mime_type, where) if part.mime_type else None
    if not part.url:
        raise ValueError(f"{where} is an image with neither data nor a url")
    scheme = part.url.partition(":")[0].lower()
    if scheme == "data":
        return _data_url(part.url, where, bounds)
    if scheme == "file":
        return _local_file(part.url, where, bounds), None
    if scheme in ("http", "https"):
        raise ValueError(f"{where} is an {scheme} URL; this server fetches nothing: {NO_FETCH}")
    kind = f"a URL of scheme {scheme!r}" if scheme.isalpha() and len(scheme) <= 16 else "no URL"
    raise ValueError(
        f"{where} is {kind}; this server takes data: URLs (data:image/png;base64,...) and, "
        f"under {LOCAL_FLAG}, file:// ones"
    )


def _mime(mime: str, where: str) -> str:
    mime = mime.strip().lower()
    if mime not in FORMATS:
        shown = mime if len(mime) <= 40 else mime[:37] + "..."
        raise ValueError(f"{where} is of type {shown or 'none'}; this server takes {MIME_NAMES}")
    return mime


def _too_large(where: str, size: int, bounds: MediaBounds) -> ValueError:
    return ValueError(
        f"{where} is {size} bytes; this server takes images of at most "
        f"{bounds.max_image_bytes} bytes"
    )


def _data_url(url: str, where: str, bounds: MediaBounds) -> tuple[bytes, str]:
    """`data:<mime>[;params];base64,<data>`, its size checked before it is decoded."""
    header, comma, payload = url[len("data:") :].partition(",")
    params = [p.strip().lower() for p in header.split(";")]
    if not comma or "base64" not in params[1:]:
        raise ValueError(
            f"{where} is a data: URL that is not base64 (data:<type>;base64,<data>); this "
            "server takes images base64-encoded"
        )
    mime = _mime(params[0], where)
    if len(payload) > (bounds.max_image_bytes + 2) // 3 * 4:
        raise _too_large(where, len(payload) // 4 * 3, bounds)
    try:
        return base64.b64decode(payload, validate=True), mime
    except (binascii.Error, ValueError):
        raise ValueError(f"{where} is a data: URL whose data is not base64") from None


def _local_file(url: str, where: str, bounds: MediaBounds) -> bytes:
    """A `file://` URL's file, read only when it lies under `--allowed-local-media-path` once
    every link is followed (checked again on the open file, so no link swapped in between
    leads out)."""
    if bounds.allowed_local_path is None:
        raise ValueError(
            f"{where} is a file:// URL; this server reads no local files unless started with "
            f"{LOCAL_FLAG}: {NO_FETCH}"
        )
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
        raise ValueError(f"{where} is a file:// URL without an absolute path on this host")
    root = Path(bounds.allowed_local_path).resolve()
    outside = ValueError(f"{where} is a file:// URL outside {LOCAL_FLAG}")
    try:
        path = Path(unquote(parsed.path)).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a loop of links
        raise ValueError(f"{where} is a file:// URL that names no readable file") from None
    if not path.is_relative_to(root):
        raise outside
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise ValueError(f"{where} is a file:// URL that names no readable file") from None
    try:
        if not Path(os.path.realpath(f"/proc/self/fd/{fd}")).is_relative_to(root):
            raise outside
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{where} is a file:// URL that names no regular file")
        if info.st_size > bounds.max_image_bytes:
            raise _too_large(where, info.st_size, bounds)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(bounds.max_image_bytes + 1)  # a file grown since: checked after
    finally:
        os.close(fd)


def decoded(data: bytes, mime: str | None, where: str, bounds: MediaBounds) -> PILImage.Image:
    """The file's image, upright (its EXIF orientation applied) and in RGB (transparency
    over white), as transformers loads and converts one; its size is read from its header and
    checked before its pixels are decoded."""
    try:
        with warnings.catch_warnings():
            # Its bound is checked below, with this server's sentence.
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            picture = PILImage.open(io.BytesIO(data), formats=sorted(set(FORMATS.values())))
    except PILImage.DecompressionBombError:
        raise ValueError(
            f"{where} claims more than {PIL_MOST_PIXELS} pixels; this server takes images of at "
            f"most {bounds.max_image_file_pixels}"
        ) from None
    except MemoryError:
        raise
    except Exception:  # PIL's plugins raise their own types for what they cannot parse
        raise ValueError(f"{where} is not a {FORMAT_NAMES} image") from None
    _check_header(picture, mime, where, bounds)
    try:
        picture.load()
    except MemoryError:
        raise
    except Exception as e:  # a truncated or corrupt file: the decoder's own type and words
        raise ValueError(f"{where} is a {picture.format} image that does not decode: {e}") from None
    return _rgb(ImageOps.exif_transpose(picture))


def _check_header(picture: PILImage.Image, mime: str | None, where: str, b: MediaBounds) -> None:
    width, height = picture.size
    if width * height == 0:
        raise ValueError(f"{where} is {width}x{height} pixels; an image needs at least one")
    if width * height > b.max_image_file_pixels:
        raise ValueError(
            f"{where} is {width}x{height} pixels; this server takes images of at most "
            f"{b.max_image_file_pixels} pixels"
        )
    if mime is not None and FORMATS[mime] != picture.format:
        raise ValueError(
            f"{where} is said to be {mime}, but its bytes are a {picture.format} image"
        )
    frames = getattr(picture, "n_frames", 1)
    if frames > 1:
        raise ValueError(
            f"{where} is an animated image of {frames} frames; this server takes still images"
        )


def _rgb(picture: PILImage.Image) -> PILImage.Image:
    """transformers' `convert_to_rgb`: an image with transparency composited over white."""
    if "A" in picture.getbands() or picture.info.get("transparency") is not None:
        white = PILImage.new("RGBA", picture.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(white, picture.convert("RGBA")).convert("RGB")
    return picture.convert("RGB")


def expanded(ids: Sequence[int], pre: Preprocessor, images: Sequence[Image]) -> list[int]:
    """The prompt's ids with each image placeholder repeated once per merged patch of its
    image, in order; `ValueError` when the prompt's placeholders and its images differ in
    number (a placeholder typed into a message's text). A prompt without images is left as it
    is: its placeholders are text, as transformers reads them without pixels."""
    if not images:
        return list(ids)
    pad = pre.image_token_id
    held = sum(1 for t in ids if t == pad)
    if held != len(images):
        images_held = f"{len(images)} image{'' if len(images) == 1 else 's'}"
        raise ValueError(
            f"the prompt holds {held} image placeholders (token {pad}) for {images_held}; the "
            "chat template writes one for each image part, and a message's text may hold none"
        )
    out: list[int] = []
    rest = iter(images)
    for t in ids:
        out.extend([t] * pre.tokens(next(rest).grid_thw) if t == pad else (t,))
    return out


def spans(ids: Sequence[int], pre: Preprocessor, images: Sequence[Image]) -> tuple[ImageSpan, ...]:
    """Each image's placeholders in `expanded` ids, in order."""
    out, at = [], 0
    for image in images:
        while ids[at] != pre.image_token_id:
            at += 1
        length = pre.tokens(image.grid_thw)
        out.append(ImageSpan(at, length, image.digest))
        at += length
    return tuple(out)


def starting_in(
    located: Sequence[ImageSpan], images: Sequence[Image], start: int, end: int
) -> list[Image]:
    """The images whose first placeholder lies in the prompt's tokens `start .. end - 1`: those
    a prefill of that chunk carries (the service keeps an image's embeddings until its last
    placeholder is in)."""
    return [i for s, i in zip(located, images, strict=True) if start <= s.start < end]


# A prompt's ids with each image's placeholders as its digest: how the prefix cache tells two
# images apart where their placeholder tokens are alike.
Keyed = tuple[int | bytes, ...]


def keyed(tokens: tuple[int, ...], images: Sequence[ImageSpan]) -> Keyed:
    """`tokens` with each image's placeholders as its digest (the tokens themselves, with
    no image)."""
    if not images:
        return tokens
    out: list[int | bytes] = list(tokens)
    for image in images:
        out[image.start : image.start + image.length] = [image.digest] * image.length
    return tuple(out)


def limit_per_prompt(text: str) -> int:
    """vLLM's `--limit-mm-per-prompt` JSON (`{"image": 4}`) as the images a request may hold;
    `ValueError` with a sentence for anything else (a modality this server does not take may
    be given only as 0)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or not all(isinstance(v, int) for v in value.values()):
        raise ValueError(f'{text!r} is not a JSON object of counts, such as {{"image": 4}}')
    others = {k: v for k, v in value.items() if k != "image" and v}
    if others:
        raise ValueError(
            f"{', '.join(sorted(others))} cannot be taken: this server takes images only "
            "(give other modalities as 0)"
        )
    images = value.get("image", DEFAULT_MAX_IMAGES)
    if images < 0:
        raise ValueError(f"image is {images}; it must be 0 or more")
    return images
