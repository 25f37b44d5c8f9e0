"""Seeded fuzz of every RPC of both services: garbage bodies, mutated valid messages, and
well-formed messages with random field values, sent concurrently to real processes. Whatever
comes back must be a status with a meaning (never UNKNOWN or INTERNAL), both processes must
serve on, and the GPU service must end with every slot free.

Every run prints `SEED` and the status counts per method; `random.Random(SEED)` replays the
same requests (their interleaving on the servers may differ)."""

from __future__ import annotations

import asyncio
import math
import os
import random
import struct
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from gpu_service.engine.costs import MAX_REPEATS
from protos.met.v1 import generate_pb2, model_pb2
from protos.model import ADMIN_KEY_ENV, ADMIN_KEY_METADATA, SESSION_METADATA
from tests.conftest import SERVE_ARGS

# Slow: 3,000 malformed RPCs against both processes.
pytestmark = pytest.mark.slow

# Starts both service processes, as the `served` and `control_plane` fixtures do.

SEED = 20_151
NUM_RPCS = 3_000
CONCURRENCY = 24
UNARY_TIMEOUT_S = 5.0
STREAM_TIMEOUT_S = 2.0
NUM_HELD = 2  # sequences the fuzz keeps allocated at once; the control plane needs the rest
SERVICES = [
    model_pb2.DESCRIPTOR.services_by_name["ModelService"],
    generate_pb2.DESCRIPTOR.services_by_name["GenerationService"],
]
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
U32, U64 = (1 << 32) - 1, (1 << 64) - 1
EDGE_INTS = [0, 1, 2, 3, 7, 8, 24, 255, 256, 511, 512, 1 << 16, 1 << 31, U32]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 0.5, 1.0, 2.0, -1.0, 3.4e38]
WORDS = ["", "eager", "a", "{", "[a-z]+", '{"type": "object"}', "start: /x/", "\x00", "é" * 40]
# Issue 60's hostile schemas, templates and grammars, each refused at once by a bound (the
# template whose loops run to the admission deadline is left to test_hostile_requests: it
# would hold a worker two seconds a draw).
HOSTILE_WORDS = [
    '[{"type":"function","function":{"name":"f","parameters":'
    + '{"type":"object","properties":{"a":' * 40
    + "{}"
    + "}}" * 40
    + "}}]",
    '{"items":' * 5000 + "{}" + "}" * 5000,
    '{{ "a" * 200000000 }}',
    "{% if 1 %}" * 3000 + "x" + "{% endif %}" * 3000,
    "start: " + " | ".join(f'"w{i}"' for i in range(120_000)),
    "(a{1000}){1000}",
]


def call_metadata(method: MethodDescriptor, session: str) -> tuple[tuple[str, str], ...]:
    """The metadata every fuzzed and checking call carries: the fuzz's session, and the admin
    key `start_gpu_service` put in the environment (admin calls read it, the rest ignore it)."""
    if method.containing_service.name != "ModelService":
        return ()
    return ((SESSION_METADATA, session), (ADMIN_KEY_METADATA, os.environ[ADMIN_KEY_ENV]))


@dataclass
class Servers:
    gpu: Popen
    gpu_target: str
    control: Popen
    control_target: str


@pytest.fixture(scope="module")
def servers(tiny_dir: Path) -> Iterator[Servers]:
    """Processes of the fuzz's own, so that random forwards and sequence ids never reach the
    session's shared services."""
    gpu, gpu_target = start_gpu_service(tiny_dir, *SERVE_ARGS, "--max-prefill-tokens", "512")
    control, control_target = start_control_plane(gpu_target, "--tokenizer", str(tiny_dir))
    try:
        yield Servers(gpu, gpu_target, control, control_target)
    finally:
        assert stop(control) == 0
        assert stop(gpu) == 0


@dataclass
class Fuzz:
    """What the requests draw from and what they leave behind."""

    rng: random.Random
    caps: model_pb2.CapabilitiesReply
    held: list[int] = field(default_factory=list)  # live sequences the fuzz allocated
    freed: list[int] = field(default_factory=list)
    statuses: Counter[tuple[str, str]] = field(default_factory=Counter)
    session: str = ""

    def seq_id(self) -> int:
        """Only ids the fuzz owns, owned once, or that no one holds: the control plane's
        sequences, in between, are not the fuzz's to break."""
        if self.held and self.rng.random() < 0.7:
            return self.rng.choice(self.held)
        return self.rng.choice([*self.freed[-4:], 0, 1 << 40, U64])


def _int(fz: Fuzz, f: FieldDescriptor) -> int:
    if "seq_id" in f.name:
        return fz.seq_id()
    bits = 64 if f.type in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT64) else 32
    r = fz.rng.random()
    if r < 0.5:
        value = fz.rng.randrange(fz.caps.vocab_size + 2)
    elif r < 0.85:
        value = fz.rng.choice(EDGE_INTS)
    else:
        value = fz.rng.getrandbits(bits)
    if f.type in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64):  # signed: -1 too
        value = value - (1 << bits) if value >= 1 << (bits - 1) else value
    return value


def _scalar(fz: Fuzz, f: FieldDescriptor) -> object:
    rng = fz.rng
    match f.type:
        case FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        case FieldDescriptor.TYPE_FLOAT | FieldDescriptor.TYPE_DOUBLE:
            value = rng.choice(EDGE_FLOATS) if rng.random() < 0.6 else rng.uniform(-2, 2)
            return struct.unpack("f", struct.pack("f", value))[0] if math.isfinite(value) else value
        case FieldDescriptor.TYPE_STRING:
            if rng.random() < 0.05:
                return rng.choice(HOSTILE_WORDS)
            return rng.choice(WORDS) if rng.random() < 0.5 else _text(rng)
        case FieldDescriptor.TYPE_BYTES:
            return rng.randbytes(rng.choice([0, 1, 4, 8, 32, 64, 300]))
        case FieldDescriptor.TYPE_ENUM:
            return rng.choice([*f.enum_type.values_by_number, 4, 99, -1])
    return _int(fz, f)


def _text(rng: random.Random) -> str:
    return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(40)))


def random_message(fz: Fuzz, desc: Descriptor, depth: int = 0) -> Message:
    """A well-formed `desc` message: each field set or not, lists of any length (lengths
    that disagree included), values in or far out of range."""
    msg = GetMessageClass(desc)()
    for f in desc.fields:
        if fz.rng.random() < 0.5:
            continue
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if depth > 2:
                continue
            if f.message_type.GetOptions().map_entry:  # scalar values, as the protos' maps
                for _ in range(fz.rng.choice([0, 1, 2, 3, 9])):
                    entry = random_message(fz, f.message_type, depth + 1)
                    getattr(msg, f.name)[entry.key] = entry.value
            elif f.is_repeated:
                for _ in range(fz.rng.choice([0, 1, 2, 3, 9])):
                    item = random_message(fz, f.message_type, depth + 1)
                    getattr(msg, f.name).add().CopyFrom(item)
            else:
                getattr(msg, f.name).CopyFrom(random_message(fz, f.message_type, depth + 1))
        elif f.is_repeated:
            n = fz.rng.choice([0, 1, 1, 1, 2, 2, 3, 4, 8, 25, 600])
            getattr(msg, f.name).extend(_scalar(fz, f) for _ in range(n))
        else:
            setattr(msg, f.name, _scalar(fz, f))
    return msg


def mutate(rng: random.Random, body: bytes) -> bytes:
    """`body` truncated, with bytes flipped, or with random bytes spliced in."""
    data = bytearray(body)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(3)
        if op == 0 and data:
            del data[rng.randrange(len(data)) :]
        elif op == 1 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        else:
            i = rng.randrange(len(data) + 1)
            data[i:i] = rng.randbytes(rng.randrange(1, 6))
    return bytes(data)


def garbage(rng: random.Random) -> bytes:
    return rng.choice([b"\xff" * 8, b"\x0a\x01\xff", b"\x0a\x7f", b"\x08"]) + rng.randbytes(
        rng.randrange(0, 64)
    )


def request_body(fz: Fuzz, method: MethodDescriptor) -> tuple[str, bytes]:
    """One of three kinds of malformed body, and the kind's name."""
    kind = fz.rng.choice(["garbage", "mutated", "random"])
    if kind == "garbage":
        return kind, garbage(fz.rng)
    body = random_message(fz, method.input_type).SerializeToString()
    return kind, mutate(fz.rng, body) if kind == "mutated" else body


def defused(fz: Fuzz, method: MethodDescriptor, body: bytes) -> bytes:
    """`body`, unless it parses as a legal measurement: that would hold the engine for up to
    widths x depths x repeats steps, long past the fuzz's time."""
    if method.name != "MeasureCosts":
        return body
    try:
        req = model_pb2.CostRequest.FromString(body)
    except DecodeError:
        return body
    repeats = req.repeats or 5
    widths_ok = req.widths and 1 <= min(req.widths) and max(req.widths) <= fz.caps.max_batch
    if widths_ok and req.max_depth <= max(fz.caps.slot_verify_drafts) and repeats <= MAX_REPEATS:
        req.repeats = MAX_REPEATS + 1
    return req.SerializeToString()


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


async def send(
    channel: grpc.aio.Channel, method: MethodDescriptor, body: bytes, session: str = ""
) -> tuple[grpc.StatusCode, list[bytes]]:
    """`body` as it is (no serializers); a stream is read to its end or first error. -> the
    status and the reply bodies."""
    md = call_metadata(method, session)
    if not method.server_streaming:
        call = channel.unary_unary(_path(method))(body, timeout=UNARY_TIMEOUT_S, metadata=md)
        try:
            return grpc.StatusCode.OK, [await call]
        except grpc.aio.AioRpcError as e:
            return e.code(), []
    call = channel.unary_stream(_path(method))(body, timeout=STREAM_TIMEOUT_S, metadata=md)
    replies = []
    try:
        async for reply in call:
            replies.append(reply)
    except grpc.aio.AioRpcError as e:
        return e.code(), replies
    return await call.code(), replies


async def _free(fz: Fuzz, channel: grpc.aio.Channel, seq_id: int) -> None:
    free = SERVICES[0].methods_by_name["FreeSequence"]
    if seq_id in fz.held:
        fz.held.remove(seq_id)
        fz.freed.append(seq_id)
        body = model_pb2.FreeSequenceRequest(seq_id=seq_id).SerializeToString()
        await send(channel, free, body, fz.session)


async def fuzz_one(fz: Fuzz, channels: dict[str, grpc.aio.Channel], method: MethodDescriptor):
    kind, body = request_body(fz, method)
    body = defused(fz, method, body)
    channel = channels[method.containing_service.name]
    code, replies = await send(channel, method, body, fz.session)
    fz.statuses[(method.name, code.name)] += 1
    if code in FORBIDDEN:
        print(f"{method.name} {kind} -> {code.name}: {body!r}")
    if method.name == "AllocSequence" and code == grpc.StatusCode.OK:
        fz.held.append(model_pb2.SequenceHandle.FromString(replies[0]).seq_id)
        while len(fz.held) > NUM_HELD:
            await _free(fz, channel, fz.held[0])


async def run_fuzz(fz: Fuzz, servers: Servers) -> None:
    methods = [m for s in SERVICES for m in s.methods]
    plan = [fz.rng.choice(methods) for _ in range(NUM_RPCS)]
    gate = asyncio.Semaphore(CONCURRENCY)
    async with (
        grpc.aio.insecure_channel(servers.gpu_target) as gpu,
        grpc.aio.insecure_channel(servers.control_target) as control,
    ):
        channels = {"ModelService": gpu, "GenerationService": control}
        open_session = SERVICES[0].methods_by_name["OpenSession"]
        session = gpu.unary_stream(_path(open_session))(b"")
        fz.session = model_pb2.SessionInfo.FromString(await session.read()).session_id

        async def one(method: MethodDescriptor) -> None:
            async with gate:
                await fuzz_one(fz, channels, method)

        await asyncio.wait_for(asyncio.gather(*(one(m) for m in plan)), 40)
        for seq_id in list(fz.held):
            await _free(fz, gpu, seq_id)
        session.cancel()


async def capabilities(target: str) -> model_pb2.CapabilitiesReply:
    method = SERVICES[0].methods_by_name["Capabilities"]
    async with grpc.aio.insecure_channel(target) as channel:
        code, replies = await send(channel, method, b"")
    assert code == grpc.StatusCode.OK, f"Capabilities answered {code.name}"
    return model_pb2.CapabilitiesReply.FromString(replies[0])


async def serving(target: str) -> bool:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=UNARY_TIMEOUT_S
        )
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def settled_caps(target: str, timeout_s: float = 15.0) -> model_pb2.CapabilitiesReply:
    """Capabilities once every slot is free, or at the deadline: in-flight generations end
    within their stream's timeout, and the control plane frees their sequences after."""
    deadline = time.monotonic() + timeout_s
    while (caps := await capabilities(target)).free_slots != caps.num_slots:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    return caps


def report(statuses: Counter[tuple[str, str]]) -> str:
    per_method: dict[str, Counter[str]] = {}
    for (method, code), n in sorted(statuses.items()):
        per_method.setdefault(method, Counter())[code] = n
    lines = [
        f"{m:24s} {sum(c.values()):5d}  {dict(c.most_common())}" for m, c in per_method.items()
    ]
    return "\n".join(lines)


async def test_fuzz_every_rpc(servers: Servers) -> None:
    fz = Fuzz(random.Random(SEED), await capabilities(servers.gpu_target))
    t0 = time.monotonic()
    await run_fuzz(fz, servers)
    caps = await settled_caps(servers.gpu_target)
    print(f"\nseed {SEED}: {sum(fz.statuses.values())} RPCs in {time.monotonic() - t0:.1f} s")
    print(report(fz.statuses))
    print(f"free slots {caps.free_slots} of {caps.num_slots}")

    bad = {k: n for k, n in fz.statuses.items() if grpc.StatusCode[k[1]] in FORBIDDEN}
    assert not bad, f"seed {SEED}: UNKNOWN or INTERNAL answers: {bad}"
    assert servers.gpu.poll() is None, "the GPU service died"
    assert servers.control.poll() is None, "the control plane died"
    assert await serving(servers.gpu_target) and await serving(servers.control_target)
    stats = SERVICES[1].methods_by_name["GetStats"]
    async with grpc.aio.insecure_channel(servers.control_target) as channel:
        assert (await send(channel, stats, b""))[0] == grpc.StatusCode.OK
    assert caps.free_slots == caps.num_slots, f"{caps.num_slots - caps.free_slots} slots leaked"
