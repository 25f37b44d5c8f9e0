"""Every field of a `GenerateRequest` checked at the door: a bad one is refused with
INVALID_ARGUMENT and a sentence naming it, before it is tokenized or admitted, while a healthy
stream beside it runs on undisturbed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from control_plane.admission.door import Admission, BadRequest, admit
from control_plane.cli.server import admission
from control_plane.scheduler.scheduler import Scheduler
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from met.main import build_parser
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.params import AUTO, RequestParams
from tests.servers import serving

SERVICE = ServiceConfig(verify_tiers="4:3", max_context=256)  # drafts 1..3; tiny vocab: 320
NAN, INF = float("nan"), float("inf")
HEALTHY = pb.GenerateRequest(prompt_token_ids=[3, 4, 5], max_new_tokens=48, ignore_eos=True)


@dataclass
class RecordingTokenizer:
    """The byte tokenizer, noting the length of every text it encodes."""

    inner: ByteTokenizer = field(default_factory=ByteTokenizer.default)
    encoded: list[int] = field(default_factory=list)

    def encode(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return self.inner.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)

    def stream(self):
        return self.inner.stream()


@dataclass
class Api:
    stub: pb_grpc.GenerationServiceStub
    tokenizer: RecordingTokenizer
    scheduler: Scheduler


@pytest.fixture(scope="module")
def api(tiny_dir: Path) -> Iterator[Api]:
    """The generation API on a grpc.aio server in a thread, over an in-process engine."""
    tokenizer = RecordingTokenizer()
    engine = Engine(tiny_dir, SERVICE)
    scheduler = Scheduler(lambda: engine, tokenizer)  # type: ignore[arg-type]
    with serving(scheduler) as target, grpc.insecure_channel(target) as channel:
        yield Api(pb_grpc.GenerationServiceStub(channel), tokenizer, scheduler)


def tokens_of(call) -> list[int]:
    return [t for msg in call for t in msg.token_ids]


def refusal(stub: pb_grpc.GenerationServiceStub, request: pb.GenerateRequest) -> str:
    """The sentence of a refused call (INVALID_ARGUMENT, nothing streamed)."""
    with pytest.raises(grpc.RpcError) as caught:
        tokens_of(stub.Generate(request, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.details()


BAD = {
    "temperature-nan": (
        pb.GenerateRequest(prompt="a", temperature=NAN),
        "temperature is nan; it must be 0 (greedy) or from 0.01 to 100",
    ),
    "temperature-inf": (
        pb.GenerateRequest(prompt="a", temperature=INF),
        "temperature is inf; it must be 0 (greedy) or from 0.01 to 100",
    ),
    "temperature-negative": (
        pb.GenerateRequest(prompt="a", temperature=-1.0),
        "temperature is -1.0; it must be 0 (greedy) or from 0.01 to 100",
    ),
    "top_p-above-1": (
        pb.GenerateRequest(prompt="a", temperature=1.0, top_p=1.5),
        "top_p is 1.5; it must be above 0 and at most 1, or 0 for no cut",
    ),
    "top_p-negative": (
        pb.GenerateRequest(prompt="a", temperature=1.0, top_p=-0.5),
        "top_p is -0.5; it must be above 0 and at most 1, or 0 for no cut",
    ),
    "top_p-nan": (
        pb.GenerateRequest(prompt="a", temperature=1.0, top_p=NAN),
        "top_p is nan; it must be above 0 and at most 1, or 0 for no cut",
    ),
    "top_k-past-vocab": (
        pb.GenerateRequest(prompt="a", temperature=1.0, top_k=321),
        "top_k is 321; it must be at most the vocabulary size 320 (0 or -1: no limit)",
    ),
    "min-over-max": (
        pb.GenerateRequest(prompt="a", max_new_tokens=5, min_new_tokens=6),
        "min_new_tokens is 6; it must not exceed max_new_tokens (5)",
    ),
    "min-over-default-max": (
        pb.GenerateRequest(prompt_token_ids=[1] * 200, min_new_tokens=100),
        "min_new_tokens is 100; it must not exceed max_new_tokens (56)",
    ),
    "stop-token-outside-vocab": (
        pb.GenerateRequest(prompt="a", stop_token_ids=[5, 320]),
        "stop_token_ids holds token id 320, outside the vocabulary (0 .. 319)",
    ),
    "prompt-token-outside-vocab": (
        pb.GenerateRequest(prompt_token_ids=[1, 999]),
        "prompt_token_ids holds token id 999, outside the vocabulary (0 .. 319)",
    ),
    "num_drafts-0": (
        pb.GenerateRequest(prompt="a", speculative_method=pb.SPECULATIVE_METHOD_MTP, num_drafts=0),
        "num_drafts is 0; it must be from 1 to 3, the most drafts the GPU service verifies "
        "(leave it unset for the server's, or use NONE for no drafts)",
    ),
    "num_drafts-past-service": (
        pb.GenerateRequest(prompt="a", speculative_method=pb.SPECULATIVE_METHOD_MTP, num_drafts=4),
        "num_drafts is 4; it must be from 1 to 3, the most drafts the GPU service verifies "
        "(leave it unset for the server's, or use NONE for no drafts)",
    ),
    "unknown-method": (
        pb.GenerateRequest(prompt="a", speculative_method=9),  # type: ignore[arg-type]
        "speculative_method 9 is unknown; use NONE, MTP, PROMPT_LOOKUP or DFLASH",
    ),
    "max_new_tokens-past-context": (
        pb.GenerateRequest(prompt_token_ids=[1] * 200, max_new_tokens=57),
        "This model's maximum context length is 256 tokens. However, you requested 257 tokens "
        "(200 in the messages, 57 in the completion). Please reduce the length of the messages "
        "or completion.",
    ),
    "prompt-past-context": (
        pb.GenerateRequest(prompt_token_ids=[1] * 256),
        "This model's maximum context length is 256 tokens. However, you requested 257 tokens "
        "(256 in the messages, 1 in the completion). Please reduce the length of the messages "
        "or completion.",
    ),
}


@pytest.mark.parametrize(("request_", "sentence"), BAD.values(), ids=BAD.keys())
def test_a_bad_field_is_refused_with_its_sentence(
    api: Api, request_: pb.GenerateRequest, sentence: str
) -> None:
    assert refusal(api.stub, request_) == sentence


def test_a_grammar_that_does_not_compile_is_refused(api: Api) -> None:
    bad = pb.GenerateRequest(prompt="a", response_format=pb.ResponseFormat(regex="[a-"))
    assert refusal(api.stub, bad).startswith("response_format: the regex does not compile")


def test_an_oversized_prompt_is_refused_before_it_is_tokenized(api: Api) -> None:
    big = "x" * (2 << 20)
    api.tokenizer.encoded.clear()
    sentence = refusal(api.stub, pb.GenerateRequest(prompt=big, max_new_tokens=1))
    assert sentence == f"prompt is {len(big)} bytes; this server takes at most {1 << 20}"
    assert api.tokenizer.encoded == [], "the prompt reached the tokenizer"
    assert tokens_of(api.stub.Generate(pb.GenerateRequest(prompt="ok", max_new_tokens=2))) != []
    assert api.tokenizer.encoded == [2]


def test_the_prompt_bound_counts_utf8_bytes(api: Api) -> None:
    caps, tokenizer = api.scheduler.capabilities(), ByteTokenizer.default()
    door = Admission(max_prompt_bytes=4)
    for prompt in ("abcd", "éé"):
        assert admit(RequestParams(prompt=prompt), tokenizer, caps, door, "r")
    for prompt in ("abcde", "ééa"):
        with pytest.raises(BadRequest, match="bytes; this server takes at most 4"):
            admit(RequestParams(prompt=prompt), tokenizer, caps, door, "r")


def test_a_healthy_stream_runs_on_beside_bad_requests(api: Api) -> None:
    quiet = tokens_of(api.stub.Generate(HEALTHY, timeout=60))
    call = api.stub.Generate(HEALTHY, timeout=60)
    first = list(next(call).token_ids)  # admitted and streaming before the bad requests come
    for request, sentence in BAD.values():
        assert refusal(api.stub, request) == sentence
    assert first + tokens_of(call) == quiet and len(quiet) == HEALTHY.max_new_tokens


def test_max_prompt_bytes_is_a_serve_flag() -> None:
    base = ["control-plane", "serve", "--gpu-service", "x:1"]
    assert admission(build_parser().parse_args(base)) == Admission()
    args = build_parser().parse_args([*base, "--max-prompt-bytes", "4096"])
    assert admission(args) == Admission(AUTO, Admission().default_max_new, 4096)
