"""A request body that does not parse (garbage bytes, invalid UTF-8 in a string field) gets
INVALID_ARGUMENT and a sentence on every method of both servers, with nothing logged, and
the server goes on serving. Real servers on loopback sockets, built as their processes
build them."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from control_plane.fronts.api import GenerationServicer
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.rpc.options import Access
from gpu_service.rpc.server import build_server
from gpu_service.rpc.servicer import ModelServicer
from protos.bodies import RejectUndecodable
from protos.met.v1 import generate_pb2, generate_pb2_grpc, model_pb2
from tests.conftest import TINY_SERVICE

ADMIN_KEY = "test-admin-key"  # the key `serving` gives its service
GARBAGE = b"\xff" * 8  # a varint that never ends
BAD_UTF8 = b"\x0a\x01\xff"  # field 1, length-delimited, one byte that is not UTF-8
MODEL_SERVICE = model_pb2.DESCRIPTOR.services_by_name["ModelService"]
GENERATION_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["GenerationService"]


@asynccontextmanager
async def serving(engine: Engine) -> AsyncIterator[str]:
    """The GPU service's server over `engine`, built as `serve` builds it, on a free port."""
    servicer = ModelServicer(Access(admin_key=ADMIN_KEY))
    servicer.engine = engine
    server = build_server(servicer, health.aio.HealthServicer())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.fixture
async def gpu_target(tiny_dir: Path) -> AsyncIterator[str]:
    async with serving(Engine(tiny_dir, TINY_SERVICE)) as target:
        yield target


@pytest.fixture
async def control_target(tiny_dir: Path) -> AsyncIterator[str]:
    engine = Engine(tiny_dir, TINY_SERVICE)
    scheduler = Scheduler(lambda: engine, ByteTokenizer.default(), SchedulerOptions(), Env())
    scheduler.start()
    server = grpc.aio.server(interceptors=[RejectUndecodable()])
    generate_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(scheduler), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)
    scheduler.stop()


async def _send_raw(
    channel: grpc.aio.Channel, service: ServiceDescriptor, method: MethodDescriptor, body: bytes
) -> tuple[grpc.StatusCode, str]:
    """`body` as the method's request, bytes as they are (no serializers)."""
    kind = "_".join(
        "stream" if s else "unary" for s in (method.client_streaming, method.server_streaming)
    )
    call = getattr(channel, kind)(f"/{service.full_name}/{method.name}")(
        iter([body]) if method.client_streaming else body
    )
    return await call.code(), await call.details()


def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, f"logged: {[r.getMessage() for r in loud]}"


@pytest.mark.parametrize("method", list(MODEL_SERVICE.methods), ids=lambda m: m.name)
async def test_gpu_service_garbage(
    gpu_target: str, method: MethodDescriptor, caplog: pytest.LogCaptureFixture
) -> None:
    async with grpc.aio.insecure_channel(gpu_target) as channel:
        code, details = await _send_raw(channel, MODEL_SERVICE, method, GARBAGE)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details == f"the request body is not a valid {method.input_type.full_name} message"
        caps = await _send_raw(
            channel, MODEL_SERVICE, MODEL_SERVICE.methods_by_name["Capabilities"], b""
        )
        assert caps[0] == grpc.StatusCode.OK, "the server serves on"
    _quiet(caplog)


async def test_gpu_service_invalid_utf8(gpu_target: str, caplog: pytest.LogCaptureFixture) -> None:
    set_forward = MODEL_SERVICE.methods_by_name["SetForward"]
    async with grpc.aio.insecure_channel(gpu_target) as channel:
        code, details = await _send_raw(channel, MODEL_SERVICE, set_forward, BAD_UTF8)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "met.v1.SetForwardRequest" in details
    _quiet(caplog)


@pytest.mark.parametrize("body", [GARBAGE, BAD_UTF8], ids=["garbage", "invalid-utf8"])
@pytest.mark.parametrize("method", list(GENERATION_SERVICE.methods), ids=lambda m: m.name)
async def test_control_plane_bad_bodies(
    control_target: str, method: MethodDescriptor, body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    async with grpc.aio.insecure_channel(control_target) as channel:
        code, details = await _send_raw(channel, GENERATION_SERVICE, method, body)
        if body == BAD_UTF8 and method.input_type.fields_by_number.get(1) is None:
            return  # no field 1: the body is a valid message with an unknown field
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details == f"the request body is not a valid {method.input_type.full_name} message"
        stats = await _send_raw(
            channel, GENERATION_SERVICE, GENERATION_SERVICE.methods_by_name["GetStats"], b""
        )
        assert stats[0] == grpc.StatusCode.OK, "the server serves on"
    _quiet(caplog)


async def test_health_and_reflection_guarded_and_serving(gpu_target: str) -> None:
    """The same guard covers the server's other services, a streaming one included."""
    reflection_service = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
    [info] = reflection_service.methods
    async with grpc.aio.insecure_channel(gpu_target) as channel:
        code, _ = await _send_raw(channel, reflection_service, info, GARBAGE)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = [s.name async for r in replies for s in r.list_services_response.service]
        assert MODEL_SERVICE.full_name in names
        check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.SERVING
