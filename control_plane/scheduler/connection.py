"""The scheduler's connection to the GPU service: opened when there is work (or a caller asks
for the service's shape), with what it brings once: the capabilities and step context, the
model's facts each sequence holds, the tokenizer (the served checkpoint's unless one is
given; a replica's must be the router's, `joins`) and a prefix cache for its session. Free
slots are the service's count (`Capabilities.free_slots`), kept in step with this
scheduler's own allocs and frees: slots may be held by others. A lost connection (a
transport error) frees the sequences the service still holds and is dropped, so that the loop
starts over on a fresh one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from control_plane.scheduler import prefixing
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.prefix_cache import PrefixCache, prefix_cache
from control_plane.scheduler.seq import ActiveSeq, ModelFacts
from control_plane.scheduler.served import replaces, served_by
from control_plane.scheduler.status import step_status
from control_plane.scheduler.widths import measured_table
from control_plane.text.tokenizer import Tokenization
from protos.model import Capabilities, ModelError, SequenceHandle, ServingModel

log = logging.getLogger("control_plane.scheduler")
# The tokenization a connection is to use, given its capabilities and the served model's.
Accept = Callable[[Capabilities, Tokenization], Tokenization]


class Connection:
    """One scheduler's link to the service; `lock` is the scheduler's, held by whoever opens
    or drops it."""

    def __init__(
        self,
        connect: Callable[[], ServingModel],
        opts: SchedulerOptions,
        replica: str,
        lock: threading.Lock,
        override: Tokenization | None = None,
        accept: Accept | None = None,
    ) -> None:
        self.connect, self.opts, self.replica, self.lock = connect, opts, replica, lock
        self.override, self.accept = override, accept
        self.tokenization: Tokenization | None = override
        self.model: ServingModel | None = None
        self.ctx: StepContext | None = None
        # The prefix cache's names of the snapshots this connection's session holds.
        self.prefix: PrefixCache | None = None
        self.facts = ModelFacts()
        self.free_slots = 0  # the service's free slots, as of its last word and our calls

    def open(self) -> bool:
        """Connect (with the lock held). -> whether the served model's tokenizer replaced the
        one in use: then the requests waiting were tokenized for another model."""
        model = self.connect()
        try:
            caps = model.capabilities()
            served = self.override if self.override is not None else served_by(model, caps)
            if self.accept is not None:
                served = self.accept(caps, served)
            costs = measured_table(model, caps, self.opts.spec_cost_model, self.opts.num_drafts)
            ctx = StepContext.build(caps, self.opts, costs, self.replica)
        except BaseException:
            getattr(model, "close", lambda: None)()  # the service would keep its session open
            raise
        replaced = replaces(self.tokenization, served)
        self.tokenization = served
        self.ctx, self.model, self.facts = ctx, model, ModelFacts.of(caps)
        self.prefix = prefix_cache(self.opts, caps)
        self.free_slots = caps.free_slots  # others (or a past connection) may hold slots
        return replaced

    def release_handle(self, handle: SequenceHandle) -> None:
        """Free a sequence on the service; one it no longer knows is gone already."""
        if self.model is None:
            return
        try:
            self.model.free_sequence(handle)
        except ModelError as e:
            log.warning("freeing sequence %d: %s", handle.seq_id, e)
            return
        self.free_slots += 1

    def kv_blocks(self) -> tuple[int, int]:
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

    def drop_snapshots(self) -> None:
        """The loop is stopping: the snapshots this session holds go. Over gRPC the session's
        end would drop them; in process nothing else does."""
        if self.prefix is not None and self.model is not None:
            prefixing.drop(self.model, self.prefix.clear())

    def drop(self, failed: list[ActiveSeq]) -> None:
        """The connection is gone (a transport error) or never came up: the `failed`
        requests' sequences the service still holds are freed, then it is dropped, and the
        next iteration connects afresh."""
        if self.model is not None:
            self._release(failed)
        with self.lock:
            self.model, self.ctx, self.prefix = None, None, None
            self.facts = ModelFacts()
        time.sleep(0.1)  # a restarting service gets a moment before the next connect

    def _release(self, failed: list[ActiveSeq]) -> None:
        """Free the ended requests' sequences the service still holds (none when it
        restarted, or cannot be reached), then close the connection."""
        assert self.model is not None
        try:
            caps = self.model.capabilities()
            if caps.free_slots < caps.num_slots:
                for a in failed:
                    handle, a.handle = a.handle, None
                    if handle is not None:
                        self.release_handle(handle)
        except (grpc.RpcError, OSError) as e:
            log.warning("the GPU service is still unreachable: %s", step_status(e)[1])
        getattr(self.model, "close", lambda: None)()
