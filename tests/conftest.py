"""Shared fixtures: a tiny checkpoint written to disk, engines over it, and one real GPU
service process serving it on a loopback socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from gpu_service.engine.compiled import NO_COMPILE_ENV
from gpu_service.engine.device import choose_device
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ModelConfig, ServiceConfig
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from training.checkpoint import init_model

# The Triton interpreter decision, made before pytest imports a test module (and so a kernel).
choose_device()


@pytest.fixture(scope="session", autouse=True)
def _cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Measured cost tables and compiled steps go under $XDG_CACHE_HOME: a directory of the
    run's own, set before any service process starts so that it inherits it, never the
    user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        # Services the tests start run the step eagerly unless a test passes --compile: a
        # compile costs tens of seconds the other tests do not test.
        mp.setenv(NO_COMPILE_ENV, "1")
        yield


# Tests marked `slow`, which `pytest -m "not slow"` (the fast tier) leaves out: seconds each on
# a 2-core CPU. A test module marks its own where they live (`pytestmark = pytest.mark.slow`,
# `@pytest.mark.slow`, or `pytest.param(..., marks=pytest.mark.slow)`, each with its reason).
# Beside those, any test that uses one of these fixtures is slow: it waits on a process starting.
SLOW_FIXTURES = {
    "served": "starts a GPU service process",
    "two_services": "starts two GPU service processes",
    "control_plane": "starts a control plane process",
    "tp_engines": "starts tensor-parallel rank processes",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(f in SLOW_FIXTURES for f in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


TINY = ModelConfig.tiny()
# The first bundled checkpoint (4 target layers, 1.6M parameters), kept as the fixture of tests
# that need a trained model but not the default's depth: a third of its step time.
TRAINED = Path(__file__).resolve().parent / "fixtures" / "trained4"
# Small tiers so that tests reach every tier and run out of slots quickly.
TINY_SERVICE = ServiceConfig(
    verify_tiers="2:3,2:2,4:1", max_context=256, max_rows=24, max_batch=8, max_prefill_tokens=512
)
SERVE_ARGS = (
    "--verify-tiers",
    TINY_SERVICE.verify_tiers,
    "--max-context",
    "256",
    "--max-rows",
    "24",
    "--max-batch",
    "8",
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    init_model(directory, TINY, seed=7)
    return directory


@pytest.fixture(scope="session")
def mini_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The flagship in miniature (tests/flagship.py), seeded weights."""
    from tests.flagship import MINI_FLAGSHIP

    directory = tmp_path_factory.mktemp("mini-flagship")
    init_model(directory, MINI_FLAGSHIP, seed=5)
    return directory


@pytest.fixture(scope="session")
def qwen3_5_made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """Every kind of tests/qwen3_5_checkpoint.py's Qwen3.5 checkpoints (written by transformers'
    own classes, the vision tower included), once a run: kind -> (directory, the model)."""
    from tests.qwen3_5_checkpoint import KINDS, make

    out: dict[str, tuple[Path, object]] = {}
    for kind in KINDS:
        directory = tmp_path_factory.mktemp(kind)
        out[kind] = directory, make(directory, kind)
    return out


@pytest.fixture
def engine(tiny_dir: Path) -> Engine:
    return Engine(tiny_dir, TINY_SERVICE)


@pytest.fixture(scope="session")
def served(tiny_dir: Path) -> Iterator[str]:
    proc, target = start_gpu_service(tiny_dir, *SERVE_ARGS, "--max-prefill-tokens", "512")
    try:
        yield target
    finally:
        assert stop(proc) == 0, "the GPU service did not shut down cleanly on SIGTERM"


@pytest.fixture
def client(served: str) -> Iterator[GrpcModel]:
    model = GrpcModel(served)
    model.set_forward("eager")
    yield model
    model.close()


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def random_tokens(rng: torch.Generator, n: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=rng).tolist()


@pytest.fixture(scope="session")
def control_plane(served: str, tiny_dir: Path) -> Iterator[str]:
    proc, target = start_control_plane(served, "--tokenizer", str(tiny_dir))
    yield target
    assert stop(proc) == 0


@pytest.fixture
def stub(control_plane: str) -> Iterator[pb_grpc.GenerationServiceStub]:
    with grpc.insecure_channel(control_plane) as channel:
        yield pb_grpc.GenerationServiceStub(channel)
