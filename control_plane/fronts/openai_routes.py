"""The OpenAI port's routes beside generation, as vLLM serves them: `/health` and `/ping`,
`/version`, the served model (`GET /v1/models`, one by its id, with `max_model_len`),
`/tokenize` and `/detokenize`, and `/metrics`."""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from prometheus_client.exposition import choose_encoder
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from control_plane.admission.door import BadRequest, Door
from control_plane.fronts.openai_body import detokenize_request, tokenize_request
from control_plane.fronts.openai_fields import InvalidParam
from control_plane.fronts.openai_reply import grpc_error
from control_plane.scheduler.metrics import Metrics
from protos.model import Capabilities

OWNER = "met"
# A body is read whole before any of it is checked. Images travel in it (base64, a third
# larger than their files): Anthropic's API bounds a request to 32 MB too. The control plane's
# gRPC server takes messages of this size.
MAX_BODY_BYTES = 32 << 20
VERSION = importlib.metadata.version("met")


def refused(e: BadRequest) -> JSONResponse:
    """A refusal in OpenAI's error shape, its status from its code (or its own)."""
    status, body = grpc_error(e.code, str(e), e.param, getattr(e, "status", None))
    return JSONResponse(body, status)


class Catalog:
    """The routes that read the served model and its tokenizer, over one `Door`."""

    def __init__(self, door: Door) -> None:
        self.door = door

    async def health(self, request: Request) -> Response:
        """200 while the GPU service answers, 503 in OpenAI's error shape otherwise (what a
        load balancer or an orchestrator's probe reads, as vLLM's `/health`)."""
        try:
            await self.door.capabilities()
        except BadRequest as e:
            return refused(e)
        return JSONResponse({})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def models(self, request: Request) -> Response:
        try:
            caps = await self.door.capabilities()
        except BadRequest as e:
            return refused(e)
        names = self.door.model_names(caps)
        return JSONResponse({"object": "list", "data": [_model(caps, n) for n in names]})

    async def model(self, request: Request) -> Response:
        """One model by its id (the SDK's `models.retrieve`); 404 for any other."""
        try:
            caps = await self.door.capabilities()
            name = request.path_params["model"]
            self.door.check_model(name, caps)
        except BadRequest as e:
            return refused(e)
        return JSONResponse(_model(caps, name))

    async def tokenize(self, request: Request) -> Response:
        """vLLM's `/tokenize`: a prompt's ids, or a chat's as its template renders it."""
        try:
            params, strs = tokenize_request(await read_body(request))
            ids = await self.door.tokenize(params)
            caps = await self.door.capabilities()
        except BadRequest as e:
            return refused(e)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": caps.max_context, "tokens": ids}
        tokenizer = self.door.scheduler.tokenizer
        body["token_strs"] = [tokenizer.decode([t]) for t in ids] if strs else None
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        try:
            ids = detokenize_request(await read_body(request))
            caps = await self.door.capabilities()
            bad = next((t for t in ids if t >= caps.vocab_size), None)
            if bad is not None:
                raise InvalidParam(
                    "tokens",
                    f"tokens holds token id {bad}, outside the vocabulary "
                    f"(0 .. {caps.vocab_size - 1})",
                )
        except BadRequest as e:
            return refused(e)
        return JSONResponse({"prompt": self.door.scheduler.tokenizer.decode(list(ids))})


def _model(caps: Capabilities, name: str) -> dict[str, Any]:
    """The served model under `name` as OpenAI lists one, with vLLM's `max_model_len`."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": OWNER,
        "root": caps.model_name,
        "max_model_len": caps.max_context,
    }


def metrics_route(metrics: Metrics) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        # As prometheus_client's own server answers: the format the scraper's Accept asks.
        encode, kind = choose_encoder(request.headers.get("accept", ""))
        # Off the event loop: a scrape asks each GPU service its KV pool's usage.
        body = await run_in_threadpool(encode, metrics.exported)
        return Response(body, headers={"content-type": kind})

    return route


async def read_body(request: Request) -> Any:
    """The body, read up to MAX_BODY_BYTES and parsed."""
    data = bytearray()
    try:
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY_BYTES:
                raise InvalidParam(
                    None,
                    f"the body is over {MAX_BODY_BYTES} bytes, this server's bound",
                    status=413,
                )
    except ClientDisconnect:
        raise BadRequest(grpc.StatusCode.CANCELLED, "the client left before its body") from None
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError
        raise InvalidParam(None, f"the body is not JSON: {e}") from None
