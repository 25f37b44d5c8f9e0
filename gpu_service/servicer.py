"""`met.v1.ModelService` over the engine: unpack, call, pack. Protobuf stops here.

Engine calls run on one worker thread, so operations execute one at a time in arrival order
while the event loop keeps answering health checks."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from gpu_service import costs
from gpu_service.engine import Engine
from protos import convert as cv
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import ModelError, RowDraws, SequenceHandle

_LOADING = "the model is still loading"


class ModelLoading(ModelError):
    """An RPC that arrived before the engine finished loading."""

    code = "UNAVAILABLE"


class ModelServicer(pb_grpc.ModelServiceServicer):
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

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

    async def Capabilities(self, request, context):
        return cv.to_pb(await self._call(context, lambda: self.loaded.capabilities()))

    async def AllocSequence(self, request, context):
        return cv.to_pb(await self._call(context, lambda: self.loaded.alloc_sequence()))

    async def FreeSequence(self, request, context):
        (seq,) = cv.handles([request.seq_id])
        await self._call(context, lambda: self.loaded.free_sequence(seq))
        return pb.FreeSequenceReply()

    async def Prefill(self, request, context):
        seqs, prompts, masks, sampling = cv.prefill_from_pb(request)
        argmax, logprobs = await self._call(
            context,
            lambda: (
                self.loaded.prefill(seqs, prompts, masks, sampling),
                self.loaded.last_logprobs(),
            ),
        )
        return pb.PrefillReply(argmax=argmax, seq_lens=cv.seq_lens(seqs), logprobs=logprobs)

    async def DecodeVerifyBatched(self, request, context):
        seqs = cv.handles(request.seq_ids)

        def run() -> tuple[list[int], list[float], list[RowDraws | None]]:
            masks = cv.row_masks_from_pb(request.masks)
            sampled = cv.seq_sampling_from_pb(request.sampling, len(seqs))
            argmax = self.loaded.decode_verify_batched(
                list(request.tokens),
                list(request.ks),
                seqs,
                request.write_on_accept,
                masks,
                {i: s for i, s in enumerate(sampled) if s is not None},
            )
            return argmax, self.loaded.last_logprobs(), self.loaded.last_draws()

        argmax, logprobs, draws = await self._call(context, run)
        return pb.VerifyReply(
            argmax=argmax, seq_lens=cv.seq_lens(seqs), logprobs=logprobs, **cv.draws_to_pb(draws)
        )

    async def CanBatchVerify(self, request, context):
        ok = await self._call(context, lambda: self.loaded.can_batch_verify(list(request.ks)))
        return pb.CanBatchVerifyReply(ok=ok)

    async def FoldAccepted(self, request, context):
        seqs = cv.handles(request.seq_ids)
        await self._call(
            context, lambda: self.loaded.gdn_fold_accepted(seqs, list(request.fold_rows))
        )
        return pb.FoldReply()

    async def CommitAcceptedPrefix(self, request, context):
        seqs = cv.handles(request.seq_ids)
        lens = await self._call(
            context,
            lambda: self.loaded.commit_accepted_prefix(
                seqs, list(request.kept_rows), list(request.ks)
            ),
        )
        return pb.CommitReply(seq_lens=lens)

    async def StashVerifyHiddenRows(self, request, context):
        await self._call(context, lambda: self.loaded.stash_verify_hidden_rows(list(request.rows)))
        return pb.StashReply()

    async def Propose(self, request, context):
        seqs = cv.handles(request.seq_ids)
        p = await self._call(context, lambda: self._propose(request, seqs))
        return pb.ProposeReply(**cv.proposal_to_pb(p))

    def _propose(self, request, seqs: list[SequenceHandle]):
        if request.positions:
            self.loaded.check_positions(seqs, list(request.positions))
        return self.loaded.run_mtp_propose_batched(
            list(request.last),
            list(request.stash),
            request.num_drafts,
            seqs,
            cv.seq_sampling_from_pb(request.sampling, len(seqs)),
        )

    async def TrimProposer(self, request, context):
        seqs = cv.handles(request.seq_ids)
        await self._call(context, lambda: self.loaded.trim_proposer_state(seqs, request.keep_own))
        return pb.TrimReply()

    async def DecodeStep(self, request, context):
        seqs = cv.handles(request.seq_ids)
        r = await self._call(
            context,
            lambda: self.loaded.decode_step(
                list(request.tokens),
                list(request.ks),
                seqs,
                list(request.want_drafts),
                request.num_drafts,
            ),
        )
        return cv.step_to_pb(r, cv.seq_lens(seqs))

    async def SettleVerdict(self, request, context):
        seqs = cv.handles(request.seq_ids)
        p = await self._call(
            context,
            lambda: self.loaded.settle_verdict(
                seqs,
                list(request.kept_rows),
                list(request.ks),
                list(request.proposers),
                list(request.last),
                request.num_drafts,
                cv.seq_sampling_from_pb(request.sampling, max(len(request.proposers), 1)),
            ),
        )
        return pb.VerdictReply(seq_lens=cv.seq_lens(seqs), **cv.proposal_to_pb(p))

    async def MeasureCosts(self, request, context):
        widths, repeats = list(request.widths), request.repeats or 5
        # Refused here, not behind whatever holds the engine thread.
        costs.check(self.loaded.svc, widths, request.max_depth, repeats)
        entries, cached = await self._call(
            context,
            lambda: self.loaded.measure_costs(widths, request.max_depth, repeats, request.refresh),
        )
        return cv.costs_to_pb(entries, cached)

    async def SetForward(self, request, context):
        await self._call(context, lambda: self.loaded.set_forward(request.forward))
        return pb.SetForwardReply(current_forward=request.forward)

    async def ReadLogits(self, request, context):
        return cv.to_pb(await self._call(context, lambda: self.loaded.read_logits()))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps a refused request (`ModelError`) to its status code and sentence."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
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
