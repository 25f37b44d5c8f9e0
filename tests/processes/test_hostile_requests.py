"""Issue 60's hostile requests replayed against both processes over HTTP and gRPC: each is
refused with 400 / INVALID_ARGUMENT and a sentence of ours within the admission bound plus a
second, while a canary completion runs beside it (its worst latency under a second) and
`/health` answers throughout; after the probes both processes hold what they held before,
within 10%."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Any

import grpc
import httpx
import pytest

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import SERVE_ARGS

# Slow: both service processes of its own, so the probes never share the session's.
pytestmark = pytest.mark.slow

TIMEOUT_S = 1.0  # --admission-timeout
CANARY = {"prompt": [3, 4, 5], "max_tokens": 2, "ignore_eos": True}
USER = [{"role": "user", "content": "hi"}]
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def nested(levels: int, via: str) -> str:
    opening = '{"type":"object","properties":{"a":' if via == "properties" else '{"items":'
    closing = "}}" if via == "properties" else "}"
    return opening * levels + '{"type":"string"}' + closing * levels


# One tool whose parameters are `{}` (JSON text, nested past what `json.dumps` writes).
TOOL = '[{{"type":"function","function":{{"name":"f","parameters":{}}}}}]'


def with_tool(parameters: str) -> str:
    """A chat body forcing a call of the tool of `parameters`."""
    return (
        '{"model":"MODEL","max_tokens":2,"messages":'
        + json.dumps(USER)
        + ',"tools":'
        + TOOL.format(parameters)
        + ',"tool_choice":"required"}'
    )


def chat(**fields: Any) -> str:
    return json.dumps({"model": "MODEL", "max_tokens": 2, "messages": USER, **fields})


HOSTILE = {
    "schema-40-deep-properties": with_tool(nested(40, "properties")),
    "schema-600-deep-items": with_tool(nested(600, "items")),
    "body-5000-deep": with_tool(nested(5000, "items")),
    "template-loops": chat(chat_template=LOOPS),
    "template-repeat": chat(chat_template='{{ "a" * 200000000 }}'),
    "template-3.6-MB": chat(chat_template="{{ 1 }}" * 500_000),
    "template-3000-deep": chat(chat_template="{% if 1 %}" * 3000 + "x" + "{% endif %}" * 3000),
    "stop-100000": json.dumps(
        {
            "model": "MODEL",
            "prompt": "x",
            "max_tokens": 2,
            "stop": [f"s{i}" for i in range(100_000)],
        }
    ),
    "prompts-1000": json.dumps({"model": "MODEL", "prompt": ["x"] * 1000, "max_tokens": 2}),
    "lark-120000": json.dumps(
        {
            "model": "MODEL",
            "prompt": "x",
            "max_tokens": 2,
            "structured_outputs": {
                "grammar": "start: " + " | ".join(f'"w{i}"' for i in range(120_000))
            },
        }
    ),
}


@dataclass
class Pair:
    gpu: Popen
    control: Popen
    http: str
    grpc_target: str


@pytest.fixture(scope="module")
def pair(tiny_dir: Path) -> Iterator[Pair]:
    gpu, target = start_gpu_service(tiny_dir, *SERVE_ARGS)
    try:
        seen: list[str] = []
        flags = ("--http-port", "0", "--admission-timeout", str(TIMEOUT_S))
        control, cp_target = start_control_plane(
            target, "--tokenizer", str(tiny_dir), *flags, seen=seen
        )
        http = next(line.split(" on ", 1)[1].strip() for line in seen if "OpenAI API on" in line)
        try:
            yield Pair(gpu, control, http.removesuffix("/v1"), cp_target)
        finally:
            assert stop(control) == 0
    finally:
        assert stop(gpu) == 0


def model(client: httpx.Client) -> str:
    """The served model's name, which a body must give (bodies here say MODEL)."""
    return client.get("/v1/models").json()["data"][0]["id"]


def resident_mb(proc: Popen) -> float:
    with open(f"/proc/{proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@dataclass
class Beside:
    """A canary completion and a `/health` check every tenth of a second until stopped."""

    base: str
    canary_worst: float = 0.0
    health: list[int] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=30) as client:
            while not self.done.is_set():
                start = time.monotonic()
                reply = client.post("/v1/completions", json={"model": model(client), **CANARY})
                assert reply.status_code == 200, reply.text
                self.canary_worst = max(self.canary_worst, time.monotonic() - start)
                self.health.append(client.get("/health").status_code)
                self.done.wait(0.1)


def probed(base: str, path: str, body: str) -> tuple[httpx.Response, float, Beside]:
    beside = Beside(base)
    thread = threading.Thread(target=beside.run)
    thread.start()
    try:
        start = time.monotonic()
        with httpx.Client(base_url=base, timeout=60) as client:
            reply = client.post(path, content=body.replace("MODEL", model(client)))
        return reply, time.monotonic() - start, beside
    finally:
        beside.done.set()
        thread.join()


def test_hostile_requests_over_http_leave_the_rest_alone(pair: Pair) -> None:
    # Warm both processes (a worker set up, a grammar built) before their memory is read.
    with httpx.Client(base_url=pair.http, timeout=60) as client:
        served = model(client)
        body = chat().replace("MODEL", served)
        assert client.post("/v1/chat/completions", content=body).status_code == 200
        warm = {"model": served, "prompt": "x", "max_tokens": 2, "guided_regex": "a+"}
        assert client.post("/v1/completions", json=warm).status_code == 200
    before = resident_mb(pair.control), resident_mb(pair.gpu)
    for name, body in HOSTILE.items():
        path = "/v1/completions" if '"prompt"' in body else "/v1/chat/completions"
        reply, seconds, beside = probed(pair.http, path, body)
        assert reply.status_code == 400, (name, reply.text[:300])
        message = reply.json()["error"]["message"]
        assert "backtrace" not in message and len(message) < 400, (name, message)
        assert seconds < TIMEOUT_S + 1.0, (name, seconds, message)
        assert beside.canary_worst < 1.0, (name, beside.canary_worst)
        assert beside.health and set(beside.health) == {200}, name
    after = resident_mb(pair.control), resident_mb(pair.gpu)
    for was, now in zip(before, after, strict=True):
        assert now < was * 1.1, (before, after)


def test_hostile_requests_over_grpc_are_invalid_argument(pair: Pair) -> None:
    requests = [
        pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in USER], max_new_tokens=2, chat_template=LOOPS
        ),
        pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in USER],
            max_new_tokens=2,
            tools=TOOL.format(nested(40, "properties")),
            tool_choice="required",
        ),
    ]
    with grpc.insecure_channel(pair.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for request in requests:
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert time.monotonic() - start < TIMEOUT_S + 1.0
