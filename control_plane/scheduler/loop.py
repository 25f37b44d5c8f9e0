"""The scheduler loop, on its own thread: admit, prefill, step, stream, retire.

`Loop` runs the parts `Scheduler` (`scheduler.py`) composes, each given what it needs: the wait
queue and admission (`waitlist.py`), the connection to the service (`connection.py`), who goes
on when the KV pool is short (`triage.py`), the steps run ahead (`ahead.py`) and the prefix
cache's glue (`prefixing.py`). Requests come in through an inbox; events go out through each
request's sink. A refusal that concerns one request (a mask that allows no token, a grammar
that refuses its tokens) ends that request alone, with the refusal's status. A step that fails
as a whole ends every admitted request; when the service is lost (a transport error), the
waiting ones go to a router's other replicas where it has any, and the loop starts over on a
fresh connection.
"""

from __future__ import annotations

import logging
import queue as queue_module
import threading
import time
from typing import Any

import grpc
from opentelemetry.context import Context

from control_plane.scheduler import prefixing
from control_plane.scheduler.ahead import Pipeline
from control_plane.scheduler.connection import Connection
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.metrics import REPLICA_ATTRIBUTE
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.prefill import prefill
from control_plane.scheduler.seq import ActiveSeq, GenRequest, QueueSink, Sink
from control_plane.scheduler.status import step_status
from control_plane.scheduler.tally import Tally
from control_plane.scheduler.triage import PoolTriage
from control_plane.scheduler.waitlist import SLOT_POLL_S, Waitlist
from control_plane.text.detok import Tokenizer
from protos.model import ModelError, ServingModel
from protos.telemetry import tracer

log = logging.getLogger("control_plane.scheduler")
TRACER = tracer("met.control_plane")
# submit (with the tokenizer the prompt was tokenized with), cancel, wake
Payload = tuple[GenRequest, Sink, QueueSink | None, Tokenizer] | str | None
# How long the loop stays idle before it spends a prefill on a finished request's answer: the
# next request of a burst, or of a client that sends one as the last ends, comes sooner.
ANSWER_IDLE_S = 0.05
LOST = (grpc.RpcError, OSError)  # the service went away


class Loop:
    """The loop's thread and what it admitted: the requests prefilling and active, those
    sitting an iteration out. `owner` is the scheduler whose router hand-off it calls."""

    def __init__(
        self,
        owner: Any,
        opts: SchedulerOptions,
        link: Connection,
        queue: Waitlist,
        pipeline: Pipeline,
        triage: PoolTriage,
        tally: Tally,
        lock: threading.Lock,
    ) -> None:
        self.owner, self.opts, self.link, self.queue = owner, opts, link, queue
        self.pipeline, self.triage, self.tally, self.lock = pipeline, triage, tally, lock
        self.replica, self.series = owner.replica, owner.series
        self.inbox: queue_module.Queue[tuple[str, Payload]] = queue_module.Queue()
        self.prefilling: list[ActiveSeq] = []
        self.active: list[ActiveSeq] = []
        # id() of the requests sitting this iteration out (`pressure.PoolPlan.paused`), and
        # whether its calls may leave the pool no block to spare (`PoolTriage.sort`).
        self.paused: set[int] = set()
        self.pressed = False
        self.stopping = threading.Event()
        # Set while the loop has nothing to do: no request and no answer waiting to be
        # snapshotted (`Scheduler.settle`).
        self.settled = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._drain(self._idle())
                self._iterate()
            except Exception as e:  # a bug must fail its requests, not stop the loop
                if not isinstance(e, (*LOST, ModelError)):
                    log.exception("the scheduler step failed")
                self._reset(e)
            # After every iteration, the idle ones too: the last frees may come with a drain.
            self._gauges()
        try:
            self.pipeline.drain(self.link.ctx)  # stopping: the frees that wait on flights
            self.link.drop_snapshots()
        except (*LOST, ModelError) as e:
            log.warning("stopping with plans in flight: %s", step_status(e)[1])
        self.pipeline.close()

    def _idle(self) -> float:
        """How long the loop may wait for news: none with work to do; a poll's interval with
        requests waiting on slots held elsewhere. With nothing at all to do, it is settled."""
        if self.prefilling or self.active or self.pipeline.flights:
            return 0.0
        if not self.queue.waiting:
            if self.link.prefix is not None and self.link.prefix.answers:
                return ANSWER_IDLE_S  # then, with no news, an answer waiting for its snapshot
            with self.lock:
                if not self.queue.queued:
                    self.settled.set()
            return 0.5
        return SLOT_POLL_S if self.link.model is not None and self.link.free_slots <= 0 else 0.0

    def _drain(self, wait: float) -> None:
        try:
            item = self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait()
        except queue_module.Empty:
            return
        while True:
            self._take(*item)
            try:
                item = self.inbox.get_nowait()
            except queue_module.Empty:
                return

    def _take(self, kind: str, payload: Payload) -> None:
        if kind == "submit":
            assert isinstance(payload, tuple)
            req, sink, on_queued, tokenizer = payload
            stop = self.opts.draft_confidence_stop
            a = ActiveSeq(req, sink, tokenizer, self.link.facts, self.series, stop, on_queued)
            self.queue.put(a, tokenizer)
        elif kind == "cancel":
            self.queue.cancel(str(payload))
            for a in [*self.prefilling, *self.active]:
                if a.req.request_id == payload:
                    a.finished = "cancelled"
            self._retire()

    def _iterate(self) -> None:
        if self.link.model is None:
            if not self.queue.waiting:
                return
            with self.lock:
                self.connect()
        self.queue.drop_stale()
        model, ctx = self.link.model, self.link.ctx
        assert model is not None and ctx is not None
        if not self.active and self.pipeline.flights:
            self.pipeline.drain(ctx)  # what is still in flight, and the frees it holds
        if not (self.queue.waiting or self.prefilling or self.active):
            # Not with news unread: requests may have come while a flight was drained.
            if self.link.prefix and self.link.prefix.answers and self.inbox.empty():
                budget = ctx.caps.max_prefill_tokens
                prefixing.answer(model, self.link.prefix, budget, self.replica)
            return
        # Each iteration is a trace of its own; requests reach it through span links.
        attrs = {REPLICA_ATTRIBUTE: self.replica}
        with TRACER.start_as_current_span(
            "scheduler_iteration", context=Context(), attributes=attrs
        ):
            now = time.monotonic()
            self.queue.admit(self.prefilling, bool(self.paused), now)
            for a in self.prefilling:  # vLLM's SCHEDULED: the first admission, not a return
                a.scheduled = a.scheduled or now
            self.queue.refuse_overdue(self.holding() > 0, ctx.caps.num_slots, now)
            self.queue.tell_places()
            self.paused, self.pressed = self.triage.sort(self.prefilling, self.active, self._retire)
            self._prefill(model, ctx)
            self._retire()
            stepping = [a for a in self.active if id(a) not in self.paused]
            if stepping:
                joining = bool(self.queue.waiting or self.prefilling)
                self.pipeline.step(model, stepping, ctx, joining, self.tally.stepped)
                self._retire()

    def _gauges(self) -> None:
        if self.series is None or self.link.ctx is None:
            return
        with self.lock:
            self.series.running.set(self.holding())
            self.series.waiting.set(self.queue.queued)
            self.series.free_slots.set(self.link.free_slots)

    def holding(self) -> int:
        """Requests holding a slot: finished ones whose slot a plan in flight still holds
        count until it is free."""
        return len(self.active) + len(self.prefilling) + len(self.pipeline.deferred)

    def connect(self) -> None:
        """With the lock held: the requests waiting take the new connection's model facts,
        and those tokenized for another model are marked stale."""
        replaced = self.link.open()
        self.queue.reconnected(self.link.facts, replaced)
        if self.series is not None and self.link.ctx is not None:
            caps = self.link.ctx.caps
            self.series.connected(caps.model_name, caps.max_context)

    def _prefill(self, model: ServingModel, ctx: StepContext) -> None:
        """One batched prefill call; the sequences whose prompt is in now become active."""
        caps, cache = ctx.caps, self.link.prefix
        going = [a for a in self.prefilling if id(a) not in self.paused]
        block = caps.kv_block_size or 1
        done = prefill(model, going, self.opts.prefill_chunk, caps.max_prefill_tokens, block)
        if cache is not None and self.pressed:  # a snapshot takes a block
            prefixing.forgo(self.prefilling)
        elif cache is not None:
            prefixing.snapshot(model, cache, [*self.prefilling])
        for a in done:
            self.prefilling.remove(a)
            self.active.append(a)

    def _retire(self) -> None:
        for group in (self.prefilling, self.active):
            for a in [a for a in group if a.finished is not None]:
                self.pipeline.free(a)  # before it leaves the list: a snapshot sees it free first
                group.remove(a)
                if a.failure is None:
                    self.tally.finished(a)
                    if self.link.prefix is not None:
                        prefixing.remember(self.link.prefix, a)
                a.finish(a.finished or "stop")

    def _reset(self, error: Exception) -> None:
        """A step failed as a whole: every admitted request fails with the error's status.
        While the service is there, their sequences are freed and the loop carries on; when
        it went away (or never came), the waiting go to a router's other replicas, those
        still here fail when there was no connection, and the connection is dropped."""
        code, message = step_status(error)
        self.pipeline.close()  # what was in flight is lost with the step
        failed, self.prefilling, self.active = [*self.prefilling, *self.active], [], []
        log.error("%s; failing %d requests", message, len(failed))
        for a in failed:
            a.fail(code, message)
        lost = isinstance(error, LOST)
        if not lost and self.link.model is not None:
            for a in failed:
                self.pipeline.free(a)
            return
        if lost and (handoff := self.owner.handoff) is not None:
            self.queue.hand_off(lambda waiting: handoff(self.owner, waiting))
        if self.link.model is None:
            self.queue.fail_all(code, message)
        self.link.drop(failed)
