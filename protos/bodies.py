"""Request bodies a server cannot parse: bytes that are not the method's message, or invalid
UTF-8 in a string field. Left to grpc they fail inside its deserializer, before any handler,
and come back as UNKNOWN with a traceback in the log; `RejectUndecodable` answers them with
INVALID_ARGUMENT and a sentence. Torch-free; both servers install it:

    server = grpc.aio.server(interceptors=[RejectUndecodable(), ...])

On a request stream, the frame that does not parse raises `UndecodableFrame` where the handler
reads it, and the status goes out when the handler has ended: after the replies to the frames
before it (a status sent from the reading side would overtake them, and race the writes).
A handler that reads requests with `context.read()` instead of iterating is not guarded."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

Prepare = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]

HANDLER_BUILDERS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class Undecodable:
    """Handed to the handler in place of a request its deserializer could not parse."""

    def __init__(self, sentence: str) -> None:
        self.sentence = sentence


def lenient(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    """`deserialize` that returns `Undecodable` where it would raise `DecodeError`."""
    message = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    what = f"a valid {message.full_name} message" if message else f"a valid request of {method}"
    sentence = f"the request body is not {what}"

    def parse(body: bytes) -> Any:
        try:
            return deserialize(body)
        except DecodeError:
            return Undecodable(sentence)

    return parse


class UndecodableFrame(Exception):
    """Raised where a handler reads the frame of a request stream that does not parse; the
    guard ends the call with INVALID_ARGUMENT and this sentence once the handler has ended."""


async def _refuse_undecodable(request: Any, context: grpc.aio.ServicerContext) -> Any:
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.sentence)
    return request


async def _checked_stream(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    async def checked() -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, Undecodable):
                raise UndecodableFrame(request.sentence)
            yield request

    return checked()


def _guard(behavior: Callable[..., Any], prepare: Prepare) -> Callable[..., Any]:
    """`behavior` with its first argument passed through `prepare`; a generator stays one. An
    `UndecodableFrame` that ends it becomes its status, after every reply it gave."""
    if inspect.isasyncgenfunction(behavior):

        async def replies(arg: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for reply in behavior(await prepare(arg, context), context):
                    yield reply
            except UndecodableFrame as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        return replies

    async def reply(arg: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(await prepare(arg, context), context)
        except UndecodableFrame as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    return reply


def guard(handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler | None:
    """The handler with a lenient deserializer and a behavior that refuses `Undecodable`."""
    if handler is None or handler.request_deserializer is None:
        return handler
    kind, build = HANDLER_BUILDERS[(handler.request_streaming, handler.response_streaming)]
    prepare = _checked_stream if handler.request_streaming else _refuse_undecodable
    return build(
        _guard(getattr(handler, kind), prepare),
        request_deserializer=lenient(handler.request_deserializer, method),
        response_serializer=handler.response_serializer,
    )


class RejectUndecodable(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT and a sentence for a request body that does not parse, on every
    method of the server."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        return guard(handler, handler_call_details.method)
