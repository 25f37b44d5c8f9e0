"""The scheduler loop, on its own thread: admit, prefill, step, stream, retire.

Requests come in through a queue (bounded: past `max_queue` waiting, `ResourceExhausted`; and
past `slot_wait` seconds waiting while other sessions hold every slot, `slot_wait.py`);
events go out through each request's sink, and, to those that ask, `Queued` notices while
they wait for a slot. A refusal that concerns one request (a mask that allows no token, a
grammar that refuses its tokens) ends that request alone, with the refusal's status. A lost
service (a transport error) ends every admitted request; the loop asks the service what it
still holds, frees those sequences and starts over with a fresh connection. Free slots are
the service's count (`Capabilities.free_slots`), kept in step with this loop's own allocs
and frees: slots may be held by others. The tokenizer is the served checkpoint's unless one
is given; a connection that finds another model's reloads it and refuses the requests still
waiting (tokenized for the old model) with UNAVAILABLE.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import grpc
from opentelemetry.context import Context

from control_plane.scheduler import prefixing
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.cost_model import measured_table
from control_plane.scheduler.env import Env
from control_plane.scheduler.metrics import REPLICA_ATTRIBUTE, Metrics, ReplicaMetrics
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.pipeline import Pipeline
from control_plane.scheduler.prefill import prefill
from control_plane.scheduler.prefix_cache import PrefixCache, prefix_cache
from control_plane.scheduler.room import Room
from control_plane.scheduler.seq import ActiveSeq, GenRequest, QueueSink, Sink
from control_plane.scheduler.served import refuse_stale, replaces, served_by
from control_plane.scheduler.slot_wait import SlotWait
from control_plane.scheduler.status import step_status
from control_plane.scheduler.tally import Tally
from control_plane.text.detok import Tokenizer
from control_plane.text.tokenizer import Tokenization
from protos.model import Capabilities, ModelError, ResourceExhausted, ServingModel
from protos.telemetry import tracer

log = logging.getLogger("control_plane.scheduler")
TRACER = tracer("met.control_plane")
# submit (with the tokenizer the prompt was tokenized with), cancel, wake
Payload = tuple[GenRequest, Sink, QueueSink | None, Tokenizer] | str | None
# A replica's connection, with its capabilities and tokenization: the tokenization to use,
# or the refusal it raises.
Joins = Callable[["Scheduler", Capabilities, Tokenization], Tokenization]
SLOT_POLL_S = 0.05  # with requests waiting and no free slot, how often to ask the service
# How long the loop stays idle before it spends a prefill on a finished request's answer: the
# next request of a burst, or of a client that sends one as the last ends, comes sooner.
ANSWER_IDLE_S = 0.05


class Scheduler(Room):
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
        series = metrics.replica(replica) if metrics is not None else None
        self.series: ReplicaMetrics | None = series
        # Asked at each connection, with its tokenization: the one to use, or a refusal
        # (several replicas behind one router must serve one model).
        self.joins = joins
        # Set by a router: the requests still waiting for a slot when the service is lost go
        # to another replica; -> those it could not place, which fail here.
        self.handoff: Callable[[Scheduler, list[ActiveSeq]], list[ActiveSeq]] | None = None
        self.connect = connect
        # A tokenizer given here overrides the one the service's checkpoint ships.
        if tokenizer is None or isinstance(tokenizer, Tokenization):
            self.override = tokenizer
        else:
            self.override = Tokenization(tokenizer, {}, "the tokenizer given")
        self.tokenization: Tokenization | None = self.override
        # Waiting when the served model changed: tokenized for the old one, to be refused.
        self._stale: list[ActiveSeq] = []
        # The environment is read once, here; its switches override the options by name.
        self.opts = (opts or SchedulerOptions()).with_env(env or Env.read())
        self.slot_wait = SlotWait(self.opts.slot_wait)
        self.model: ServingModel | None = None
        self.ctx: StepContext | None = None
        # The prefix cache's names of the snapshots this connection's session holds.
        self.prefix: PrefixCache | None = None
        self.tally = Tally(series)
        self.pipeline = Pipeline(self._release_handle, self.tally.planned)
        self.inbox: queue.Queue[tuple[str, Payload]] = queue.Queue()
        self.waiting: deque[ActiveSeq] = deque()
        self.prefilling: list[ActiveSeq] = []
        self.active: list[ActiveSeq] = []
        self.paused: set[int] = set()
        self.pressed = False
        self.free_slots = 0  # the service's free slots, as of its last word and our calls
        self._poll_at = 0.0  # when the service may next be asked for free slots
        self._queued = 0  # submitted and not yet admitted, across threads
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Set while the loop has nothing to do: no request and no answer waiting to be
        # snapshotted (`settle`).
        self._settled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer in use (the served model's unless overridden); known once connected."""
        if self.tokenization is None:
            raise RuntimeError("the scheduler has not connected to a GPU service yet")
        return self.tokenization.tokenizer

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
            if self.ctx is None:
                self._connect()
            assert self.ctx is not None
            return self.ctx.caps

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
        tokenized with one no longer in use is refused with UNAVAILABLE. -> the replica"""
        if tokenizer is None:
            if self.tokenization is None:
                self.capabilities()
            tokenizer = self.tokenizer
        with self._lock:
            if self._queued >= self.opts.max_queue:
                raise ResourceExhausted(
                    f"{self._queued} requests are already waiting for a slot (the bound is "
                    f"{self.opts.max_queue}); retry later"
                )
            self._queued += 1
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
        cache = self.prefix
        return cache.peek(prompt) if cache is not None else 0

    def load(self) -> tuple[int, int]:
        """(free slots, requests waiting for one): what a router places by."""
        with self._lock:
            return (self.free_slots if self.ctx else 0), self._queued

    def snapshot(self) -> dict:
        counters, spec = self.tally.copy()
        blocks, blocks_free = self._kv_blocks()
        with self._lock:
            free = self.free_slots if self.ctx else 0
            return {
                "kv_blocks": blocks,
                "kv_blocks_free": blocks_free,
                "counters": counters,
                "spec": spec,
                "active": self._holding(),
                "queued": self._queued,
                "free_slots": free,
            }

    def _kv_blocks(self) -> tuple[int, int]:
        """The service's KV pool: its blocks and those free now (asked; 0, 0 when it cannot
        be, or before a connection)."""
        model = self.model
        if model is None:
            return 0, 0
        try:
            caps = model.capabilities()
        except (grpc.RpcError, ModelError, OSError):
            return 0, 0
        return caps.kv_blocks, caps.kv_blocks_free

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(self._idle())
                self._iterate()
            except Exception as e:  # a bug must fail its requests, not stop the loop
                if not isinstance(e, (grpc.RpcError, ModelError, OSError)):
                    log.exception("the scheduler step failed")
                self._reset(e)
            # After every iteration, the idle ones too: the last frees may come with a drain.
            self._gauges()
        try:
            self.pipeline.drain(self.ctx)  # stopping: the frees that wait on flights
            if self.prefix is not None and self.model is not None:
                # Over gRPC the session's end would drop them; in process nothing else does.
                prefixing.drop(self.model, self.prefix.clear())
        except (grpc.RpcError, ModelError, OSError) as e:
            log.warning("stopping with plans in flight: %s", step_status(e)[1])
        self.pipeline.close()

    def _idle(self) -> float:
        """How long the loop may wait for news: none with work to do; a poll's interval with
        requests waiting on slots held elsewhere. With nothing at all to do, it is settled."""
        if self.prefilling or self.active or self.pipeline.flights:
            return 0.0
        if not self.waiting:
            if self.prefix is not None and self.prefix.answers:
                return ANSWER_IDLE_S  # then, with no news, an answer waiting for its snapshot
            with self._lock:
                if not self._queued:
                    self._settled.set()
            return 0.5
        return SLOT_POLL_S if self.model is not None and self.free_slots <= 0 else 0.0

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
            max_context = self.ctx.caps.max_context if self.ctx else 1 << 30
            eos = self.ctx.caps.eos_token_ids if self.ctx else ()
            a = ActiveSeq(req, sink, tokenizer, eos, max_context)
            a.vocab_size = self.ctx.caps.vocab_size if self.ctx else 0
            a.drafter = self.ctx.caps.has_mtp if self.ctx else True
            a.observer = self.series
            a.draft_stop = self.opts.draft_confidence_stop
            a.on_queued = on_queued
            self._enqueue(a, tokenizer)
        elif kind == "cancel":
            self._cancel(str(payload))

    def _enqueue(self, a: ActiveSeq, tokenizer: Tokenizer) -> None:
        """The request waits, unless the tokenizer it was tokenized with went out of use
        before it got here."""
        with self._lock:  # a connect on another thread may change the tokenizer meanwhile
            stale = self.tokenization is not None and tokenizer is not self.tokenizer
            if not stale:
                self.waiting.append(a)
        if stale:
            self._refuse_stale([a])

    def _drop_stale(self) -> None:
        """Waiting requests tokenized for the model the service served before are refused."""
        with self._lock:
            marked, self._stale = set(self._stale), []
            stale = [a for a in self.waiting if a in marked]
            self.waiting = deque(a for a in self.waiting if a not in marked)
        self._refuse_stale(stale)

    def _refuse_stale(self, stale: list[ActiveSeq]) -> None:
        assert self.tokenization is not None
        refuse_stale(stale, self.tokenization)
        self._dequeued(len(stale))

    def _cancel(self, request_id: str) -> None:
        for a in list(self.waiting):
            if a.req.request_id == request_id:
                self.waiting.remove(a)
                self._dequeued(1)
                a.finish("cancelled")
        for group in (self.prefilling, self.active):
            for a in list(group):
                if a.req.request_id == request_id:
                    a.finished = "cancelled"
        self._retire()

    def _iterate(self) -> None:
        if self.model is None:
            if not self.waiting:
                return
            with self._lock:
                self._connect()
        if self._stale:
            self._drop_stale()
        if not self.active and self.pipeline.flights:
            self.pipeline.drain(self.ctx)  # what is still in flight, and the frees it holds
        if not (self.waiting or self.prefilling or self.active):
            # Not with news unread: requests may have come while a flight was drained.
            if self.prefix and self.prefix.answers and self.ctx and self.inbox.empty():
                assert self.model is not None
                budget = self.ctx.caps.max_prefill_tokens
                prefixing.answer(self.model, self.prefix, budget, self.replica)
            return
        # Each iteration is a trace of its own; requests reach it through span links.
        attrs = {REPLICA_ATTRIBUTE: self.replica}
        with TRACER.start_as_current_span(
            "scheduler_iteration", context=Context(), attributes=attrs
        ):
            self._admit()
            self._tell_places()
            self._make_room()
            self._prefill()
            self._retire()
            stepping = [a for a in self.active if id(a) not in self.paused]
            if stepping:
                assert self.model is not None and self.ctx is not None
                joining = bool(self.waiting or self.prefilling)
                self.pipeline.step(self.model, stepping, self.ctx, joining, self.tally.stepped)
                self._retire()

    def _gauges(self) -> None:
        if self.series is None or self.ctx is None:
            return
        with self._lock:
            self.series.running.set(self._holding())
            self.series.waiting.set(self._queued)
            self.series.free_slots.set(self.free_slots)

    def _holding(self) -> int:
        """Requests holding a slot: finished ones whose slot a plan in flight still holds
        count until it is free."""
        return len(self.active) + len(self.prefilling) + len(self.pipeline.deferred)

    def _connect(self) -> None:
        model = self.connect()
        try:
            caps = model.capabilities()
            served = self.override if self.override is not None else served_by(model, caps)
            if self.joins is not None:
                served = self.joins(self, caps, served)
            costs = measured_table(model, caps, self.opts)
            ctx = StepContext.build(caps, self.opts, costs, self.replica)
        except BaseException:
            getattr(model, "close", lambda: None)()  # the service would keep its session open
            raise
        self._use(served)
        self.ctx, self.model = ctx, model
        self.prefix = prefix_cache(self.opts, caps)
        self.free_slots = caps.free_slots  # others (or a past connection) may hold slots
        for a in self.waiting:
            a.max_context = caps.max_context
            a.vocab_size = caps.vocab_size
            a.drafter = caps.has_mtp
            a.set_eos(() if a.req.ignore_eos else caps.eos_token_ids)

    def _use(self, new: Tokenization) -> None:
        """The connection's tokenizer; another model's means the requests waiting were
        tokenized for the old one."""
        if replaces(self.tokenization, new):
            self._stale.extend(self.waiting)
        self.tokenization = new

    def _admit(self) -> None:
        """Waiting requests take free slots in order, but for one that shares uncached
        prompt blocks with a request ahead of it: it waits for that one's snapshot
        (`prefixing.held`). One the service cannot place (its slots are held elsewhere) stays
        until a slot frees or the service reports one free."""
        assert self.model is not None
        now = time.monotonic()
        if self.waiting and self.free_slots <= 0 and now >= self._poll_at:
            self._poll_at = now + SLOT_POLL_S
            self.free_slots = self.model.capabilities().free_slots
        admitted: list[ActiveSeq] = []
        for a in list(self.waiting):
            if self.free_slots <= 0 or self.paused:  # a full pool: `pressure.py`
                break
            ahead = [*self.prefilling, *admitted]
            if self.prefix is not None and prefixing.held(self.prefix, a, ahead):
                continue
            try:
                a.handle = self.model.alloc_sequence(a.req.penalties)
            except ResourceExhausted:
                self.free_slots, self._poll_at = 0, now + SLOT_POLL_S
                break
            except ModelError as e:
                a.handle = None
                a.refuse(e.code, str(e))
            if a.handle is not None:
                # Counted as placed before it leaves the queue: a snapshot from another
                # thread never sees it in neither list while its slot is taken.
                self.free_slots -= 1
                self.prefilling.append(a)
                admitted.append(a)
            self.waiting.remove(a)
            self._dequeued(1)
            if a.handle is None:
                a.finish("error")
        if admitted and self.prefix is not None:
            prefixing.restore(self.model, self.prefix, admitted, self.tally)
        self._refuse_overdue(now)

    def _refuse_overdue(self, now: float) -> None:
        """Requests that waited `slot_wait` for a slot while others held them all."""
        assert self.ctx is not None
        holding = bool(self.prefilling or self.active or self.pipeline.deferred)
        for a in self.slot_wait.overdue(self.waiting, holding, self.free_slots, now):
            self.waiting.remove(a)
            self._dequeued(1)
            a.refuse(ResourceExhausted.code, self.slot_wait.sentence(self.ctx.caps.num_slots))
            a.finish("error")

    def _tell_places(self) -> None:
        """Each request still waiting after admission hears where it stands."""
        now = time.monotonic()
        for position, a in enumerate(self.waiting, start=1):
            a.tell_place(position, len(self.waiting), now)

    def _prefill(self) -> None:
        """One batched prefill call; the sequences whose prompt is in now become active."""
        assert self.model is not None and self.ctx is not None
        caps = self.ctx.caps
        block = caps.kv_block_size or 1
        going = [a for a in self.prefilling if id(a) not in self.paused]
        done = prefill(self.model, going, self.opts.prefill_chunk, caps.max_prefill_tokens, block)
        if self.prefix is not None and self.pressed:  # a snapshot takes a block
            prefixing.forgo(self.prefilling)
        elif self.prefix is not None:
            prefixing.snapshot(self.model, self.prefix, [*self.prefilling])
        for a in done:
            self.prefilling.remove(a)
            self.active.append(a)

    def _retire(self) -> None:
        for group in (self.prefilling, self.active):
            for a in [a for a in group if a.finished is not None]:
                self._free(a)  # before it leaves the list: a snapshot sees its slot free first
                group.remove(a)
                if a.failure is None:
                    self.tally.finished(a)
                    if self.prefix is not None:
                        prefixing.remember(self.prefix, a)
                a.finish(a.finished or "stop")
