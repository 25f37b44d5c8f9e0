"""`met.v1.ModelService` over the engine: unpack, call, pack. Protobuf stops here.

Engine calls run on one worker thread, so operations execute one at a time in arrival order
while the event loop keeps answering health checks. Sessions and the admin key (protos/model.py)
are checked here, on the event loop: the engine knows nothing of them."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hmac
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from gpu_service.engine import costs
from gpu_service.engine.facade import Engine
from gpu_service.engine.plans import Refusal
from gpu_service.memory.slots import SessionTable
from gpu_service.rpc.options import Access
from gpu_service.rpc.step_stream import serve_plans
from protos import convert as cv
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import (
    ADMIN_KEY_METADATA,
    MTP_HEAD,
    SESSION_METADATA,
    ModelError,
    NotFound,
    PermissionDenied,
    SequenceHandle,
    fits_batch,
)
from protos.operations import BY_NAME, OPERATIONS, Operation
from protos.steps import PlanResult, StepPlan

_LOADING = "the model is still loading"
# Bytes of a file per TokenizerFileChunk: a real tokenizer.json (~11 MB) passes in chunks well
# inside gRPC's 4 MiB message bound.
TOKENIZER_CHUNK_BYTES = 1 << 20


class ModelLoading(ModelError):
    """An RPC that arrived before the engine finished loading."""

    code = "UNAVAILABLE"


class NoSession(ModelError):
    """A call that names no live session: to its client, a lost connection (it reconnects,
    which opens a new session), so no `Model` error stands for it."""

    code = "UNAUTHENTICATED"


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key and isinstance(v, str):
            return v
    return None


class ModelServicer(pb_grpc.ModelServiceServicer):
    def __init__(self, access: Access | None = None) -> None:
        self.engine: Engine | None = None
        self.access = access or Access()
        self.sessions = SessionTable()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._closing = asyncio.Event()  # set on shutdown: every session stream ends
        self._freeing: set[asyncio.Task[None]] = set()  # ended sessions' frees in flight

    @property
    def loaded(self) -> Engine:
        """The engine, for calls `_call` runs: it has refused the RPC already when there is
        none, and this raises the same status (through `ErrorInterceptor`) if one slips by."""
        if self.engine is None:
            raise ModelLoading(_LOADING)
        return self.engine

    async def run_on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Every torch call of the process on one thread, loading included."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn)

    async def _call(
        self, context: grpc.aio.ServicerContext, fn: Callable[..., Any], *args: Any
    ) -> Any:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _LOADING)
        # The copied context carries the RPC's server span into the engine thread.
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._worker, ctx.run, fn, *args)

    # -- sessions and the admin key ----------------------------------------------------------

    def _session(self, context: grpc.aio.ServicerContext) -> str:
        """The live session the call names, or `NoSession`."""
        session = _metadata(context, SESSION_METADATA)
        if session is None:
            raise NoSession(
                f"the call names no session: open one with OpenSession and send its id as "
                f"`{SESSION_METADATA}` metadata"
            )
        if not self.sessions.is_live(session):
            raise NoSession("the call's session is unknown or has ended; open a new one")
        return session

    def _owned(
        self, context: grpc.aio.ServicerContext, seq_ids: Iterable[int]
    ) -> list[SequenceHandle]:
        """Handles of the sequences a call names, each owned by the call's session."""
        ids = list(seq_ids)
        self.sessions.check(self._session(context), ids)
        return cv.handles(ids)

    def _holds_key(self, context: grpc.aio.ServicerContext) -> bool:
        key = self.access.admin_key
        given = _metadata(context, ADMIN_KEY_METADATA) or ""
        return key is not None and hmac.compare_digest(given.encode(), key.encode())

    def _admin(self, context: grpc.aio.ServicerContext) -> None:
        if self.access.admin_key is None:
            raise PermissionDenied(
                "admin calls are refused: the service was started without an admin key"
            )
        if not self._holds_key(context):
            raise PermissionDenied(
                f"an admin call needs the service's admin key as `{ADMIN_KEY_METADATA}` metadata"
            )

    def end_sessions(self) -> None:
        """End every session stream (on shutdown), freeing their sequences."""
        self._closing.set()

    async def OpenSession(self, request, context):
        session = self.sessions.open()
        try:
            timeout = self.access.session_timeout
            await context.write(pb.SessionInfo(session_id=session, timeout_s=timeout))
            await self._closing.wait()  # or the client cancels, or its connection breaks
        finally:
            self._end(session)

    def _end(self, session: str) -> None:
        snap_ids = self.sessions.close_snapshots(session)
        seq_ids = self.sessions.close(session)
        if (seq_ids or snap_ids) and self.engine is not None:
            engine = self.engine

            def free() -> None:
                engine.free_sequences(seq_ids)
                engine.drop_prefixes(snap_ids)

            task = asyncio.get_running_loop().create_task(self.run_on_engine_thread(free))
            self._freeing.add(task)
            task.add_done_callback(self._freeing.discard)

    # -- operations ----------------------------------------------------------------------------

    async def _serve(self, op: Operation, request: Any, context: grpc.aio.ServicerContext):
        """A unary operation as the table converts it: its session, its admin key and the
        sequences and snapshots it names checked, then the engine's call -> (result, the
        call's arguments)."""
        session = self._session(context) if op.session else None
        assert op.arguments is not None
        args = op.arguments(request)
        if op.admin(args):
            self._admin(context)
        if session is not None:
            named = args["seqs"] if "seqs" in args else [args["seq"]] if "seq" in args else []
            self.sessions.check(session, [s.seq_id for s in named])
            if "snapshots" in args:
                self.sessions.check_snapshots(session, args["snapshots"])
        value = await self._call(context, lambda: getattr(self.loaded, op.name)(**args))
        return value, args

    async def TokenizerFiles(self, request, context):
        # Read when the checkpoint loaded: no engine-thread job, no session (read-only).
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _LOADING)
        for name, data in self.loaded.tokenizer_files().items():
            # An empty file is one empty chunk, so that its name still arrives.
            for lo in range(0, max(len(data), 1), TOKENIZER_CHUNK_BYTES):
                yield pb.TokenizerFileChunk(name=name, data=data[lo : lo + TOKENIZER_CHUNK_BYTES])

    async def AllocSequence(self, request, context):
        session = self._session(context)
        penalties = cv.penalties_from_pb(request)
        drafter = request.drafter or MTP_HEAD
        # The operator's sessions (the control plane's, with the admin key) may hold every slot.
        slots = self.loaded.svc.num_slots
        most = slots if self._holds_key(context) else self.access.session_slots(slots)
        self.sessions.claim(session, most)
        try:
            seq = await self._call(context, lambda: self.loaded.alloc_sequence(penalties, drafter))
            if not self.sessions.is_live(session):  # it ended while the engine allocated
                await self._call(context, lambda: self.loaded.free_sequences([seq.seq_id]))
                raise NoSession("the call's session ended while it ran; open a new one")
            self.sessions.own(session, seq.seq_id)
        finally:
            self.sessions.unclaim(session)
        return cv.to_pb(seq)

    async def FreeSequence(self, request, context):
        op = BY_NAME["free_sequence"]
        _, args = await self._serve(op, request, context)
        self.sessions.disown(args["seq"].seq_id)
        return pb.FreeSequenceReply()

    async def CanBatchVerify(self, request, context):
        # Not an operation of the contract any more (the rule is `fits_batch` on the
        # capabilities), answered for clients of the wire that still ask.
        self._session(context)
        return pb.CanBatchVerifyReply(ok=fits_batch(self.loaded.capabilities(), request.ks))

    async def Propose(self, request, context):
        op = BY_NAME["run_mtp_propose_batched"]
        self._session(context)
        assert op.arguments is not None and op.reply is not None
        args = op.arguments(request)
        self._owned(context, (s.seq_id for s in args["seqs"]))

        def run():
            if request.positions:
                self.loaded.check_positions(args["seqs"], list(request.positions))
            return self.loaded.run_mtp_propose_batched(**args)

        return op.reply(await self._call(context, run), args)

    async def SnapshotPrefixes(self, request, context):
        session = self._session(context)
        ids, args = await self._serve(BY_NAME["snapshot_prefixes"], request, context)
        if not self.sessions.is_live(session):  # it ended while the engine took them
            await self._call(context, lambda: self.loaded.drop_prefixes(ids))
            raise NoSession("the call's session ended while it ran; open a new one")
        self.sessions.own_snapshots(session, ids)
        return pb.SnapshotReply(snapshot_ids=ids)

    async def DropPrefixes(self, request, context):
        _, args = await self._serve(BY_NAME["drop_prefixes"], request, context)
        self.sessions.disown_snapshots(args["snapshots"])
        return pb.DropPrefixesReply()

    async def StepStream(self, request_iterator, context):
        # A call's metadata is fixed: its session is read once, its liveness at every plan.
        session = _metadata(context, SESSION_METADATA)
        admit = functools.partial(self._admit_plan, context, session)
        plans = serve_plans(request_iterator, admit, self._worker, self._closing)
        async with contextlib.aclosing(plans) as results:  # a caller gone stops its plans
            async for result in results:
                yield result

    def _admit_plan(
        self, context: grpc.aio.ServicerContext, session: str | None, request: pb.StepPlan
    ) -> tuple[StepPlan, list[Refusal], Callable[[StepPlan], PlanResult]]:
        """A plan, checked as a unary call is (a live session, a loaded model); its sequences
        that the session does not own are refused alone, as `_owned` refuses a call's."""
        if session is None or not self.sessions.is_live(session):
            session = self._session(context)  # raises the refusal with its sentence
        plan = cv.plan_from_pb(request)
        refused = []
        for i, h in enumerate(plan.seqs):
            try:
                self.sessions.check(session, [h.seq_id])
            except NotFound as e:
                refused.append((i, e.code, str(e)))
        return plan, refused, self.loaded.run_plan

    async def MeasureCosts(self, request, context):
        op = BY_NAME["measure_costs"]
        assert op.arguments is not None and op.reply is not None
        args = op.arguments(request)
        if op.admin(args):
            self._admin(context)
        # Refused here, not behind whatever holds the engine thread.
        costs.check(self.loaded.svc, args["widths"], args["max_depth"], args["repeats"])
        job = costs.measurement(self.loaded, **args)
        try:
            # One engine-thread job per step: calls queued meanwhile run between them.
            while (result := await self._call(context, costs.advance, job)) is None:
                continue
        finally:
            # Frees the scratch sequences on error or cancellation; shielded, so a second
            # cancellation cannot drop the job from the queue.
            await asyncio.shield(self.run_on_engine_thread(job.close))
        return op.reply(result, args)


def _unary(op: Operation) -> Callable[..., Any]:
    """The servicer's side of an operation the table converts whole."""

    async def handle(self: ModelServicer, request: Any, context: grpc.aio.ServicerContext):
        value, args = await self._serve(op, request, context)
        assert op.reply is not None
        return op.reply(value, args)

    handle.__name__ = handle.__qualname__ = op.rpc
    return handle


for _op in OPERATIONS:
    if not _op.stream and _op.rpc not in ModelServicer.__dict__:
        setattr(ModelServicer, _op.rpc, _unary(_op))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps a refused request (`ModelError`) to its status code and sentence."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is not None and handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _guarded_stream(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        async def guarded(request, context):
            try:
                return await inner(request, context)
            except ModelError as e:
                await context.abort(getattr(grpc.StatusCode, e.code), str(e))

        return grpc.unary_unary_rpc_method_handler(
            guarded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _guarded_stream(inner: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """A stream handler whose refusal (`ModelError`) ends the stream with its status, after
    the replies before it."""

    async def guarded(requests, context):
        try:
            async for reply in inner(requests, context):
                yield reply
        except ModelError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))

    return guarded
