"""The scheduler loop, on its own thread: admit, prefill, step, stream, retire.

`Scheduler` composes its parts, each given what it needs: the wait queue and admission
(`waitlist.py`), the connection to the service (`connection.py`), who goes on when the KV
pool is short (`triage.py`), the steps run ahead (`ahead.py`) and the prefix cache's glue
(`prefixing.py`). Requests come in through an inbox; events go out through each request's
sink. A refusal that concerns one request (a mask that allows no token, a grammar that
refuses its tokens) ends that request alone, with the refusal's status. A step that fails as
a whole ends every admitted request; when the service is lost (a transport error), the
waiting ones go to a router's other replicas where it has any, and the loop starts over on a
fresh connection.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import grpc
from opentelemetry.context import Context

from control_plane.scheduler import prefixing
from control_plane.scheduler.ahead import Pipeline
from control_plane.scheduler.connection import Connection
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.env import Env
from control_plane.scheduler.metrics import REPLICA_ATTRIBUTE, Metrics, ReplicaMetrics
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.prefill import prefill
from control_plane.scheduler.prefix_cache import PrefixCache
from control_plane.scheduler.seq import ActiveSeq, GenRequest, QueueSink, Sink
from control_plane.scheduler.status import step_status
from control_plane.scheduler.tally import Tally
from control_plane.scheduler.triage import PoolTriage
from control_plane.scheduler.waitlist import SLOT_POLL_S, Waitlist
from control_plane.text.detok import Tokenizer
from control_plane.text.tokenizer import Tokenization
from protos.model import Capabilities, ModelError, ServingModel
from protos.telemetry import tracer

log = logging.getLogger("control_plane.scheduler")
TRACER = tracer("met.control_plane")
# submit (with the tokenizer the prompt was tokenized with), cancel, wake
Payload = tuple[GenRequest, Sink, QueueSink | None, Tokenizer] | str | None
# A replica's connection, with its capabilities and tokenization: the tokenization to use,
# or the refusal it raises.
Joins = Callable[["Scheduler", Capabilities, Tokenization], Tokenization]
# How long the loop stays idle before it spends a prefill on a finished request's answer: the
# next request of a burst, or of a client that sends one as the last ends, comes sooner.
ANSWER_IDLE_S = 0.05
LOST = (grpc.RpcError, OSError)  # the service went away


class Scheduler:
    def __init__(
        self,
        connect: Callable[[], ServingModel],
        tokenizer: Tokenizer | Tokenization | None = None,
        opts: SchedulerOptions | None = None,
        env: Env | None = None,
        metrics: Metrics | None = None,
        replica: str = "local",
        joins: Joins | None = None,
    ) -> None:
        self.metrics = metrics  # the registry, which the server exports
        self.replica = replica  # the GPU service's name in labels, attributes and stats
        self.series: ReplicaMetrics | None = metrics.replica(replica) if metrics else None
        # Asked at each connection, with its tokenization: the one to use, or a refusal
        # (several replicas behind one router must serve one model).
        self.joins = joins
        # Set by a router: the requests still waiting for a slot when the service is lost go
        # to another replica; -> those it could not place, which fail here.
        self.handoff: Callable[[Scheduler, list[ActiveSeq]], list[ActiveSeq]] | None = None
        # A tokenizer given here overrides the one the service's checkpoint ships.
        if tokenizer is not None and not isinstance(tokenizer, Tokenization):
            tokenizer = Tokenization(tokenizer, {}, "the tokenizer given")
        # The environment is read once, here; its switches override the options by name.
        self.opts = (opts or SchedulerOptions()).with_env(env or Env.read())
        self._lock = threading.Lock()
        accept = (lambda caps, t: joins(self, caps, t)) if joins is not None else None
        self.link = Connection(connect, self.opts, replica, self._lock, tokenizer, accept)
        self.tally = Tally(self.series)
        self.queue = Waitlist(self.opts, self._lock, self.link, self.tally)
        self.pipeline = Pipeline(self.link.release_handle, self.tally.planned)
        self.triage = PoolTriage(self.opts, self.link, self.pipeline, self.queue, self.tally)
        self.inbox: queue.Queue[tuple[str, Payload]] = queue.Queue()
        self.prefilling: list[ActiveSeq] = []
        self.active: list[ActiveSeq] = []
        # id() of the requests sitting this iteration out (`pressure.PoolPlan.paused`), and
        # whether its calls may leave the pool no block to spare (`PoolTriage.sort`).
        self.paused: set[int] = set()
        self.pressed = False
        self._stop = threading.Event()
        # Set while the loop has nothing to do: no request and no answer waiting to be
        # snapshotted (`settle`).
        self._settled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    # The connection's state, as the fronts, the router and the tests read it.
    model = property(lambda self: self.link.model)
    ctx: StepContext | None = property(lambda self: self.link.ctx)  # type: ignore[assignment]
    free_slots = property(lambda self: self.link.free_slots)
    waiting = property(lambda self: self.queue.waiting)

    @property
    def prefix(self) -> PrefixCache | None:
        return self.link.prefix

    @prefix.setter
    def prefix(self, cache: PrefixCache | None) -> None:
        self.link.prefix = cache

    @property
    def tokenization(self) -> Tokenization | None:
        return self.link.tokenization

    @tokenization.setter
    def tokenization(self, t: Tokenization | None) -> None:
        self.link.tokenization = t

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer in use (the served model's unless overridden); known once connected."""
        if self.link.tokenization is None:
            raise RuntimeError("the scheduler has not connected to a GPU service yet")
        return self.link.tokenization.tokenizer

    # -- from other threads --------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("wake", None))
        self._thread.join(timeout=30)

    def capabilities(self) -> Capabilities:
        """The service's shape, connecting first if need be (raises when it is down)."""
        with self._lock:
            if self.link.ctx is None:
                self._connect()
            assert self.link.ctx is not None
            return self.link.ctx.caps

    def submit(
        self,
        req: GenRequest,
        sink: Sink,
        on_queued: QueueSink | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> str:
        """Queue the request; its events go to `sink`, and, when it cannot be admitted at
        once, `Queued` notices to `on_queued`. `tokenizer` is the one its prompt was
        tokenized with (default: the one in use, connecting first if need be); a request
        tokenized with one out of use by then is refused with UNAVAILABLE. -> the replica"""
        if tokenizer is None:
            if self.link.tokenization is None:
                self.capabilities()
            tokenizer = self.tokenizer
        self.queue.reserve()
        self._settled.clear()
        self.tally.submitted()
        self.inbox.put(("submit", (req, sink, on_queued, tokenizer)))
        return self.replica

    def cancel(self, request_id: str) -> None:
        self.inbox.put(("cancel", request_id))

    def settle(self, timeout: float) -> bool:
        """Wait until the loop has nothing to do, its background work done too (the answers
        the prefix cache snapshots once idle): what a client that reads an answer before it
        sends the next turn gives it. -> whether it settled within `timeout` seconds"""
        return self._settled.wait(timeout)

    def cached_tokens(self, prompt: tuple[int, ...]) -> int:
        """How many of the prompt's tokens this replica's prefix cache would restore (0 with
        none): what a router places by, from its own thread."""
        cache = self.link.prefix
        return cache.peek(prompt) if cache is not None else 0

    def load(self) -> tuple[int, int]:
        """(free slots, requests waiting for one): what a router places by."""
        with self._lock:
            return (self.link.free_slots if self.link.ctx else 0), self.queue.queued

    def snapshot(self) -> dict:
        counters, spec = self.tally.copy()
        blocks, blocks_free = self.link.kv_blocks()
        with self._lock:
            return {
                "kv_blocks": blocks,
                "kv_blocks_free": blocks_free,
                "counters": counters,
                "spec": spec,
                "active": self._holding(),
                "queued": self.queue.queued,
                "free_slots": self.link.free_slots if self.link.ctx else 0,
            }

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
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
            with self._lock:
                if not self.queue.queued:
                    self._settled.set()
            return 0.5
        return SLOT_POLL_S if self.link.model is not None and self.link.free_slots <= 0 else 0.0

    def _drain(self, wait: float) -> None:
        try:
            item = self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._take(*item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
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
            with self._lock:
                self._connect()
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
            self.queue.refuse_overdue(self._holding() > 0, ctx.caps.num_slots, now)
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
        with self._lock:
            self.series.running.set(self._holding())
            self.series.waiting.set(self.queue.queued)
            self.series.free_slots.set(self.link.free_slots)

    def _holding(self) -> int:
        """Requests holding a slot: finished ones whose slot a plan in flight still holds
        count until it is free."""
        return len(self.active) + len(self.prefilling) + len(self.pipeline.deferred)

    def _connect(self) -> None:
        """With the lock held: the requests waiting take the new connection's model facts,
        and those tokenized for another model are marked stale."""
        replaced = self.link.open()
        self.queue.reconnected(self.link.facts, replaced)

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
        if lost and (handoff := self.handoff) is not None:
            self.queue.hand_off(lambda waiting: handoff(self, waiting))
        if self.link.model is None:
            self.queue.fail_all(code, message)
        self.link.drop(failed)
