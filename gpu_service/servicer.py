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

from gpu_service.engine import Engine
from protos.met.v1 import model_pb2 as pb
from protos.met.v1 import model_pb2_grpc as pb_grpc
from protos.model import InvalidArgument, ModelError, Sampling, SequenceHandle


def _sampling(p: pb.SamplingParams) -> Sampling:
    return Sampling(p.temperature, p.top_k, p.top_p, tuple(p.uniforms))


def _seq_sampling(items: Any, n: int) -> list[Sampling | None]:
    out: list[Sampling | None] = [None] * n
    for item in items:
        if item.index >= n:
            raise InvalidArgument(f"sampling names sequence {item.index} of {n}")
        out[item.index] = _sampling(item.params)
    return out


def _handles(ids: Any) -> list[SequenceHandle]:
    return [SequenceHandle(int(i), -1) for i in ids]


class ModelServicer(pb_grpc.ModelServiceServicer):
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def run_on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Every torch call of the process on one thread, loading included."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn)

    async def _call(
        self, context: grpc.aio.ServicerContext, fn: Callable[..., Any], *args: Any
    ) -> Any:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        # The copied context carries the RPC's server span into the engine thread.
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._worker, ctx.run, fn, *args)

    async def Capabilities(self, request, context):
        c = await self._call(context, lambda: self.engine.capabilities())
        return pb.CapabilitiesReply(
            model_name=c.model_name,
            vocab_size=c.vocab_size,
            num_slots=c.num_slots,
            free_slots=c.free_slots,
            slot_verify_drafts=c.slot_verify_drafts,
            max_rows=c.max_rows,
            forwards=c.forwards,
            current_forward=c.current_forward,
            device=c.device,
            max_context=c.max_context,
            dtype=c.dtype,
            hidden_size=c.hidden_size,
            eos_token_ids=c.eos_token_ids,
            has_mtp=c.has_mtp,
            max_batch=c.max_batch,
            max_prefill_tokens=c.max_prefill_tokens,
        )

    async def AllocSequence(self, request, context):
        h = await self._call(context, lambda: self.engine.alloc_sequence())
        return pb.SequenceHandle(seq_id=h.seq_id, slot=h.slot, seq_len=h.seq_len)

    async def FreeSequence(self, request, context):
        await self._call(context, lambda: self.engine.free_sequence(_handles([request.seq_id])[0]))
        return pb.FreeSequenceReply()

    async def Prefill(self, request, context):
        seqs = _handles(item.seq_id for item in request.items)
        prompts = [list(item.tokens) for item in request.items]
        masks = [item.mask for item in request.items]
        sampling = [
            _sampling(i.sampling) if i.HasField("sampling") else None for i in request.items
        ]
        argmax, logprobs = await self._call(
            context,
            lambda: (
                self.engine.prefill(seqs, prompts, masks, sampling),
                self.engine.last_logprobs(),
            ),
        )
        return pb.PrefillReply(argmax=argmax, seq_lens=[s.seq_len for s in seqs], logprobs=logprobs)

    async def DecodeVerifyBatched(self, request, context):
        seqs = _handles(request.seq_ids)

        def run() -> tuple[list[int], list[float]]:
            masks = {m.row: m.bits for m in request.masks}
            if len(masks) != len(request.masks):
                raise InvalidArgument("two masks name the same row")
            sampled = _seq_sampling(request.sampling, len(seqs))
            argmax = self.engine.decode_verify_batched(
                list(request.tokens),
                list(request.ks),
                seqs,
                request.write_on_accept,
                masks,
                {i: s for i, s in enumerate(sampled) if s is not None},
            )
            return argmax, self.engine.last_logprobs(), self.engine.last_draws()

        argmax, logprobs, draws = await self._call(context, run)
        return pb.VerifyReply(
            argmax=argmax,
            seq_lens=[s.seq_len for s in seqs],
            logprobs=logprobs,
            p_next=[d.p_next if d else 0.0 for d in draws],
            resample=[d.resample if d else 0 for d in draws],
            sample=[d.sample if d else 0 for d in draws],
        )

    async def CanBatchVerify(self, request, context):
        ok = await self._call(context, lambda: self.engine.can_batch_verify(list(request.ks)))
        return pb.CanBatchVerifyReply(ok=ok)

    async def FoldAccepted(self, request, context):
        seqs = _handles(request.seq_ids)
        await self._call(
            context, lambda: self.engine.gdn_fold_accepted(seqs, list(request.fold_rows))
        )
        return pb.FoldReply()

    async def CommitAcceptedPrefix(self, request, context):
        seqs = _handles(request.seq_ids)
        lens = await self._call(
            context,
            lambda: self.engine.commit_accepted_prefix(
                seqs, list(request.kept_rows), list(request.ks)
            ),
        )
        return pb.CommitReply(seq_lens=lens)

    async def StashVerifyHiddenRows(self, request, context):
        await self._call(context, lambda: self.engine.stash_verify_hidden_rows(list(request.rows)))
        return pb.StashReply()

    async def Propose(self, request, context):
        seqs = _handles(request.seq_ids)
        p = await self._call(context, lambda: self._propose(request, seqs))
        return pb.ProposeReply(
            drafts=[t for row in p.drafts for t in row],
            confidences=[c for row in p.confidences for c in row],
        )

    def _propose(self, request, seqs: list[SequenceHandle]):
        if request.positions:
            self.engine.check_positions(seqs, list(request.positions))
        return self.engine.run_mtp_propose_batched(
            list(request.last),
            list(request.stash),
            request.num_drafts,
            seqs,
            _seq_sampling(request.sampling, len(seqs)),
        )

    async def TrimProposer(self, request, context):
        await self._call(
            context,
            lambda: self.engine.trim_proposer_state(_handles(request.seq_ids), request.keep_own),
        )
        return pb.TrimReply()

    async def DecodeStep(self, request, context):
        seqs = _handles(request.seq_ids)
        r = await self._call(
            context,
            lambda: self.engine.decode_step(
                list(request.tokens),
                list(request.ks),
                seqs,
                list(request.want_drafts),
                request.num_drafts,
            ),
        )
        return pb.StepReply(
            argmax=r.argmax,
            logprobs=r.logprobs,
            accepted=r.accepted,
            seq_lens=[s.seq_len for s in seqs],
            proposers=r.proposers,
            drafts=[t for row in r.proposal.drafts for t in row],
            confidences=[c for row in r.proposal.confidences for c in row],
        )

    async def SettleVerdict(self, request, context):
        seqs = _handles(request.seq_ids)
        p = await self._call(
            context,
            lambda: self.engine.settle_verdict(
                seqs,
                list(request.kept_rows),
                list(request.ks),
                list(request.proposers),
                list(request.last),
                request.num_drafts,
                _seq_sampling(request.sampling, max(len(request.proposers), 1)),
            ),
        )
        return pb.VerdictReply(
            seq_lens=[s.seq_len for s in seqs],
            drafts=[t for row in p.drafts for t in row],
            confidences=[c for row in p.confidences for c in row],
        )

    async def MeasureCosts(self, request, context):
        entries, cached = await self._call(
            context,
            lambda: self.engine.measure_costs(
                list(request.widths), request.max_depth, request.repeats or 5, request.refresh
            ),
        )
        return pb.CostReply(
            entries=[
                pb.CostEntry(
                    width=e.width, depth=e.depth, verify_ms=e.verify_ms, propose_ms=e.propose_ms
                )
                for e in entries
            ],
            cached=cached,
        )

    async def SetForward(self, request, context):
        await self._call(context, lambda: self.engine.set_forward(request.forward))
        return pb.SetForwardReply(current_forward=request.forward)

    async def ReadLogits(self, request, context):
        lg = await self._call(context, lambda: self.engine.read_logits())
        return pb.ReadLogitsReply(data=lg.data, dtype=lg.dtype, shape=lg.shape)


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
