"""The scheduler's side of KV pool pressure (`pressure.py` has the rules): before each
iteration's calls, who goes on. Snapshots are dropped, requests paused, the newest preempted,
or the oldest failed alone, as the pool requires. The service is asked its free blocks only
past `Pool.surely_fits`'s bound: an iteration whose pool has blocks to spare asks nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from control_plane.scheduler import prefixing
from control_plane.scheduler.ahead import Pipeline
from control_plane.scheduler.connection import Connection
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.pressure import Pool
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.tally import Tally
from control_plane.scheduler.waitlist import Waitlist
from protos.model import ResourceExhausted

log = logging.getLogger("control_plane.scheduler")


class PoolTriage:
    """Who goes on each iteration while the KV pool is short, on the loop's thread."""

    def __init__(
        self,
        opts: SchedulerOptions,
        link: Connection,
        pipeline: Pipeline,
        queue: Waitlist,
        tally: Tally,
    ) -> None:
        self.opts, self.link, self.pipeline, self.queue, self.tally = (
            opts,
            link,
            pipeline,
            queue,
            tally,
        )

    def sort(
        self, prefilling: list[ActiveSeq], active: list[ActiveSeq], retire: Callable[[], None]
    ) -> tuple[set[int], bool]:
        """Who goes on this iteration: everyone while the pool surely has blocks to spare, or
        has them by the service's count; otherwise, once the flights are read back,
        `pressure.py`'s rules, repeated until the oldest can go on. -> (id() of the requests
        that sit the iteration out, while any does nothing new is admitted; whether its
        calls may leave the pool no block to spare, so that no snapshot takes one)"""
        model, ctx, cache = self.link.model, self.link.ctx, self.link.prefix
        assert model is not None and ctx is not None
        pool = Pool.of(ctx.caps, self.opts)
        if pool is None or not (prefilling or active):
            return set(), False
        snaps = cache.snapshot_tokens() if cache is not None else []
        flights = len(self.pipeline.flights)
        # Finished in a step whose result is not back: their blocks, and what that step takes,
        # are theirs until it is.
        holding = [*active, *(a for a, _ in self.pipeline.deferred)]
        if pool.surely_fits(prefilling, holding, flights, snaps):
            return set(), False
        free = model.capabilities().kv_blocks_free
        plan = pool.plan(prefilling, holding, free, flights)
        if plan.need <= free:
            # A snapshot after the prefill takes a block: none while the pool is that tight.
            return set(), plan.need + len(prefilling) > free
        self.pipeline.drain(ctx)  # the steps in flight take what they take first
        retire()
        while prefilling or active:
            free = model.capabilities().kv_blocks_free
            plan = pool.plan(prefilling, active, free)
            if plan.need > free and cache is not None and cache.num_snapshots:
                prefixing.drop(model, cache.oldest(max(1, cache.num_snapshots // 2)))
                continue
            if not plan.head_waits:
                return plan.paused, True
            victim = pool.victim(prefilling, active)
            if victim is not None:
                self._preempt(victim, prefilling, active)
                continue
            head = (active or prefilling)[0]
            if pool.alone(active, free):
                return plan.paused - {id(head)}, True
            head.refuse(ResourceExhausted.code, pool.starved(head, free))
            retire()
        return set(), True

    def _preempt(self, a: ActiveSeq, prefilling: list[ActiveSeq], active: list[ActiveSeq]) -> None:
        """The request's sequence freed for its blocks; it waits at the head of the queue."""
        self.pipeline.free(a)
        for group in (prefilling, active):
            if a in group:
                group.remove(a)
        tokens = len(a.req.prompt_ids) + len(a.generated)
        a.preempt()
        self.queue.requeue(a)
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
