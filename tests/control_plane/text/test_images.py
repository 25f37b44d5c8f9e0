"""An image part read to its image: data: URLs of each format, file:// URLs under the allowed
directory only (links out of it refused), http(s) refused; every image the server will not
take (not an image, truncated, 0x0, a header claiming 20,000 x 20,000 pixels, the wrong MIME
type, animated, too large) refused with a sentence naming the part, the oversized ones before
any pixel is decoded; placeholders expanded as transformers' processor expands them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage
from PIL import ImageFile

from control_plane.text.images import (
    DEFAULT_MAX_IMAGES,
    Image,
    ImageSpan,
    MediaBounds,
    expanded,
    limit_per_prompt,
    read_image,
    spans,
    starting_in,
)
from control_plane.text.preprocessor import Preprocessor, preprocessor_of
from protos.params import ImagePart
from tests.vision_files import (
    data_url,
    encoded,
    files_of,
    picture,
    png_header,
    write_vision_files,
)

WHERE = "messages[0].content[1]"


@pytest.fixture(scope="module")
def pre(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    found, why = preprocessor_of(files_of(write_vision_files(tmp_path_factory.mktemp("v"))))
    assert found is not None, why
    return found


def animated() -> bytes:
    frames = [picture(16, 16, seed=s) for s in range(3)]
    return encoded(frames[0], "PNG", save_all=True, append_images=frames[1:])


PNG = encoded(picture(40, 30))


@pytest.mark.parametrize(
    "part",
    [
        ImagePart(url=data_url(PNG)),
        ImagePart(url="DATA:Image/PNG;base64," + data_url(PNG).split(",")[1]),
        ImagePart(url=data_url(encoded(picture(40, 30), "JPEG"), "image/jpeg")),
        ImagePart(url=data_url(encoded(picture(40, 30), "JPEG"), "image/jpg")),
        ImagePart(url=data_url(encoded(picture(40, 30), "WEBP"), "image/webp")),
        ImagePart(data=PNG, mime_type="image/png"),
        ImagePart(data=PNG),
    ],
    ids=["png", "upper-case", "jpeg", "jpg", "webp", "bytes", "bytes-no-mime"],
)
def test_an_image_is_read(part: ImagePart, pre: Preprocessor) -> None:
    image = read_image(part, WHERE, pre)
    assert image.grid_thw == (1, 8, 10)  # 40 x 30 -> 40 x 32 pixels, in patches of 4
    assert image.pixels.shape == (80, pre.row_width)


def test_the_digest_is_the_files_sha256(pre: Preprocessor) -> None:
    import hashlib

    assert read_image(ImagePart(url=data_url(PNG)), WHERE, pre).digest == (
        hashlib.sha256(PNG).digest()
    )


FEW_BYTES = MediaBounds(max_image_bytes=len(PNG) - 1)
REFUSED = {
    "not-an-image": (ImagePart(data=b"hello, world"), "is not a PNG, JPEG or WebP image"),
    "gif": (ImagePart(data=encoded(picture(8, 8), "GIF")), "is not a PNG, JPEG or WebP image"),
    "truncated-png": (ImagePart(data=PNG[: len(PNG) // 2]), "is a PNG image that does not decode"),
    "truncated-jpeg": (
        ImagePart(data=encoded(picture(64, 64), "JPEG")[:300]),
        "is not a PNG, JPEG or WebP image",
    ),
    "0x0": (ImagePart(data=png_header(0, 0)), "is not a PNG, JPEG or WebP image"),
    "header-only": (ImagePart(data=png_header(64, 64)), "does not decode"),
    "wrong-mime": (ImagePart(url=data_url(PNG, "image/jpeg")), "said to be image/jpeg, but its"),
    "wrong-mime-bytes": (ImagePart(data=PNG, mime_type="image/webp"), "said to be image/webp"),
    "gif-mime": (ImagePart(url=data_url(PNG, "image/gif")), "is of type image/gif; this server"),
    "no-mime": (ImagePart(url="data:;base64," + data_url(PNG).split(",")[1]), "of type none"),
    "not-base64": (ImagePart(url="data:image/png;base64,@@@@"), "whose data is not base64"),
    "plain-data": (ImagePart(url="data:image/png,abc"), "a data: URL that is not base64"),
    "animated": (ImagePart(data=animated()), "is an animated image of 3 frames"),
    "narrow": (ImagePart(data=encoded(picture(1, 300))), "more than 200 times the other"),
    "http": (ImagePart(url="http://example.com/a.png"), "is an http URL; this server fetches"),
    "https": (ImagePart(url="https://example.com/a.png"), "is an https URL; this server fetches"),
    "ftp": (ImagePart(url="ftp://example.com/a.png"), "of scheme 'ftp'"),
    "raw-base64": (ImagePart(url=data_url(PNG).split(",")[1]), "is no URL; this server takes"),
    "file-not-allowed": (ImagePart(url="file:///etc/passwd"), "reads no local files unless"),
    "empty": (ImagePart(), "is an image with neither data nor a url"),
    "both": (ImagePart(data=PNG, url=data_url(PNG)), "gives both data and a url"),
}


@pytest.mark.parametrize(("part", "sentence"), REFUSED.values(), ids=REFUSED.keys())
def test_a_bad_image_is_refused_naming_its_part(
    part: ImagePart, sentence: str, pre: Preprocessor
) -> None:
    with pytest.raises(ValueError) as caught:
        read_image(part, WHERE, pre)
    assert str(caught.value).startswith(WHERE + " ")
    assert sentence in str(caught.value)


BOUNDED = {
    "bytes": (ImagePart(data=PNG), FEW_BYTES, f"is {len(PNG)} bytes; this server takes images"),
    "data-url": (ImagePart(url=data_url(PNG)), FEW_BYTES, f"is {len(PNG)} bytes; this server"),
    "pixels": (
        ImagePart(data=PNG),
        MediaBounds(max_image_file_pixels=40 * 30 - 1),
        "is 40x30 pixels; this server takes images of at most 1199",
    ),
}


@pytest.mark.parametrize(("part", "bounds", "sentence"), BOUNDED.values(), ids=BOUNDED.keys())
def test_the_bounds_refuse(
    part: ImagePart, bounds: MediaBounds, sentence: str, pre: Preprocessor
) -> None:
    with pytest.raises(ValueError, match=sentence):
        read_image(part, WHERE, pre, bounds)


@pytest.mark.parametrize(
    ("width", "height", "sentence"),
    [(20_000, 20_000, "claims more than"), (9000, 9000, "is 9000x9000 pixels")],
)
def test_a_huge_header_is_refused_before_any_pixel_is_decoded(
    width: int, height: int, sentence: str, pre: Preprocessor, monkeypatch: pytest.MonkeyPatch
) -> None:
    def load(self: PILImage.Image) -> None:
        raise AssertionError("the pixels of an image past the bound were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    with pytest.raises(ValueError, match=sentence):
        read_image(ImagePart(data=png_header(width, height)), WHERE, pre)


def test_a_local_file_is_read_only_under_the_allowed_directory(
    tmp_path: Path, pre: Preprocessor
) -> None:
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(PNG)
    (outside / "key.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(outside / "key.png")
    (allowed / "inner.png").symlink_to(allowed / "cat.png")
    os.mkfifo(allowed / "pipe.png")
    bounds = MediaBounds(allowed_local_path=str(allowed))

    def read(path: Path | str) -> Image:
        return read_image(ImagePart(url=f"file://{path}"), WHERE, pre, bounds)

    assert read(allowed / "cat.png").grid_thw == (1, 8, 10)
    assert read(allowed / "inner.png").grid_thw == (1, 8, 10)
    assert read(f"{allowed}/../media/cat.png").grid_thw == (1, 8, 10)
    refused = {
        outside / "key.png": "outside --allowed-local-media-path",
        allowed / "link.png": "outside --allowed-local-media-path",
        f"{allowed}/../secret/key.png": "outside --allowed-local-media-path",
        allowed / "missing.png": "names no readable file",
        allowed: "names no regular file",
        allowed / "pipe.png": "names no regular file",
    }
    for path, sentence in refused.items():
        with pytest.raises(ValueError, match=sentence):
            read(path)
    with pytest.raises(ValueError, match="without an absolute path on this host"):
        read_image(ImagePart(url="file://elsewhere/cat.png"), WHERE, pre, bounds)


def _image(pre: Preprocessor, grid: tuple[int, int, int]) -> Image:
    rows = np.zeros((grid[0] * grid[1] * grid[2], pre.row_width), np.float32)
    return Image(rows, grid, b"")


def test_placeholders_are_expanded_one_per_merged_patch(pre: Preprocessor) -> None:
    pad, start, end = pre.image_token_id, 406, 407
    ids = [1, start, pad, end, 2, start, pad, end, 3]
    images = [_image(pre, (1, 4, 6)), _image(pre, (1, 2, 2))]
    assert expanded(ids, pre, images) == [1, start, *[pad] * 6, end, 2, start, pad, end, 3]


def test_a_placeholder_without_its_image_is_refused(pre: Preprocessor) -> None:
    pad = pre.image_token_id
    with pytest.raises(
        ValueError, match=f"holds 2 image placeholders \\(token {pad}\\) for 1 image;"
    ):
        expanded([pad, 5, pad], pre, [_image(pre, (1, 2, 2))])
    assert expanded([pad, 5], pre, []) == [pad, 5], "without images, text: as transformers"


def test_the_limit_reads_as_vllm_writes_it() -> None:
    assert limit_per_prompt('{"image": 3}') == 3
    assert limit_per_prompt('{"image": 0, "video": 0}') == 0
    assert limit_per_prompt("{}") == DEFAULT_MAX_IMAGES
    for text, sentence in [
        ("3", "not a JSON object of counts"),
        ('{"image": "3"}', "not a JSON object of counts"),
        ('{"video": 1}', "video cannot be taken"),
        ('{"image": -1}', "image is -1"),
    ]:
        with pytest.raises(ValueError, match=sentence):
            limit_per_prompt(text)


def test_an_image_goes_to_the_service_as_float32_rows_with_the_chunk_of_its_first_token(
    pre: Preprocessor,
) -> None:
    image = read_image(ImagePart(url=data_url(PNG)), WHERE, pre)
    wire = image.to_input()
    assert (wire.grid_thw, wire.digest) == (image.grid_thw, image.digest)
    rows = np.frombuffer(wire.pixels, "<f4").reshape(image.pixels.shape)
    assert np.array_equal(rows, image.pixels)
    pad = pre.image_token_id
    other = _image(pre, (1, 2, 2))
    ids = expanded([1, pad, 2, pad, 3], pre, [image, other])
    located = spans(ids, pre, [image, other])
    assert located == (ImageSpan(1, 20, image.digest), ImageSpan(22, 1, b""))
    assert starting_in(located, [image, other], 0, 16) == [image], "its tokens run on"
    assert starting_in(located, [image, other], 16, 32) == [other]
    assert starting_in(located, [image, other], 2, 22) == []
