"""Shared fixtures: a tiny checkpoint written to disk, engines over it, and one real GPU
service process serving it on a loopback socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from control_plane.client import GrpcModel
from control_plane.launch import start_control_plane, start_gpu_service, stop
from gpu_service.config import ModelConfig, ServiceConfig
from gpu_service.device import choose_device
from gpu_service.engine import Engine
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from training.checkpoint import init_model

# The Triton interpreter decision, made before pytest imports a test module (and so a kernel).
choose_device()

TINY = ModelConfig.tiny()
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
