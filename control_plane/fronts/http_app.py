"""The HTTP front's app: every route on one port (OpenAI's completions, chat completions and
Responses API, Anthropic's Messages API, vLLM's routes beside them) and the API key each
request must carry. Above the fronts' modules, which it assembles."""

from __future__ import annotations

from http import HTTPStatus

import grpc
from opentelemetry.trace import Tracer
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from control_plane.admission import auth
from control_plane.admission.door import Door
from control_plane.fronts import anthropic_messages
from control_plane.fronts.anthropic_reply import error_body as anthropic_error
from control_plane.fronts.api import TRACER
from control_plane.fronts.openai_http import Front
from control_plane.fronts.openai_reply import error
from control_plane.fronts.openai_responses import ResponsesRoute
from control_plane.fronts.openai_routes import Catalog, metrics_route
from control_plane.scheduler.metrics import Metrics

OPEN_ROUTES = frozenset({"/health", "/ping", "/version", "/metrics"})
MESSAGES_PATH = "/v1/messages"


def build_app(
    door: Door,
    api_keys: frozenset[str] = frozenset(),
    tracer: Tracer = TRACER,
    metrics: Metrics | None = None,
) -> ASGIApp:
    """The Starlette app over `door`; with `api_keys`, each request must carry one. With
    `metrics`, `/metrics` serves them (vLLM serves its own on its API port)."""
    front, catalog = Front(door, tracer), Catalog(door)
    responses = ResponsesRoute(door, tracer)
    routes = [
        Route("/health", catalog.health, methods=["GET"]),
        Route("/ping", catalog.health, methods=["GET", "POST"]),
        Route("/version", catalog.version, methods=["GET"]),
        Route("/v1/models", catalog.models, methods=["GET"]),
        Route("/v1/models/{model:path}", catalog.model, methods=["GET"]),
        Route("/v1/completions", front.completions, methods=["POST"]),
        Route("/v1/chat/completions", front.chat, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/input_tokens", responses.input_tokens, methods=["POST"]),
        Route("/v1/responses/{id:path}", responses.stored, methods=["GET", "POST", "DELETE"]),
        Route("/tokenize", catalog.tokenize, methods=["POST"]),
        Route("/detokenize", catalog.detokenize, methods=["POST"]),
    ]
    routes += anthropic_messages.routes(door, tracer)
    if metrics is not None:
        routes.append(Route("/metrics", metrics_route(metrics), methods=["GET"]))
    app: ASGIApp = Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error},
    )
    return RequireKey(app, api_keys) if api_keys else app


class RequireKey:
    """401 in OpenAI's shape (Anthropic's on `/v1/messages`) for a request without one of
    `keys`, before its body is read; `/health`, `/ping`, `/version` and `/metrics` are open, as
    gRPC's health service and vLLM's are."""

    def __init__(self, app: ASGIApp, keys: frozenset[str]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Probes carry no key, and the health route tells nothing a key would guard.
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
            sentence = auth.refusal(headers, self.keys, "header")
            if sentence is not None:
                body = error(401, sentence, grpc.StatusCode.UNAUTHENTICATED.name.lower())
                if scope["path"].startswith(MESSAGES_PATH):  # Anthropic's clients read theirs
                    body = anthropic_error(401, sentence)
                await JSONResponse(body, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    code = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
    body = error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code)
    return JSONResponse(body, exc.status_code, headers=exc.headers)
