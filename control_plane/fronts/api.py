"""`met.v1.GenerationService`: each request through the `Door`, its events streamed back as
messages."""

from __future__ import annotations

import itertools
import time
import uuid

import grpc
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from control_plane.admission.door import Admission, BadRequest, Door
from control_plane.replicas.router import Drives
from control_plane.scheduler.seq import Delta, Failure, Finish, PromptScores, Queued, SpecStats
from protos.convert import scores_fields, tops_to_pb
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.params import RequestParams, from_pb
from protos.telemetry import incoming_context, tracer

TRACER = tracer("met.control_plane")


def prompt_message(scores: PromptScores | None) -> pb.PromptLogprobs | None:
    """A prompt's scores as the API carries them (None: not asked, or sent already)."""
    return None if scores is None else pb.PromptLogprobs(**scores_fields(scores))


def stats_message(s: SpecStats) -> pb.SpeculativeStats:
    return pb.SpeculativeStats(
        steps=s.steps,
        verifies=s.verifies,
        drafted=s.drafted,
        accepted=s.accepted,
        mean_accepted_length=s.mean_accepted_length,
        grammar_truncations=s.grammar_truncations,
        acceptance_per_position=s.acceptance_at,
        by_method=[
            pb.MethodStats(method=name, verifies=c.verifies, drafted=c.drafted, accepted=c.accepted)
            for name, c in sorted(s.by_method.items())
        ],
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
    def __init__(self, scheduler: Drives, admission: Admission | None = None) -> None:
        self.scheduler = scheduler
        self.door = Door(scheduler, admission or Admission())
        self._ids = itertools.count()

    async def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        gen = TRACER.start_span(
            "generate",
            context=incoming_context(context),
            kind=SpanKind.SERVER,
            attributes={"met.request_id": rid},
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
        try:
            params = self._params(request, gen, rid)
            events = (await self.door.enter(params, key, gen)).events
        except BadRequest as e:
            failed(gen, e.code.name, str(e))
            await context.abort(e.code, str(e))
        done, first = False, None
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, Delta):
                    top = tops_to_pb(ev.top_ids, ev.top_logprobs)
                    if first is None and ev.token_ids:
                        first = time.monotonic() - started
                        gen.set_attribute("met.time_to_first_token_s", first)
                    yield pb.GenerateResponse(
                        token_ids=ev.token_ids,
                        text=ev.text,
                        logprobs=ev.logprobs,
                        request_id=rid,
                        prompt_logprobs=prompt_message(ev.prompt),
                        top_ids=top["top_ids"],
                        top_logprobs=top["top_logprobs"],
                    )
                elif isinstance(ev, Queued):
                    yield queued_message(ev, rid)
                elif isinstance(ev, Finish):
                    done = True
                    finished(gen, ev)
                    last = finish_message(ev, rid)
                    if ev.prompt is not None:
                        last.prompt_logprobs.CopyFrom(prompt_message(ev.prompt))
                    yield last
                    return
                elif isinstance(ev, Failure):
                    done = True
                    failed(gen, ev.code, ev.message)
                    await context.abort(getattr(grpc.StatusCode, ev.code), ev.message)
        finally:
            if not done:
                gen.set_attribute("gen_ai.response.finish_reasons", ["cancelled"])
                self.door.leave(key)

    @staticmethod
    def _params(request: pb.GenerateRequest, gen: Span, rid: str) -> RequestParams:
        """The wire request as the Door's parameters, the span told what was asked."""
        try:
            params = from_pb(request)
        except ValueError as e:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        gen.set_attributes(request_attributes(params, rid))
        return params

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
            replicas=[replica_stats(r) for r in snap.get("replicas", ())],
            **_pool_stats(snap),
        )


def _pool_stats(snap: dict) -> dict:
    """The KV pool and prefix cache figures of a scheduler's (or the router's) snapshot."""
    c = snap["counters"]
    return {
        "kv_blocks": snap["kv_blocks"],
        "kv_blocks_free": snap["kv_blocks_free"],
        "prefix_cache_queries": c.prefix_queries,
        "prefix_cache_hits": c.prefix_hits,
        "preemptions": c.preemptions,
    }


def replica_stats(r: dict) -> pb.ReplicaStats:
    """One replica's line of `GetStats`, from the router's snapshot."""
    c = r["counters"]
    return pb.ReplicaStats(
        replica=r["replica"],
        up=r["up"],
        requests=c.requests,
        finished=c.finished,
        completion_tokens=c.completion_tokens,
        steps=c.steps,
        active=r["active"],
        queued=r["queued"],
        free_slots=r["free_slots"],
        **_pool_stats(r),
    )


def request_attributes(r: RequestParams, rid: str) -> dict:
    """GenAI semantic-convention attributes, written out (the semconv package marks them
    moved)."""
    attrs = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.temperature": r.sampling.temperature,
        "met.request_id": rid,
    }
    if r.max_new_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = r.max_new_tokens
    for name in ("presence_penalty", "frequency_penalty"):
        if value := getattr(r.sampling, name):
            attrs[f"gen_ai.request.{name}"] = value
    return attrs


def finished(gen: Span, ev: Finish) -> None:
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


def failed(gen: Span, code: str, message: str) -> None:
    gen.set_attribute("gen_ai.response.finish_reasons", ["error"])
    gen.set_attribute("error.type", code)
    gen.set_status(Status(StatusCode.ERROR, message))
