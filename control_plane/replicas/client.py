"""The model contract (`protos.model`) over `met.v1.ModelService`: blocking stubs, protobuf
converted at this edge by the table of `protos.operations`, refused requests raised as the same
`ModelError`s the in-process engine raises. Each client is one session of the service
(protos/model.py), open from construction to `close`."""

from __future__ import annotations

import os
import queue
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from protos import convert as cv
from protos import tls
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import (
    ADMIN_KEY_ENV,
    ADMIN_KEY_METADATA,
    ERRORS_BY_CODE,
    SESSION_METADATA,
)
from protos.operations import OPERATIONS, Operation, bind
from protos.steps import PlanResult, StepPlan, StepStream
from protos.telemetry import ClientTracing


class GrpcModel:
    """`CircuitModel` over gRPC: its unary operations are made from `protos.operations`' table
    (below the class), so the type checker sees them through `__getattr__`."""

    if TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any: ...

    def __init__(
        self,
        target: str,
        timeout: float = 60.0,
        admin_key: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        authority: str | None = None,
        interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = (),
    ) -> None:
        """Connects (over TLS with `credentials`) and opens the session: a `grpc.RpcError`
        when the service is unreachable. `admin_key`, sent on admin calls only, defaults to
        env `ADMIN_KEY_ENV`. `authority`: the name the service's certificate must carry
        when `target` is one of the addresses that name resolved to. `interceptors` see
        every call of the session after the tracing one (gRPC's client interceptors, which
        may also intercept streams)."""
        self.target = target
        self.timeout = timeout
        named = (("grpc.ssl_target_name_override", authority),) if authority and credentials else ()
        self._channel = tls.open_channel(target, credentials, named)
        self._traced = grpc.intercept_channel(
            self._channel, ClientTracing("met.control_plane"), *interceptors
        )
        self._stub = pb_grpc.ModelServiceStub(self._traced)
        # No deadline: the stream lives as long as the session.
        self._session = pb_grpc.ModelServiceStub(self._channel).OpenSession(pb.OpenSessionRequest())
        try:
            self.session_id: str = next(self._session).session_id
        except grpc.RpcError:
            self._channel.close()
            raise
        self._metadata = ((SESSION_METADATA, self.session_id),)
        key = admin_key if admin_key is not None else os.environ.get(ADMIN_KEY_ENV, "")
        self._admin_metadata = (*self._metadata, (ADMIN_KEY_METADATA, key))

    def close(self) -> None:
        """End the session (the service frees its sequences) and the connection."""
        self._session.cancel()
        self._channel.close()

    def _rpc(self, method: Callable[..., Any], request: Any, admin: bool = False) -> Any:
        metadata = self._admin_metadata if admin else self._metadata
        try:
            return method(request, timeout=self.timeout, metadata=metadata)
        except grpc.RpcError as e:
            raise _refused(e) from None

    def tokenizer_files(self) -> dict[str, bytes]:
        files: dict[str, bytearray] = {}
        chunks = self._stub.TokenizerFiles(pb.TokenizerFilesRequest(), timeout=self.timeout)
        try:
            for chunk in chunks:
                files.setdefault(chunk.name, bytearray()).extend(chunk.data)
        except grpc.RpcError as e:
            raise _refused(e) from None
        return {name: bytes(data) for name, data in files.items()}

    def open_steps(self) -> StepStream:
        return GrpcSteps(self._stub.StepStream, self._metadata)


def _unary(op: Operation) -> Callable[..., Any]:
    """The client's side of one unary operation: its arguments converted by the table, the
    RPC, and its reply converted back."""

    def call(self: GrpcModel, *args: Any, **kwargs: Any) -> Any:
        named = bind(op, args, kwargs)
        assert op.request is not None and op.result is not None
        reply = self._rpc(getattr(self._stub, op.rpc), op.request(named), op.admin(named))
        return op.result(reply, named)

    call.__name__ = call.__qualname__ = op.name
    call.__doc__ = f"`{op.rpc}` (protos/operations.py)"
    return call


for _op in OPERATIONS:
    if not _op.stream:
        setattr(GrpcModel, _op.name, _unary(_op))


class GrpcSteps:
    """The caller's end of a `StepStream` call: `send` queues the plan for the call's request
    iterator (which gRPC drains on a thread of its own), `recv` blocks for the next result and
    gives the handles of the sequences that ran their new lengths. One thread may send while
    another reads."""

    def __init__(self, method: Callable[..., Any], metadata: tuple[tuple[str, str], ...]) -> None:
        self._plans: queue.SimpleQueue[pb.StepPlan | None] = queue.SimpleQueue()
        self._sent: deque[StepPlan] = deque()  # sent, their results not read yet
        # The later steps of the plan read last (one message carries a plan's every step).
        self._steps: deque[pb.PlanResult] = deque()
        # No deadline: the stream lives as long as its caller keeps it.
        self._call = method(iter(self._plans.get, None), metadata=metadata)

    def send(self, plan: StepPlan) -> None:
        self._sent.append(plan)  # before the plan leaves, so its result always finds it
        self._plans.put(cv.plan_to_pb(plan))

    def recv(self) -> PlanResult:
        if not self._steps:
            try:
                reply = next(self._call, None)
            except grpc.RpcError as e:
                raise _refused(e) from None
            if reply is None:
                raise RuntimeError("the step stream ended: it was closed")
            self._steps.extend(cv.plan_results_from_pb(reply))
        step = self._steps.popleft()
        plan = self._sent[0]
        if not self._steps:
            self._sent.popleft()  # its last step
        result = cv.plan_result_from_pb(step)
        cv.mirror_seq_lens([plan.seqs[i] for i in result.ran], step.step.seq_lens)
        return result

    def close(self) -> None:
        """End the plans and the call; a `recv` waiting meanwhile raises CANCELLED."""
        self._plans.put(None)
        self._call.cancel()


def _refused(e: grpc.RpcError) -> Exception:
    """A refusal as the `ModelError` the in-process engine raises; a transport error as is."""
    error = ERRORS_BY_CODE.get(e.code().name)
    return e if error is None else error(e.details())
