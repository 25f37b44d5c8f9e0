"""`met.v1.GenerationService`: convert the request, hand it to the scheduler, stream its
events. Protobuf stops here."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
import uuid
from collections.abc import Iterable

import grpc
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from control_plane.detok import Tokenizer
from control_plane.grammar import Grammar, GrammarCompiler
from control_plane.scheduler.loop import Scheduler
from control_plane.scheduler.seq import (
    MTP,
    NONE,
    PROMPT_LOOKUP,
    Delta,
    Event,
    Failure,
    Finish,
    GenRequest,
    Queued,
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
DEFAULT_METHOD = MTP  # for requests that leave the speculative method unspecified
DEFAULT_MAX_NEW_TOKENS = 256  # for requests that leave max_new_tokens unset
# UTF-8 bytes of a text prompt, checked before tokenizing: a tokenizer's ids and offsets take
# hundreds of bytes per token, so an unbounded prompt grows the process before it is refused.
DEFAULT_MAX_PROMPT_BYTES = 1 << 20


INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclasses.dataclass(frozen=True)
class Admission:
    """What the server fills in for a request that leaves it unset, and the bound it holds
    every text prompt to; `met control-plane serve` sets each from its flag."""

    default_method: str = DEFAULT_METHOD
    default_max_new: int = DEFAULT_MAX_NEW_TOKENS
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES


class BadRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def to_request(
    r: pb.GenerateRequest,
    tokenizer: Tokenizer,
    caps: Capabilities,
    admission: Admission,
    request_id: str,
    compiler: GrammarCompiler | None = None,
) -> GenRequest:
    """The wire request as the scheduler's `GenRequest`, or `BadRequest` with a sentence.
    The fields that need no tokenizer are checked first, the prompt's size before it is
    tokenized, and the grammar compiled last."""
    _check_method(r, caps)
    _check_sampling(r, caps)
    _check_vocab("stop_token_ids", r.stop_token_ids, caps)
    ids = _prompt_ids(r, tokenizer, caps, admission.max_prompt_bytes)
    max_new = _max_new_tokens(r, len(ids), caps, admission.default_max_new)
    if r.min_new_tokens > max_new:
        raise BadRequest(
            INVALID,
            f"min_new_tokens is {r.min_new_tokens}; it must not exceed max_new_tokens ({max_new})",
        )
    return GenRequest(
        request_id=request_id,
        prompt_ids=tuple(ids),
        max_new_tokens=max_new,
        min_new_tokens=r.min_new_tokens,
        stop=tuple(r.stop),
        stop_token_ids=tuple(r.stop_token_ids),
        ignore_eos=r.ignore_eos,
        method=METHODS.get(r.speculative_method, admission.default_method),
        num_drafts=r.num_drafts if r.HasField("num_drafts") else None,
        logprobs=r.logprobs,
        grammar=_grammar(r, compiler),
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p or 1.0,  # proto3 cannot tell an unset top_p from 0
        seed=r.seed if r.HasField("seed") else None,
    )


def _prompt_ids(
    r: pb.GenerateRequest, tokenizer: Tokenizer, caps: Capabilities, max_bytes: int
) -> list[int]:
    if r.prompt and r.prompt_token_ids:
        raise BadRequest(INVALID, "give either prompt or prompt_token_ids, not both")
    size = len(r.prompt.encode("utf-8"))
    if size > max_bytes:
        raise BadRequest(INVALID, f"prompt is {size} bytes; this server takes at most {max_bytes}")
    ids = list(r.prompt_token_ids) or tokenizer.encode(r.prompt)
    if not ids:
        raise BadRequest(INVALID, "the prompt is empty")
    _room(len(ids), caps)  # before the vocabulary scan: a context's worth at most
    _check_vocab("prompt_token_ids" if r.prompt_token_ids else "the tokenized prompt", ids, caps)
    return ids


def _room(prompt_len: int, caps: Capabilities) -> int:
    """Context positions left after the prompt, at least one."""
    room = caps.max_context - prompt_len
    if room < 1:
        raise BadRequest(
            INVALID,
            f"the prompt has {prompt_len} tokens; the context holds "
            f"{caps.max_context} with room for at least one more",
        )
    return room


def _check_vocab(field: str, ids: Iterable[int], caps: Capabilities) -> None:
    bad = next((t for t in ids if t >= caps.vocab_size), None)
    if bad is not None:
        raise BadRequest(
            INVALID,
            f"{field} holds token id {bad}, outside the vocabulary (0 .. {caps.vocab_size - 1})",
        )


def _max_new_tokens(
    r: pb.GenerateRequest, prompt_len: int, caps: Capabilities, default_max_new: int
) -> int:
    """The request's token budget: its own, or the server's default cut to the context."""
    room = _room(prompt_len, caps)
    max_new = r.max_new_tokens if r.HasField("max_new_tokens") else min(default_max_new, room)
    if max_new == 0:
        raise BadRequest(INVALID, "max_new_tokens is 0; ask for at least one token")
    if max_new > room:
        raise BadRequest(
            INVALID,
            f"max_new_tokens is {max_new}; after {prompt_len} prompt tokens "
            f"the context of {caps.max_context} has room for {room}",
        )
    return max_new


def _check_method(r: pb.GenerateRequest, caps: Capabilities) -> None:
    """The speculative method and the draft count."""
    if r.speculative_method not in (pb.SPECULATIVE_METHOD_UNSPECIFIED, *METHODS):
        raise BadRequest(
            INVALID,
            f"speculative_method {r.speculative_method} is unknown; use NONE, MTP or PROMPT_LOOKUP",
        )
    most = max(caps.slot_verify_drafts)
    if r.HasField("num_drafts") and not 1 <= r.num_drafts <= most:
        raise BadRequest(
            INVALID,
            f"num_drafts is {r.num_drafts}; it must be from 1 to {most}, the most drafts the "
            "GPU service verifies (leave it unset for the server's, or use NONE for no drafts)",
        )


def _check_sampling(r: pb.GenerateRequest, caps: Capabilities) -> None:
    """temperature, top_p and top_k: finite and in range (NaN fails every comparison, so each
    test is written as what must hold)."""
    if not (math.isfinite(r.temperature) and r.temperature >= 0):
        raise BadRequest(
            INVALID, f"temperature is {r.temperature}; it must be a finite number, 0 or above"
        )
    if not 0.0 <= r.top_p <= 1.0:
        raise BadRequest(
            INVALID, f"top_p is {r.top_p}; it must be above 0 and at most 1, or 0 for no cut"
        )
    if r.top_k > caps.vocab_size:
        raise BadRequest(
            INVALID,
            f"top_k is {r.top_k}; it must be at most the vocabulary size {caps.vocab_size} "
            "(0: no limit)",
        )


def _grammar(r: pb.GenerateRequest, compiler: GrammarCompiler | None) -> Grammar | None:
    """The compiled `response_format`, or None when the request has none."""
    kind = r.response_format.WhichOneof("format") if r.HasField("response_format") else None
    if kind is None:
        return None
    if compiler is None:
        raise BadRequest(grpc.StatusCode.UNIMPLEMENTED, "this server has no grammar engine")
    try:
        return compiler.compile(kind, getattr(r.response_format, kind))
    except ValueError as e:
        raise BadRequest(INVALID, f"response_format: {e}") from None


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


def finish_message(ev: Finish, rid: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        finish_reason=ev.reason,
        request_id=rid,
        usage=pb.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens),
        speculative_stats=stats_message(ev.stats),
    )


def queued_message(ev: Queued, rid: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        queued=pb.Queued(position=ev.position, queue_length=ev.queue_length), request_id=rid
    )


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        admission: Admission = Admission(),
    ) -> None:
        self.scheduler, self.tokenizer, self.admission = scheduler, tokenizer, admission
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
        started = time.monotonic()
        # Headers now, not with the first message: a client sees the call is taken even
        # while it waits for a slot.
        await context.send_initial_metadata(())
        req = await self._convert(request, context, key, gen)
        events = await self._submit(req, context, gen)
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
                elif isinstance(ev, Queued):
                    yield queued_message(ev, rid)
                elif isinstance(ev, Finish):
                    done = True
                    _finished(gen, ev)
                    yield finish_message(ev, rid)
                    return
                elif isinstance(ev, Failure):
                    done = True
                    _failed(gen, ev.code, ev.message)
                    await context.abort(getattr(grpc.StatusCode, ev.code), ev.message)
        finally:
            if not done:
                gen.set_attribute("gen_ai.response.finish_reasons", ["cancelled"])
                self.scheduler.cancel(key)

    async def _convert(self, request, context, key: str, gen: Span) -> GenRequest:
        """The request as the scheduler's, linked to its span; a bad one, or a service out of
        reach, aborts the call with its status."""
        loop = asyncio.get_running_loop()
        try:
            caps = await loop.run_in_executor(None, self.scheduler.capabilities)
            gen.set_attribute("gen_ai.request.model", caps.model_name)
            compiler = self._grammar_compiler(request, caps)
            req = to_request(request, self.tokenizer, caps, self.admission, key, compiler)
        except BadRequest as e:
            _failed(gen, e.code.name, str(e))
            await context.abort(e.code, str(e))
        except grpc.RpcError as e:
            message = f"the GPU service is not reachable: {e.details()}"
            _failed(gen, "UNAVAILABLE", message)
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        return dataclasses.replace(req, span_context=gen.get_span_context())

    def _grammar_compiler(
        self, request: pb.GenerateRequest, caps: Capabilities
    ) -> GrammarCompiler | None:
        """The grammar engine, built by the first request that carries a `response_format`;
        requests without one never touch it."""
        if self._compiler is None and request.HasField("response_format"):
            self._compiler = GrammarCompiler(self.tokenizer, caps.vocab_size, caps.eos_token_ids)
        return self._compiler

    async def _submit(self, req: GenRequest, context, gen: Span) -> asyncio.Queue:
        """Hand the request to the scheduler; its events and `Queued` notices arrive on the
        returned queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(ev: Event | Queued) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            self.scheduler.submit(req, sink, sink)
        except ModelError as e:
            _failed(gen, e.code, str(e))
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        return events

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
