"""The scheduler, as the fronts, the router and the tests drive it from their threads: submit,
cancel, settle, the service's capabilities, the load and a snapshot of its state. It composes
its parts (`waitlist.py`, `connection.py`, `triage.py`, `ahead.py`, the loop of `loop.py`),
each given what it needs, and runs the loop on a thread of its own."""

from __future__ import annotations

import threading
from collections.abc import Callable

from control_plane.scheduler.ahead import Pipeline
from control_plane.scheduler.connection import Connection
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.env import Env
from control_plane.scheduler.loop import Loop
from control_plane.scheduler.metrics import Metrics, ReplicaMetrics
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.prefix_cache import PrefixCache
from control_plane.scheduler.seq import ActiveSeq, GenRequest, QueueSink, Sink
from control_plane.scheduler.tally import Tally
from control_plane.scheduler.triage import PoolTriage
from control_plane.scheduler.waitlist import Waitlist
from control_plane.text.detok import Tokenizer
from control_plane.text.images import Keyed
from control_plane.text.tokenizer import Tokenization
from protos.model import Capabilities, ServingModel

# A replica's connection, with its capabilities and tokenization: the tokenization to use,
# or the refusal it raises.
Joins = Callable[["Scheduler", Capabilities, Tokenization], Tokenization]


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
        self.loop = Loop(
            self,
            self.opts,
            self.link,
            self.queue,
            self.pipeline,
            self.triage,
            self.tally,
            self._lock,
        )
        self._thread = threading.Thread(target=self.loop.run, name="scheduler", daemon=True)
        if self.series is not None:
            self.series.kv_cache_usage.set_function(self.kv_usage)

    # The connection's state, as the fronts, the router and the tests read it.
    model = property(lambda self: self.link.model)
    ctx: StepContext | None = property(lambda self: self.link.ctx)  # type: ignore[assignment]
    free_slots = property(lambda self: self.link.free_slots)
    waiting = property(lambda self: self.queue.waiting)
    prefilling = property(lambda self: self.loop.prefilling)
    active = property(lambda self: self.loop.active)

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
        self.loop.stopping.set()
        self.loop.inbox.put(("wake", None))
        self._thread.join(timeout=30)

    def capabilities(self) -> Capabilities:
        """The service's shape, connecting first if need be (raises when it is down)."""
        with self._lock:
            if self.link.ctx is None:
                self.loop.connect()
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
        self.loop.settled.clear()
        self.tally.submitted()
        self.loop.inbox.put(("submit", (req, sink, on_queued, tokenizer)))
        return self.replica

    def cancel(self, request_id: str) -> None:
        self.loop.inbox.put(("cancel", request_id))

    def settle(self, timeout: float) -> bool:
        """Wait until the loop has nothing to do, its background work done too (the answers
        the prefix cache snapshots once idle): what a client that reads an answer before it
        sends the next turn gives it. -> whether it settled within `timeout` seconds"""
        return self.loop.settled.wait(timeout)

    def cached_tokens(self, prompt: Keyed) -> int:
        """How many of the prompt's tokens this replica's prefix cache would restore (0 with
        none): what a router places by, from its own thread."""
        cache = self.link.prefix
        return cache.peek(prompt) if cache is not None else 0

    def load(self) -> tuple[int, int]:
        """(free slots, requests waiting for one): what a router places by."""
        with self._lock:
            return (self.link.free_slots if self.link.ctx else 0), self.queue.queued

    def kv_usage(self) -> float:
        """The fraction of the service's KV pool in use, asked now: the service owns the pool
        (0 before a connection, or from a service without a paged pool)."""
        blocks, free = self.link.kv_blocks()
        return (blocks - free) / blocks if blocks > 0 else 0.0

    def snapshot(self) -> dict:
        counters, spec = self.tally.copy()
        with self._lock:
            held = {
                "counters": counters,
                "spec": spec,
                "active": self.loop.holding(),
                "queued": self.queue.queued,
                "free_slots": self.link.free_slots if self.link.ctx else 0,
            }
        # The pool asked after the requests are read (and outside the lock: it is a call to
        # the service): a request leaves `active` only once its sequence is freed, so a
        # snapshot with none active shows every block of theirs free. Asked before, a free
        # between the two reads showed none active beside a block still held.
        blocks, blocks_free = self.link.kv_blocks()
        return {"kv_blocks": blocks, "kv_blocks_free": blocks_free, **held}
