"""The control plane tokenizes with what the GPU service serves: `TokenizerFiles` hands over the
checkpoint's files in chunks, byte for byte; the scheduler builds its tokenizer from them unless
one is given; a reconnect to another model reloads it and refuses the requests still waiting;
a checkpoint without a tokenizer is refused with a sentence. Real servers on loopback sockets."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health

from control_plane.fronts.api import GenerationServicer
from control_plane.replicas.client import GrpcModel
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.grammar import GrammarCompiler
from control_plane.text.tokenizer import TOKENIZER_FILE, ByteTokenizer, Tokenization
from gpu_service.engine.facade import Engine
from gpu_service.rpc.options import Access
from gpu_service.rpc.server import build_server
from gpu_service.rpc.servicer import TOKENIZER_CHUNK_BYTES, ModelServicer
from protos.met.v1 import generate_pb2, generate_pb2_grpc
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import read_tokenizer_files
from tests.collect import Outcome, run_all
from tests.conftest import TINY_SERVICE
from tests.fake_model import FakeModel
from tests.servers import aio_server_in_thread

NO_ENV = Env()
# Another byte tokenizer: what a reconnect finds when the service now serves another model.
OTHER = ByteTokenizer({"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258}, 256, 257)
OTHER_FILES = {TOKENIZER_FILE: OTHER.to_json().encode()}


class _Down(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset"


@pytest.fixture(scope="module")
def big_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a tokenizer.json several chunks long (JSON whitespace after
    the tokenizer) and an empty chat template."""
    directory = tmp_path_factory.mktemp("big") / "big"
    shutil.copytree(tiny_dir, directory)
    path = directory / TOKENIZER_FILE
    path.write_bytes(path.read_bytes() + b" " * (3 * TOKENIZER_CHUNK_BYTES + 17))
    (directory / "chat_template.jinja").write_bytes(b"")
    return directory


@pytest.fixture(scope="module")
def bare_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint without its tokenizer.json."""
    directory = tmp_path_factory.mktemp("bare") / "bare"
    shutil.copytree(tiny_dir, directory)
    (directory / TOKENIZER_FILE).unlink()
    return directory


def serving(directory: Path) -> AbstractContextManager[str]:
    """The GPU service's server over `directory`'s checkpoint, built as `serve` builds it."""

    async def start() -> tuple[grpc.aio.Server, int]:
        servicer = ModelServicer(Access())
        servicer.engine = Engine(directory, TINY_SERVICE)
        server = build_server(servicer, health.aio.HealthServicer())
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    return aio_server_in_thread(start)


@pytest.fixture(scope="module")
def big_target(big_dir: Path) -> Iterator[str]:
    with serving(big_dir) as target:
        yield target


def test_files_arrive_byte_for_byte_in_chunks(big_dir: Path, big_target: str) -> None:
    want = read_tokenizer_files(big_dir)
    assert len(want[TOKENIZER_FILE]) > 3 * TOKENIZER_CHUNK_BYTES
    with grpc.insecure_channel(big_target) as channel:
        # No session: the call is read-only, as Capabilities.
        chunks = list(pb_grpc.ModelServiceStub(channel).TokenizerFiles(pb.TokenizerFilesRequest()))
    sizes = [len(c.data) for c in chunks if c.name == TOKENIZER_FILE]
    assert len(sizes) == 4 and max(sizes) == TOKENIZER_CHUNK_BYTES
    assert [c.name for c in chunks if c.name == "chat_template.jinja"] == ["chat_template.jinja"]
    model = GrpcModel(big_target)
    try:
        assert model.tokenizer_files() == want
    finally:
        model.close()


def test_the_scheduler_tokenizes_with_the_served_files(big_dir: Path, big_target: str) -> None:
    s = Scheduler(lambda: GrpcModel(big_target), None, SchedulerOptions(), NO_ENV)
    s.start()
    try:
        caps = s.capabilities()
        assert s.tokenization is not None
        assert s.tokenization.digest == Tokenization.from_dir(big_dir).digest
        assert repr(caps.model_name) in s.tokenization.origin
        prompt = s.tokenizer.encode("héllo")
        assert prompt == Tokenization.from_dir(big_dir).tokenizer.encode("héllo")
        (out,) = run_all(s, [GenRequest("a", tuple(prompt), 4)])
        assert out.finish is not None and len(out.tokens) == 4
        # llguidance reads the served tokenizer.json's text, not a path.
        grammar = GrammarCompiler(s.tokenizer, caps.vocab_size, caps.eos_token_ids)
        assert grammar.compile("regex", "ab").valid_prefix(s.tokenizer.encode("abc")) == 2
    finally:
        s.stop()


def test_a_given_tokenizer_wins() -> None:
    model = FakeModel(files=OTHER_FILES)
    given = ByteTokenizer.default()
    s = Scheduler(lambda: model, given, SchedulerOptions(), NO_ENV)
    s.capabilities()
    assert s.tokenizer is given
    assert ("tokenizer_files",) not in model.calls, "the served files were not even asked for"


def test_another_model_on_reconnect_reloads_and_refuses_the_waiting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first model holds one slot and breaks on its first step: one request runs and
    fails with the connection, the other waits through the reconnect to another model."""
    first, second = FakeModel(caps=(3,), name="first"), FakeModel(name="second", files=OTHER_FILES)

    def broken(*args, **kwargs):
        raise _Down()

    first.decode_verify_batched = broken
    models = [first, second]
    s = Scheduler(lambda: models.pop(0), None, SchedulerOptions(), NO_ENV)
    running, waiting = Outcome(), Outcome()
    s.submit(GenRequest("running", (1,), 5), running)  # connects to the first model
    s.submit(GenRequest("waiting", (1,), 5), waiting)
    old = s.tokenizer
    with caplog.at_level(logging.WARNING, logger="control_plane.scheduler"):
        s.start()
        try:
            assert running.done.wait(30) and waiting.done.wait(30)
            assert s.tokenizer is not old and s.tokenization is not None
            assert s.tokenization.files == OTHER_FILES
            (fresh,) = run_all(s, [GenRequest("fresh", (1,), 3)])
        finally:
            s.stop()
    assert running.failure is not None and running.failure.code == "UNAVAILABLE"
    assert waiting.failure is not None and waiting.failure.code == "UNAVAILABLE"
    assert "now serves another model (the GPU service's model 'second')" in waiting.failure.message
    assert fresh.finish is not None and fresh.tokens == [2, 3, 4]
    (warning,) = [r.getMessage() for r in caplog.records if "another model" in r.getMessage()]
    assert "'second'" in warning and "'first'" in warning and "reloaded" in warning


def test_a_checkpoint_without_a_tokenizer_is_refused_with_a_sentence(bare_dir: Path) -> None:
    with serving(bare_dir) as gpu_target:
        s = Scheduler(lambda: GrpcModel(gpu_target), None, SchedulerOptions(), NO_ENV)
        s.start()

        async def start() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server()
            servicer = GenerationServicer(s)
            generate_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        try:
            with aio_server_in_thread(start) as target, grpc.insecure_channel(target) as channel:
                stub = generate_pb2_grpc.GenerationServiceStub(channel)
                request = generate_pb2.GenerateRequest(prompt="hi", max_new_tokens=2)
                with pytest.raises(grpc.RpcError) as caught:
                    list(stub.Generate(request, timeout=30))
        finally:
            s.stop()
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = caught.value.details()
    assert "the GPU service's model 'bare' has no tokenizer.json" in details, details
    assert "--tokenizer" in details


@pytest.mark.parametrize(
    ("files", "sentence"),
    [
        ({"tokenizer_config.json": b"{}"}, "here has no tokenizer.json"),
        ({TOKENIZER_FILE: b"\xff{"}, "here: tokenizer.json does not load as a tokenizer: "),
        ({TOKENIZER_FILE: b'{"model": 5}'}, "here: tokenizer.json does not load as a tokenizer: "),
        ({TOKENIZER_FILE: b'{"type": "byte"}'}, "here: tokenizer.json does not load as a "),
    ],
    ids=["missing", "not-utf8", "not-a-tokenizer", "byte-file-without-ids"],
)
def test_files_without_a_tokenizer_are_a_value_error(
    files: dict[str, bytes], sentence: str
) -> None:
    with pytest.raises(ValueError, match="^" + sentence):
        Tokenization.from_files(files, "here")
