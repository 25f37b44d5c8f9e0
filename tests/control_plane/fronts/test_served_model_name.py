"""`--served-model-name`: the names a model answers to, the first reported, as vLLM's flag
has it; a checkpoint in a folder of another name is still asked for by its published name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.trace import NoOpTracer

from control_plane.admission.door import Admission, BadRequest, Door
from control_plane.cli.server import admission
from control_plane.fronts import http_app
from control_plane.scheduler.scheduler import Scheduler
from gpu_service.engine.facade import Engine
from met.main import build_parser
from tests.conftest import TINY_SERVICE

NAMES = ("Qwen/Qwen3.6-35B-A3B", "qwen3.6")


def test_the_first_name_is_reported_and_every_one_answers(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, TINY_SERVICE)
    door = Door(Scheduler(lambda: engine), Admission(model_names=NAMES))
    caps = asyncio.run(door.capabilities())
    assert caps.model_name == NAMES[0]
    for name in (*NAMES, None):
        door.check_model(name, caps)
    with pytest.raises(BadRequest) as caught:
        door.check_model(engine.capabilities().model_name, caps)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND and caught.value.param == "model"
    assert str(caught.value) == (
        f"model {engine.capabilities().model_name!r} is not served here; this server serves "
        f"{NAMES[0]!r} (GET /v1/models)"
    )

    async def models() -> tuple[list[str], int, int]:
        app = http_app.build_app(door, frozenset(), NoOpTracer(), None)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            listed = (await client.get("/v1/models")).json()["data"]
            alias = (await client.get(f"/v1/models/{NAMES[1]}")).status_code
            other = (await client.get("/v1/models/tiny0")).status_code
        return [m["id"] for m in listed], alias, other

    assert asyncio.run(models()) == (list(NAMES), 200, 404)
    door.close()


def test_the_flag_takes_several_names() -> None:
    args = build_parser().parse_args(
        ["control-plane", "serve", "--gpu-service", "x:1", "--served-model-name", *NAMES]
    )
    assert admission(args).model_names == NAMES
    default = build_parser().parse_args(["control-plane", "serve", "--gpu-service", "x:1"])
    assert admission(default).model_names == ()
