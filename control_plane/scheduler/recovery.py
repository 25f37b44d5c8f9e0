"""The scheduler's releases and its recovery from a failed step: a finished request's sequence
freed (or left to the plan in flight that still runs it); a step that failed as a whole fails
every admitted request with the error's status and, when the service went away, hands the
waiting ones to another replica where a router has one, frees the sequences the service still
holds and drops the connection, so that the loop starts over on a fresh one."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from control_plane.scheduler.context import StepContext
from control_plane.scheduler.pipeline import Pipeline
from control_plane.scheduler.prefix_cache import PrefixCache
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.status import step_status
from protos.model import ModelError, SequenceHandle, ServingModel

log = logging.getLogger("control_plane.scheduler")


class Recovery:
    """`Scheduler`'s (`loop.py`) releases and failure handling, on the loop's thread; the
    state below is the scheduler's."""

    pipeline: Pipeline
    prefilling: list[ActiveSeq]
    active: list[ActiveSeq]
    waiting: deque[ActiveSeq]
    model: ServingModel | None
    ctx: StepContext | None
    prefix: PrefixCache | None
    # A router's: the waiting requests, placed elsewhere -> those it could not place.
    handoff: Callable[[Any, list[ActiveSeq]], list[ActiveSeq]] | None
    free_slots: int
    _queued: int
    _lock: threading.Lock

    def _free(self, a: ActiveSeq) -> None:
        """Release the request's sequence; one the service no longer knows is gone already."""
        handle, a.handle = a.handle, None
        if self.model is None or handle is None:
            return
        if self.pipeline.holds(a):  # a plan in flight still runs it: freed once it is back
            self.pipeline.defer_free(a, handle)
            return
        self._release_handle(handle)

    def _release_handle(self, handle: SequenceHandle) -> None:
        assert self.model is not None
        try:
            self.model.free_sequence(handle)
        except ModelError as e:
            log.warning("freeing sequence %d: %s", handle.seq_id, e)
            return
        self.free_slots += 1

    def _dequeued(self, n: int) -> None:
        with self._lock:
            self._queued -= n

    def _reset(self, error: Exception) -> None:
        """A step failed as a whole: fail every admitted request with the error's status.
        When the service went away, ask it what it still holds, free those sequences and
        start over on a fresh connection; otherwise free them and carry on."""
        code, message = step_status(error)
        self.pipeline.close()  # what was in flight is lost with the step
        failed = [*self.prefilling, *self.active]
        log.error("%s; failing %d requests", message, len(failed))
        for a in failed:
            a.fail(code, message)
        self.prefilling, self.active = [], []
        lost = isinstance(error, (grpc.RpcError, OSError))
        if lost:
            self._hand_off()
        if not lost and self.model is not None:
            for a in failed:
                self._free(a)
            return
        if self.model is None:  # the connection itself failed: the waiting fail too
            for a in self.waiting:
                a.fail(code, message)
            self._dequeued(len(self.waiting))
            self.waiting.clear()
        else:
            self._release(failed)
        with self._lock:
            self.model, self.ctx, self.prefix = None, None, None
        time.sleep(0.1)  # a restarting service gets a moment before the next connect

    def _hand_off(self) -> None:
        """Requests that hold no slot yet may go elsewhere: to a router's other replicas."""
        if self.handoff is None or not self.waiting:
            return
        waiting = list(self.waiting)
        unplaced = self.handoff(self, waiting)
        self._dequeued(len(waiting) - len(unplaced))
        self.waiting = deque(unplaced)

    def _release(self, failed: list[ActiveSeq]) -> None:
        """After a transport error: free the ended requests' sequences the service still
        holds (none when it restarted, or cannot be reached), then close the connection."""
        assert self.model is not None
        try:
            caps = self.model.capabilities()
            if caps.free_slots < caps.num_slots:
                for a in failed:
                    self._free(a)
        except (grpc.RpcError, OSError) as e:
            log.warning("the GPU service is still unreachable: %s", step_status(e)[1])
        getattr(self.model, "close", lambda: None)()
