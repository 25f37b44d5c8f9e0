"""`met.v1.GenerationService`: convert the request, hand it to the scheduler, stream its
events. Protobuf stops here."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import uuid

import grpc
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from control_plane.detok import Tokenizer
from control_plane.grammar import GrammarCompiler
from control_plane.scheduler.loop import Scheduler
from control_plane.scheduler.seq import (
    MTP,
    NONE,
    PROMPT_LOOKUP,
    Delta,
    Failure,
    Finish,
    GenRequest,
    SpecStats,
)
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.model import Capabilities, ModelError
from protos.telemetry import incoming_context, tracer

METHODS = {
    pb.SPECULATIVE_METHOD_NONE: NONE,
    pb.SPECULATIVE_METHOD_MTP: MTP,
    pb.SPECULATIVE_METHOD_PROMPT_LOOKUP: PROMPT_LOOKUP,
}
TRACER = tracer("met.control_plane")


class BadRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def to_request(
    r: pb.GenerateRequest,
    tokenizer: Tokenizer,
    caps: Capabilities,
    default_method: str,
    default_max_new: int,
    request_id: str,
    compiler: GrammarCompiler | None = None,
) -> GenRequest:
    """The wire request as the scheduler's `GenRequest`, or `BadRequest` with a sentence."""
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    if r.prompt and r.prompt_token_ids:
        raise BadRequest(invalid, "give either prompt or prompt_token_ids, not both")
    ids = list(r.prompt_token_ids) or tokenizer.encode(r.prompt)
    if not ids:
        raise BadRequest(invalid, "the prompt is empty")
    if bad := [t for t in ids if t >= caps.vocab_size]:
        raise BadRequest(
            invalid,
            f"prompt token id {bad[0]} is outside the vocabulary (0 .. {caps.vocab_size - 1})",
        )
    room = caps.max_context - len(ids)
    if room < 1:
        raise BadRequest(
            invalid,
            f"the prompt has {len(ids)} tokens; the context holds "
            f"{caps.max_context} with room for at least one more",
        )
    max_new = r.max_new_tokens if r.HasField("max_new_tokens") else min(default_max_new, room)
    if max_new == 0:
        raise BadRequest(invalid, "max_new_tokens is 0; ask for at least one token")
    if max_new > room:
        raise BadRequest(
            invalid,
            f"{len(ids)} prompt tokens and {max_new} new tokens exceed "
            f"the context of {caps.max_context}",
        )
    if r.speculative_method not in (pb.SPECULATIVE_METHOD_UNSPECIFIED, *METHODS):
        raise BadRequest(
            invalid,
            f"speculative_method {r.speculative_method} is unknown; use NONE, MTP or PROMPT_LOOKUP",
        )
    if r.temperature < 0 or not 0.0 <= r.top_p <= 1.0:
        raise BadRequest(invalid, "temperature must be at least 0 and top_p within [0, 1]")
    most = max(caps.slot_verify_drafts)
    if r.HasField("num_drafts") and r.num_drafts > most:
        raise BadRequest(
            invalid, f"num_drafts is {r.num_drafts}; the GPU service verifies at most {most} drafts"
        )
    grammar = None
    kind = r.response_format.WhichOneof("format") if r.HasField("response_format") else None
    if kind is not None:
        if compiler is None:
            raise BadRequest(grpc.StatusCode.UNIMPLEMENTED, "this server has no grammar engine")
        try:
            grammar = compiler.compile(kind, getattr(r.response_format, kind))
        except ValueError as e:
            raise BadRequest(invalid, f"response_format: {e}") from None
    return GenRequest(
        request_id=request_id,
        prompt_ids=tuple(ids),
        max_new_tokens=max_new,
        min_new_tokens=r.min_new_tokens,
        stop=tuple(r.stop),
        stop_token_ids=tuple(r.stop_token_ids),
        ignore_eos=r.ignore_eos,
        method=METHODS.get(r.speculative_method, default_method),
        num_drafts=r.num_drafts if r.HasField("num_drafts") else None,
        logprobs=r.logprobs,
        grammar=grammar,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        seed=r.seed if r.HasField("seed") else None,
    )


def stats_message(s: SpecStats) -> pb.SpeculativeStats:
    return pb.SpeculativeStats(
        steps=s.steps,
        verifies=s.verifies,
        drafted=s.drafted,
        accepted=s.accepted,
        mean_accepted_length=s.mean_accepted_length,
        grammar_truncations=s.grammar_truncations,
        acceptance_per_position=s.acceptance_at,
    )


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        default_method: str = MTP,
        default_max_new: int = 256,
    ) -> None:
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.default_method, self.default_max_new = default_method, default_max_new
        self._ids = itertools.count()
        self._compiler: GrammarCompiler | None = None

    async def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        gen = TRACER.start_span(
            "generate",
            context=incoming_context(context),
            kind=SpanKind.SERVER,
            attributes=_request_attributes(request, rid),
        )
        try:
            async for msg in self._generate(request, context, rid, gen):
                yield msg
        finally:
            gen.end()

    async def _generate(self, request, context, rid: str, gen: Span):
        key = f"{rid}#{next(self._ids)}"  # clients may reuse ids; the scheduler must not
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            caps = await loop.run_in_executor(None, self.scheduler.capabilities)
            gen.set_attribute("gen_ai.request.model", caps.model_name)
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    self.tokenizer, caps.vocab_size, caps.eos_token_ids
                )
            req = to_request(
                request,
                self.tokenizer,
                caps,
                self.default_method,
                self.default_max_new,
                key,
                self._compiler,
            )
        except BadRequest as e:
            _failed(gen, e.code.name, str(e))
            await context.abort(e.code, str(e))
        except grpc.RpcError as e:
            message = f"the GPU service is not reachable: {e.details()}"
            _failed(gen, "UNAVAILABLE", message)
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        req = dataclasses.replace(req, span_context=gen.get_span_context())
        events: asyncio.Queue = asyncio.Queue()
        try:
            self.scheduler.submit(req, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        except ModelError as e:
            _failed(gen, e.code, str(e))
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        done, first = False, None
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, Delta):
                    if first is None and ev.token_ids:
                        first = time.monotonic() - started
                        gen.set_attribute("met.time_to_first_token_s", first)
                    yield pb.GenerateResponse(
                        token_ids=ev.token_ids, text=ev.text, logprobs=ev.logprobs, request_id=rid
                    )
                elif isinstance(ev, Finish):
                    done = True
                    _finished(gen, ev)
                    yield pb.GenerateResponse(
                        finish_reason=ev.reason,
                        request_id=rid,
                        usage=pb.Usage(
                            prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens
                        ),
                        speculative_stats=stats_message(ev.stats),
                    )
                    return
                elif isinstance(ev, Failure):
                    done = True
                    _failed(gen, ev.code, ev.message)
                    await context.abort(getattr(grpc.StatusCode, ev.code), ev.message)
        finally:
            if not done:
                gen.set_attribute("gen_ai.response.finish_reasons", ["cancelled"])
                self.scheduler.cancel(key)

    async def GetStats(self, request, context):
        snap = self.scheduler.snapshot()
        c = snap["counters"]
        return pb.GetStatsReply(
            requests=c.requests,
            finished=c.finished,
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            steps=c.steps,
            speculative=stats_message(snap["spec"]),
            active=snap["active"],
            queued=snap["queued"],
            free_slots=snap["free_slots"],
            prompt_lookup_copies=c.copies,
            dcut_steps=c.dcut_steps,
            last_step_width=c.last_width,
        )


def _request_attributes(r: pb.GenerateRequest, rid: str) -> dict:
    """GenAI semantic-convention attributes, written out (the semconv package marks them
    moved)."""
    attrs = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.temperature": r.temperature,
        "met.request_id": rid,
    }
    if r.HasField("max_new_tokens"):
        attrs["gen_ai.request.max_tokens"] = r.max_new_tokens
    return attrs


def _finished(gen: Span, ev: Finish) -> None:
    s = ev.stats
    gen.set_attributes(
        {
            "gen_ai.usage.input_tokens": ev.prompt_tokens,
            "gen_ai.usage.output_tokens": ev.completion_tokens,
            "gen_ai.response.finish_reasons": [ev.reason],
            "met.spec.steps": s.steps,
            "met.spec.verifies": s.verifies,
            "met.spec.drafted": s.drafted,
            "met.spec.accepted": s.accepted,
            "met.spec.mean_accepted_length": s.mean_accepted_length,
        }
    )


def _failed(gen: Span, code: str, message: str) -> None:
    gen.set_attribute("gen_ai.response.finish_reasons", ["error"])
    gen.set_attribute("error.type", code)
    gen.set_status(Status(StatusCode.ERROR, message))
