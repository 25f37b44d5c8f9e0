"""The scheduler's side of KV pool pressure (`pressure.py` has the rules): before each
iteration's calls, snapshots dropped, requests paused, the newest preempted, or the oldest
failed alone, as the pool requires."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from control_plane.scheduler import prefixing
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.pressure import Pool
from control_plane.scheduler.recovery import Recovery
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.tally import Tally
from protos.model import ResourceExhausted

log = logging.getLogger("control_plane.scheduler")


class Room(Recovery):
    """`Scheduler`'s (`loop.py`) KV pool pressure, on the loop's thread."""

    opts: SchedulerOptions
    tally: Tally
    # id() of the requests sitting this iteration out (`pressure.Plan.paused`); while any
    # does, nothing new is admitted.
    paused: set[int]
    # Whether this iteration's calls may leave the pool no block to spare: then no snapshot
    # takes one.
    pressed: bool

    def _retire(self) -> None:
        raise NotImplementedError

    def _make_room(self) -> None:
        """Who goes on this iteration: everyone while the pool surely has room, or has it by
        the service's count; otherwise, once the flights are read back, `pressure.py`'s rules,
        repeated until the oldest can go on."""
        self.paused, self.pressed = set(), False
        assert self.model is not None and self.ctx is not None
        pool = Pool.of(self.ctx.caps, self.opts)
        if pool is None or not (self.prefilling or self.active):
            return
        snaps = self.prefix.snapshot_tokens() if self.prefix is not None else []
        flights = len(self.pipeline.flights)
        # Finished in a step whose result is not back: their blocks, and what that step takes,
        # are theirs until it is.
        holding = [*self.active, *(a for a, _ in self.pipeline.deferred)]
        if pool.surely_fits(self.prefilling, holding, flights, snaps):
            return
        free = self.model.capabilities().kv_blocks_free
        plan = pool.plan(self.prefilling, holding, free, flights)
        if plan.need <= free:
            # A snapshot after the prefill takes a block: none while the pool is that tight.
            self.pressed = plan.need + len(self.prefilling) > free
            return
        self.pressed = True
        self.pipeline.drain(self.ctx)  # the steps in flight take what they take first
        self._retire()
        while self.prefilling or self.active:
            free = self.model.capabilities().kv_blocks_free
            plan = pool.plan(self.prefilling, self.active, free)
            cache = self.prefix
            if plan.need > free and cache is not None and cache.num_snapshots:
                prefixing.drop(self.model, cache.oldest(max(1, cache.num_snapshots // 2)))
                continue
            if not plan.head_waits:
                self.paused = plan.paused
                return
            victim = pool.victim(self.prefilling, self.active)
            if victim is not None:
                self._preempt(victim)
                continue
            head = (self.active or self.prefilling)[0]
            if pool.alone(self.active, free):
                self.paused = plan.paused - {id(head)}
                return
            head.refuse(ResourceExhausted.code, pool.starved(head, free))
            self._retire()

    def _preempt(self, a: ActiveSeq) -> None:
        """The request's sequence freed for its blocks; it waits at the head of the queue."""
        self._free(a)
        for group in (self.prefilling, self.active):
            if a in group:
                group.remove(a)
        tokens = len(a.req.prompt_ids) + len(a.generated)
        a.preempt()
        self.waiting.appendleft(a)
        with self._lock:
            self._queued += 1
        self.tally.preempted()
        attrs: dict[str, AttributeValue] = {
            "met.request_id": a.req.request_id,
            "met.tokens": tokens,
            "met.preemptions": a.preemptions,  # this request's, this one included
        }
        trace.get_current_span().add_event("preempt", attrs)
        # The first one says what to do about it, as vLLM's warning does; the rest, that they
        # happened.
        first = self.tally.copy()[0].preemptions == 1
        log.log(
            logging.WARNING if first else logging.INFO,
            "the KV pool is full: request %s preempted at %d tokens, to be prefilled again%s",
            a.req.request_id,
            tokens,
            " (raise the GPU service's --kv-blocks, or lower the load, to avoid it)"
            if first
            else "",
        )
