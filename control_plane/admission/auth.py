"""API keys on the generation API: `--api-key` (repeatable) and `--api-key-file` (one key a
line). With any key configured, a call to a guarded service must carry `authorization: Bearer
<key>` metadata with one of them (or `x-api-key: <key>`, as Anthropic's clients send it), or it
ends UNAUTHENTICATED before its handler runs; health and reflection stay open so probes and
tools work without a key."""

from __future__ import annotations

import argparse
import hmac
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

import grpc

from protos.bodies import HANDLER_BUILDERS
from protos.tls import FlagError, read_flag_file

SCHEME = "Bearer "
API_KEY = "x-api-key"  # Anthropic's header, which its clients send the key in


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this key on the generation API (repeat for several)",
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="require one of the keys in this file, one a line (blank lines skipped)",
    )


def read_keys(args: argparse.Namespace) -> frozenset[str]:
    """The keys the flags name; empty when the API is open."""
    keys = {k.strip() for k in args.api_key}
    if "" in keys:
        raise FlagError("--api-key is empty; a key is at least one character.")
    if args.api_key_file is not None:
        text = read_flag_file("--api-key-file", args.api_key_file).decode(errors="replace")
        found = {line.strip() for line in text.splitlines()} - {""}
        if not found:
            raise FlagError(f"--api-key-file {args.api_key_file} holds no key.")
        keys |= found
    return frozenset(keys)


def refusal(
    metadata: Collection[tuple[str, Any]], keys: frozenset[str], carrier: str = "metadata"
) -> str | None:
    """Why a call with this metadata (gRPC's, or HTTP's headers: `carrier` "header") is
    refused, or None when it carries a valid key."""
    direct = [v for k, v in metadata if k == API_KEY]
    if direct:
        if not _accepted(_text(direct[0]).strip(), keys):
            return f"the API key in the {API_KEY} {carrier} is not one this server accepts."
        return None
    values = [v for k, v in metadata if k == "authorization"]
    if not values:
        return (
            f"this API requires an API key: send `authorization: Bearer <key>` {carrier} "
            f"(or `{API_KEY}: <key>`)."
        )
    value = _text(values[0])
    if not value.startswith(SCHEME):
        return f"the authorization {carrier} is not of the form `Bearer <key>`."
    if not _accepted(value[len(SCHEME) :].strip(), keys):
        return f"the API key in the authorization {carrier} is not one this server accepts."
    return None


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode(errors="replace")


def _accepted(offered: str, keys: frozenset[str]) -> bool:
    # Compared against every key in constant time, so timing tells nothing about a near miss.
    return any([hmac.compare_digest(offered.encode(), k.encode()) for k in keys])


def _denied(handler: grpc.RpcMethodHandler, sentence: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that ends the call UNAUTHENTICATED without reading its
    body (the raw bytes reach it: nothing of a refused call is parsed)."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, sentence)

    _, build = HANDLER_BUILDERS[(handler.request_streaming, handler.response_streaming)]
    return build(deny, request_deserializer=None, response_serializer=handler.response_serializer)


class RequireApiKey(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED and a sentence for a call to one of `services` without a valid key."""

    def __init__(self, keys: frozenset[str], services: Collection[str]) -> None:
        self.keys = keys
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefixes):
            return handler
        sentence = refusal(handler_call_details.invocation_metadata or (), self.keys)
        return handler if sentence is None else _denied(handler, sentence)


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with `key`."""
    return (("authorization", f"{SCHEME}{key}"),)
