"""Chats with images through both processes (a GPU service process and a control plane
process, real gRPC over loopback), on a Qwen3.5 and a Qwen3.5-MoE checkpoint written by
transformers' own classes with their vision tower, preprocessor_config.json, Qwen3.6's chat
template and a DFlash drafter: greedy over the generation API with one image, and with a system
prompt and two (the first cut by a prefill chunk's end), equals transformers' `generate` on its
processor's input (input_ids, pixel_values, image_grid_thw) under none, mtp, dflash and the
server's choice; the official openai client sends the images as data: URLs, streamed and not,
and reads transformers' text; a chat with the same system prompt and image hits the prefix
cache past the image, or inside it, and answers as transformers does, and the same chat with
another image does not hit past the image's start."""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import torch
from PIL import Image as PILImage
from transformers import PreTrainedModel

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from gpu_service.model.config import ModelConfig
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.params import AUTO, DFLASH, MTP, NONE
from tests.conftest import SERVE_ARGS
from tests.gpu_service.dflash.drafter import write_drafter
from tests.processes.test_generation_api import collect
from tests.vision_files import (
    QWEN36_TEMPLATE,
    data_url,
    encoded,
    picture,
    reference,
    write_preprocessor,
)

# Slow: two pairs of service processes, and transformers' models beside them.
pytestmark = pytest.mark.slow

NEW = 8  # tokens each chat generates
METHODS = {
    NONE: pb.SPECULATIVE_METHOD_NONE,
    MTP: pb.SPECULATIVE_METHOD_MTP,
    DFLASH: pb.SPECULATIVE_METHOD_DFLASH,
    AUTO: pb.SPECULATIVE_METHOD_AUTO,
}
CAT = encoded(picture(40, 30, seed=1))  # 20 placeholders
DOG = encoded(picture(36, 44, seed=2), "JPEG")  # 16
SYSTEM = "You describe pictures for a catalogue, briefly and plainly."
OFF = {"enable_thinking": False}


@dataclass(frozen=True)
class Pair:
    directory: Path
    model: PreTrainedModel
    grpc: str
    http: str


@contextmanager
def _pair(source: Path, model: PreTrainedModel, directory: Path) -> Iterator[Pair]:
    """The checkpoint as a user serves one with images: its files, preprocessor_config.json,
    Qwen3.6's template and a DFlash drafter beside it; a GPU service with prefix snapshots and
    a control plane with its HTTP front, prefilling a KV block a call (a long prompt's images
    are cut across calls)."""
    shutil.copytree(source, directory)
    write_preprocessor(directory)
    (directory / "chat_template.jinja").write_text(QWEN36_TEMPLATE)
    drafter = write_drafter(directory / "dflash", ModelConfig.load(directory), taps=(1, 2))
    flags = ("--prefix-snapshots", "8", "--drafter", str(drafter))
    gpu, target = start_gpu_service(directory, *SERVE_ARGS, *flags)
    try:
        seen: list[str] = []
        cut = ("--prefill-chunk", "64")
        control, address = start_control_plane(target, "--http-port", "0", *cut, seen=seen)
        http = next(line.split(" on ", 1)[1].strip() for line in seen if "OpenAI API on" in line)
        try:
            yield Pair(directory, model, address, http)
        finally:
            assert stop(control) == 0
    finally:
        assert stop(gpu) == 0


@pytest.fixture(scope="module")
def pairs(qwen3_5_made: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with ExitStack() as stack:
        out = {}
        for kind in ("dense", "moe"):
            source, model = qwen3_5_made[kind]
            where = tmp_path_factory.mktemp(kind) / "checkpoint"
            out[kind] = stack.enter_context(_pair(source, model, where))
        yield out


# A chat: (role, [text or image bytes, ...]) per message.
Chat = list[tuple[str, list[Any]]]
ONE: Chat = [("user", ["What is in this picture?", CAT])]
TWO: Chat = [("system", [SYSTEM]), ("user", [CAT, "and then", DOG, "What changed?"])]


def _theirs(chat: Chat) -> list[dict]:
    def item(x: Any) -> dict:
        if isinstance(x, str):
            return {"type": "text", "text": x}
        return {"type": "image", "image": PILImage.open(io.BytesIO(x))}

    return [{"role": role, "content": [item(x) for x in parts]} for role, parts in chat]


def _inputs(pair: Pair, chat: Chat, **kwargs: Any) -> Any:
    """transformers' processor's input for the chat (`kwargs`: the template's variables)."""
    return reference(pair.directory).apply_chat_template(
        _theirs(chat),
        tokenize=True,
        return_dict=True,
        add_generation_prompt=True,
        return_tensors="pt",
        **kwargs,
    )


def generated(pair: Pair, chat: Chat, **kwargs: Any) -> tuple[list[int], Any]:
    """transformers' greedy tokens after its processor's input for the chat -> (the tokens,
    the input)."""
    inputs = _inputs(pair, chat, **kwargs)
    with torch.no_grad():
        out = pair.model.generate(
            **inputs,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist(), inputs


def _mime(data: bytes) -> str:
    return "image/png" if data.startswith(b"\x89PNG") else "image/jpeg"


def _wire(chat: Chat, method: str) -> pb.GenerateRequest:
    def part(x: Any) -> pb.ContentPart:
        if isinstance(x, str):
            return pb.ContentPart(text=x)
        return pb.ContentPart(image=pb.ImagePart(data=x, mime_type=_mime(x)))

    messages = [pb.ChatMessage(role=role, parts=[part(x) for x in parts]) for role, parts in chat]
    return pb.GenerateRequest(
        messages=messages,
        max_new_tokens=NEW,
        ignore_eos=True,
        speculative_method=METHODS[method],
    )


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_chats_with_images_are_transformers_under_every_method(
    pairs: dict, kind: str
) -> None:
    """One image, then a system prompt and two (PNG and JPEG): each method's tokens are
    transformers' `generate`; mtp and dflash drafted."""
    pair = pairs[kind]
    with grpc.insecure_channel(pair.grpc) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for chat in (ONE, TWO):
            theirs, inputs = generated(pair, chat)
            for method in METHODS:
                tokens, _, last = collect(stub, _wire(chat, method))
                assert tokens == theirs, (kind, len(chat), method)
                assert last.usage.prompt_tokens == inputs["input_ids"].shape[1]
                if method in (MTP, DFLASH):
                    assert last.speculative_stats.drafted > 0, (kind, method)


def _openai(chat: Chat) -> list[dict]:
    def item(x: Any) -> dict:
        if isinstance(x, str):
            return {"type": "text", "text": x}
        return {"type": "image_url", "image_url": {"url": data_url(x, _mime(x))}}

    return [{"role": role, "content": [item(x) for x in parts]} for role, parts in chat]


def test_the_openai_client_sends_an_image_and_reads_transformers_text(pairs: dict) -> None:
    pair = pairs["dense"]
    theirs, _ = generated(pair, TWO, **OFF)
    text = reference(pair.directory).tokenizer.decode(theirs, skip_special_tokens=True)
    client = openai.OpenAI(base_url=pair.http, api_key="none")
    ask: dict[str, Any] = dict(
        model=client.models.list().data[0].id,
        messages=_openai(TWO),
        max_tokens=NEW,
        temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": OFF},
    )
    done = client.chat.completions.create(**ask)
    assert done.choices[0].message.content == text and done.usage.completion_tokens == NEW
    chunks = client.chat.completions.create(**ask, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text


def _answer(client: openai.OpenAI, chat: Chat) -> tuple[int, str]:
    """-> (the chat's cached prompt tokens, its text)."""
    done = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=_openai(chat),
        max_tokens=NEW,
        temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": OFF},
    )
    details = done.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0, done.choices[0].message.content


def test_the_same_image_hits_the_prefix_cache_past_it_and_another_never(pairs: dict) -> None:
    """The first chat is snapshotted at its last whole KV block, past its image: its next turn
    resumes there. A second question about the same image parts from it inside the image's
    block, which is snapshotted there, inside the image: a third resumes from it. The same
    chats with another image in its place share no block (the one before the image holds its
    first placeholders). Each answer is transformers' text."""
    pair = pairs["moe"]
    tokenizer = reference(pair.directory).tokenizer
    ask = "Describe it for the catalogue in one line, with its colours and its shape."
    first: Chat = [("system", [SYSTEM]), ("user", [CAT, ask])]
    turn: Chat = [*first, ("assistant", ["A gradient."]), ("user", ["Which colour is most?"])]
    second: Chat = [("system", [SYSTEM]), ("user", [CAT, "Name one thing in it, in a word."])]
    third: Chat = [("system", [SYSTEM]), ("user", [CAT, "What is its background?"])]
    other: Chat = [(r, [DOG if x is CAT else x for x in parts]) for r, parts in turn]
    ids = _inputs(pair, first, **OFF)["input_ids"][0]
    image = (ids == pair.model.config.image_token_id).nonzero()
    begin, end = int(image[0]), int(image[-1]) + 1
    client = openai.OpenAI(base_url=pair.http, api_key="none")
    cached = {}
    for name, chat in [("first", first), ("turn", turn), ("second", second), ("third", third)]:
        cached[name], text = _answer(client, chat)
        theirs, _ = generated(pair, chat, **OFF)
        assert text == tokenizer.decode(theirs, skip_special_tokens=True), name
    cached["other"], text = _answer(client, other)
    assert text == tokenizer.decode(generated(pair, other, **OFF)[0], skip_special_tokens=True)
    assert cached["first"] == 0 and cached["turn"] >= end, (cached, begin, end)
    assert begin < cached["third"] < end, (cached, begin, end)
    assert cached["other"] <= begin, (cached, begin, end)


def test_the_anthropic_and_responses_fronts_answer_a_chat_with_an_image(pairs: dict) -> None:
    """Both go through the same door: the image reaches the service's prefill."""
    pair = pairs["dense"]
    anthropic = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": data_url(CAT).split(",", 1)[1],
        },
    }
    with httpx.Client(base_url=pair.http.removesuffix("/v1"), timeout=60) as client:
        name = client.get("/v1/models").json()["data"][0]["id"]
        content = [{"type": "text", "text": "What is in this picture?"}, anthropic]
        body = {"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
        reply = client.post("/v1/messages", json=body)
        assert reply.status_code == 200 and reply.json()["usage"]["output_tokens"] > 0, reply.text
        image = {"type": "input_image", "image_url": data_url(CAT)}
        body = {
            "model": name,
            "max_output_tokens": 2,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "What?"}, image]}
            ],
        }
        reply = client.post("/v1/responses", json=body)
        assert reply.status_code == 200 and reply.json()["usage"]["output_tokens"] > 0, reply.text
