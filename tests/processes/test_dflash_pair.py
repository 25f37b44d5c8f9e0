"""DFlash through both processes: a GPU service started with --drafter and a control plane,
talking gRPC over loopback. Greedy dflash equals none token for token, alone and 16 at once,
with penalties and a grammar beside; a service without a drafter refuses the method."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from gpu_service.model.config import ModelConfig
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.params import DFLASH, NONE
from tests.conftest import SERVE_ARGS
from tests.control_plane.scheduler.test_loop import mixed_requests
from tests.gpu_service.dflash.drafter import write_drafter
from tests.processes.test_generation_api import collect

# Slow: every test here waits on a GPU service and a control plane starting.
pytestmark = pytest.mark.slow
METHOD = {DFLASH: pb.SPECULATIVE_METHOD_DFLASH, NONE: pb.SPECULATIVE_METHOD_NONE}


@pytest.fixture(scope="module")
def pair(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    target = ModelConfig.load(tiny_dir)
    taps = (0, target.num_hidden_layers - 1)
    drafter = write_drafter(tmp_path_factory.mktemp("dflash"), target, taps=taps, scale=0.2)
    gpu, served = start_gpu_service(tiny_dir, *SERVE_ARGS, "--drafter", str(drafter))
    try:
        cp, target_addr = start_control_plane(served, "--tokenizer", str(tiny_dir))
        try:
            yield target_addr
        finally:
            assert stop(cp) == 0
    finally:
        assert stop(gpu) == 0


def _wire(req, method: str, **extra) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=req.prompt_ids,
        max_new_tokens=req.max_new_tokens,
        speculative_method=METHOD[method],
        **extra,
    )


def _run(stub, method: str, n: int, **extra) -> list[tuple]:
    reqs = mixed_requests(method, n)
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda r: collect(stub, _wire(r, method, **extra)), reqs))


@pytest.mark.parametrize("n", [1, 16])
def test_greedy_dflash_equals_none_over_grpc(pair: str, n: int) -> None:
    with grpc.insecure_channel(pair) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        extra = {"repetition_penalty": 1.2} if n > 1 else {}
        dflash, none = _run(stub, DFLASH, n, **extra), _run(stub, NONE, n, **extra)
        schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
        fmt = pb.ResponseFormat(json_schema=schema)
        grammar = [
            collect(
                stub,
                pb.GenerateRequest(
                    prompt_token_ids=[65, 66],
                    max_new_tokens=16,
                    speculative_method=METHOD[m],
                    response_format=fmt,
                ),
            )[0]
            for m in (DFLASH, NONE)
        ]
    assert [d[0] for d in dflash] == [p[0] for p in none]
    assert grammar[0] == grammar[1]
    assert sum(d[2].speculative_stats.drafted for d in dflash) > 0


def test_a_service_without_a_drafter_refuses_dflash(stub) -> None:
    with pytest.raises(grpc.RpcError) as e:
        collect(
            stub,
            pb.GenerateRequest(
                prompt_token_ids=[5],
                max_new_tokens=4,
                speculative_method=pb.SPECULATIVE_METHOD_DFLASH,
            ),
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no" in e.value.details() and "DFlash drafter" in e.value.details()
