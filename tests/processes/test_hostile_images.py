"""Hostile image parts against both processes, the GPU service serving a Qwen3.5 checkpoint
with its vision tower and preprocessor_config.json (which reach the control plane with the
tokenizer's files): a truncated file, a 0x0 image, a header claiming 20,000 x 20,000 pixels,
the wrong MIME type, 100 images, an http URL, file:// URLs out of the allowed directory, and
more, over the OpenAI, Anthropic and Responses fronts and gRPC. Each is refused with 400 /
INVALID_ARGUMENT and a sentence naming the part, never a 500, while a canary completion runs
beside it (its worst latency under a second) and `/health` answers throughout."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import SERVE_ARGS
from tests.processes.test_hostile_requests import model, probed
from tests.qwen3_5_checkpoint import make
from tests.vision_files import (
    QWEN36_TEMPLATE,
    data_url,
    encoded,
    picture,
    png_header,
    write_preprocessor,
)

# Slow: both service processes of its own, on a checkpoint of its own.
pytestmark = pytest.mark.slow

MOST_IMAGES, MOST_BYTES = 4, 64 << 10
PNG = encoded(picture(40, 30))
NOISE = encoded(picture(160, 160).effect_spread(40))  # past MOST_BYTES, whatever compresses


@dataclass
class Pair:
    gpu: Any
    control: Any
    http: str
    grpc_target: str
    media: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    directory = tmp_path_factory.mktemp("qwen3.5-vision")
    make(directory, "dense")
    write_preprocessor(directory)
    (directory / "chat_template.jinja").write_text(QWEN36_TEMPLATE)
    media, secret = tmp_path_factory.mktemp("media"), tmp_path_factory.mktemp("secret")
    (secret / "key.png").write_bytes(PNG)
    (media / "link.png").symlink_to(secret / "key.png")
    gpu, target = start_gpu_service(directory, *SERVE_ARGS)
    try:
        seen: list[str] = []
        flags = (
            *("--http-port", "0", "--allowed-local-media-path", str(media)),
            *("--limit-mm-per-prompt", json.dumps({"image": MOST_IMAGES})),
            *("--max-image-bytes", str(MOST_BYTES)),
        )
        control, cp_target = start_control_plane(target, *flags, seen=seen)
        http = next(line.split(" on ", 1)[1].strip() for line in seen if "OpenAI API on" in line)
        try:
            yield Pair(gpu, control, http.removesuffix("/v1"), cp_target, media)
        finally:
            assert stop(control) == 0
    finally:
        assert stop(gpu) == 0


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts: dict) -> dict:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return {"model": "MODEL", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


PART = "messages[0].content[1]"
OPENAI = {
    "truncated": (chat(image_url(data_url(PNG[:100]))), f"{PART} is a PNG image that does not"),
    "0x0": (chat(image_url(data_url(png_header(0, 0)))), f"{PART} is not a PNG, JPEG or WebP"),
    "20000x20000": (
        chat(image_url(data_url(png_header(20_000, 20_000)))),
        f"{PART} claims more than",
    ),
    "9000x9000": (chat(image_url(data_url(png_header(9000, 9000)))), "is 9000x9000 pixels"),
    "wrong-mime": (
        chat(image_url(data_url(PNG, "image/webp"))),
        f"{PART} is said to be image/webp, but its bytes are a PNG image",
    ),
    "gif": (chat(image_url(data_url(PNG, "image/gif"))), f"{PART} is of type image/gif"),
    "not-base64": (chat(image_url("data:image/png;base64,!!!!")), "whose data is not base64"),
    "too-large": (
        chat(image_url(data_url(NOISE))),
        f"this server takes images of at most {MOST_BYTES}",
    ),
    "100-images": (
        chat(*[image_url(data_url(PNG))] * 100),
        f"the messages hold 100 images; this server takes at most {MOST_IMAGES} a request",
    ),
    "http": (chat(image_url("https://example.com/cat.png")), f"{PART} is an https URL; this"),
    "file-outside": (chat(image_url("file:///etc/hostname")), "outside --allowed-local-media"),
    "file-link-out": (chat(image_url("file://MEDIA/link.png")), "outside --allowed-local-media"),
    "detail": (
        chat({"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "low"}}),
        "as detail auto",
    ),
    "typed-placeholder": (
        chat(image_url(data_url(PNG)), {"type": "text", "text": "<|image_pad|>"}),
        "the prompt holds 2 image placeholders",
    ),
}
ANTHROPIC_IMAGE = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/jpeg", "data": data_url(PNG).split(",")[1]},
}
OTHER_FRONTS = {
    "anthropic-wrong-mime": (
        "/v1/messages",
        {
            "model": "MODEL",
            "max_tokens": 2,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "x"}, ANTHROPIC_IMAGE]}
            ],
        },
        f"{PART} is said to be image/jpeg, but its bytes are a PNG image",
    ),
    "responses-http": (
        "/v1/responses",
        {
            "model": "MODEL",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "http://example.com/a.png"}],
                }
            ],
        },
        "input[0].content[0] is an http URL; this server fetches nothing",
    ),
}


def refused(reply: httpx.Response) -> str:
    body = reply.json()
    return body["error"]["message"]


def test_hostile_images_over_http_are_400_and_leave_the_rest_alone(pair: Pair) -> None:
    probes = {k: ("/v1/chat/completions", body, s) for k, (body, s) in OPENAI.items()}
    for name, (path, body, sentence) in {**probes, **OTHER_FRONTS}.items():
        text = json.dumps(body).replace("MEDIA", str(pair.media))
        reply, seconds, beside = probed(pair.http, path, text)
        assert reply.status_code == 400, (name, reply.text[:300])
        assert sentence in refused(reply), (name, refused(reply))
        assert beside.canary_worst < 1.0, (name, beside.canary_worst)
        assert beside.health and set(beside.health) == {200}, name


def test_a_good_image_is_read_through_every_stage_and_answered(pair: Pair) -> None:
    """The files came from the service; the image reaches its prefill and the chat its
    answer."""
    with httpx.Client(base_url=pair.http, timeout=60) as client:
        body = {**chat(image_url(data_url(PNG))), "model": model(client)}
        # The chat's default temperature is 1: the random checkpoint samples its end about
        # once in 150 requests, so two tokens are asked for whatever it draws.
        body |= {"temperature": 0, "ignore_eos": True}
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 2
        counted = client.post("/tokenize", json={k: body[k] for k in ("model", "messages")})
    # 40 x 30 pixels: 40 x 32 resized, 10 x 8 patches of 4, 20 merged.
    assert counted.status_code == 200 and counted.json()["tokens"].count(409) == 20


def grpc_chat(*parts: pb.ContentPart) -> pb.GenerateRequest:
    message = pb.ChatMessage(role="user", parts=[pb.ContentPart(text="What is it?"), *parts])
    return pb.GenerateRequest(messages=[message], max_new_tokens=2)


def test_hostile_images_over_grpc_are_invalid_argument(pair: Pair) -> None:
    image = pb.ContentPart(image=pb.ImagePart(data=PNG[:100], mime_type="image/png"))
    requests = [
        (grpc_chat(image), "messages[0].parts[1] is a PNG image that does not decode"),
        (grpc_chat(*[pb.ContentPart(image=pb.ImagePart(data=PNG))] * 100), "hold 100 images"),
        (grpc_chat(pb.ContentPart(image=pb.ImagePart(url="http://x/a.png"))), "fetches nothing"),
    ]
    with grpc.insecure_channel(pair.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for request, sentence in requests:
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert sentence in (caught.value.details() or "")


def mutated(rng: random.Random, data: bytes) -> bytes:
    """The file cut short, some bytes flipped, or garbage after a valid header."""
    kind = rng.randrange(3)
    if kind == 0:
        return data[: rng.randrange(1, len(data))]
    if kind == 1:
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    return data[:32] + rng.randbytes(rng.randrange(64, 2048))


def test_mutated_image_files_are_refused_or_read_never_an_internal_error(pair: Pair) -> None:
    """Seeded mutations of a PNG, a JPEG and a WebP over gRPC: each is refused as
    INVALID_ARGUMENT, or decodes and is answered; never UNKNOWN or INTERNAL, and the canary
    completes after them."""
    rng = random.Random(65)
    files = [encoded(picture(48, 40), fmt) for fmt in ("PNG", "JPEG", "WEBP")]
    seen: dict[str, int] = {}
    with grpc.insecure_channel(pair.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for i in range(36):
            data = mutated(rng, files[i % 3])
            request = grpc_chat(pb.ContentPart(image=pb.ImagePart(data=data)))
            try:
                replies = list(stub.Generate(request, timeout=30))
                code = grpc.StatusCode.OK
                assert replies[-1].finish_reason in ("stop", "length"), (i, replies[-1])
            except grpc.RpcError as e:
                code = e.code()
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (i, code, e.details())
            seen[code.name] = seen.get(code.name, 0) + 1
        canary = pb.GenerateRequest(prompt_token_ids=[3, 4, 5], max_new_tokens=2, ignore_eos=True)
        assert len([r for r in stub.Generate(canary, timeout=30)]) > 0
    assert seen.get("INVALID_ARGUMENT", 0) > 12 and seen.get("OK", 0) > 0, seen
