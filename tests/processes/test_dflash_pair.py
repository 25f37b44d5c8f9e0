"""DFlash through both processes: a GPU service serving the bundled model with its drafter
(--drafter) and a control plane, talking gRPC over loopback. Greedy dflash equals none token
for token on the held-out prompts, alone and 16 at once, with penalties and a grammar beside;
a service without a drafter refuses the method."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.scheduler.seq import GenRequest
from protos.defaults import DEFAULT_MODEL_DIR, DRAFTER_DIR
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.params import DFLASH, NONE
from tests.processes.test_generation_api import collect
from tools.bench.workload import Workload

# Slow: every test here waits on a GPU service and a control plane starting.
pytestmark = pytest.mark.slow
METHOD = {DFLASH: pb.SPECULATIVE_METHOD_DFLASH, NONE: pb.SPECULATIVE_METHOD_NONE}


@pytest.fixture(scope="module")
def pair() -> Iterator[str]:
    drafter = DEFAULT_MODEL_DIR / DRAFTER_DIR
    gpu, served = start_gpu_service(
        DEFAULT_MODEL_DIR, "--max-context", "512", "--drafter", str(drafter)
    )
    try:
        cp, target_addr = start_control_plane(served)
        try:
            yield target_addr
        finally:
            assert stop(cp) == 0
    finally:
        assert stop(gpu) == 0


def held_out(method: str, n: int) -> list[GenRequest]:
    """The bundled model's held-out prompts, 24 tokens each."""
    prompts = Workload(DEFAULT_MODEL_DIR).prompts
    return [GenRequest(f"r{i}", prompts[i % len(prompts)], 24, method=method) for i in range(n)]


def _wire(req, method: str, **extra) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=req.prompt_ids,
        max_new_tokens=req.max_new_tokens,
        speculative_method=METHOD[method],
        **extra,
    )


def _run(stub, method: str, n: int, **extra) -> list[tuple]:
    reqs = held_out(method, n)
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
    assert sum(d[2].speculative_stats.accepted for d in dflash) > 0, "drafts stood"


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
