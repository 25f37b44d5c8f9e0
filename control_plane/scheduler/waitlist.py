"""The requests waiting for a slot, and their admission. The wait is bounded: past `max_queue`
submitted and not yet admitted, `ResourceExhausted`; and past `slot_wait` seconds waiting
while other sessions hold every slot (`slot_wait.py`). Those that ask hear where they stand
(`Queued` notices). Waiting requests take free slots in order, but for one that shares
uncached prompt blocks with a request ahead of it: it waits for that one's snapshot
(`prefixing.held`). One the service cannot place (its slots are held elsewhere) stays until a
slot frees or the service reports one free; with none free the service is asked at most every
`SLOT_POLL_S`. A request tokenized with a tokenizer that went out of use (the service serves
another model) is refused with UNAVAILABLE."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from control_plane.scheduler import prefixing
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.seq import ActiveSeq, ModelFacts
from control_plane.scheduler.served import refuse_stale
from control_plane.scheduler.slot_wait import SlotWait
from control_plane.scheduler.tally import Tally
from control_plane.text.detok import Tokenizer
from protos.model import MTP_HEAD, ModelError, ResourceExhausted

if TYPE_CHECKING:
    from control_plane.scheduler.connection import Connection

SLOT_POLL_S = 0.05  # with requests waiting and no free slot, how often to ask the service


class Waitlist:
    """The wait queue, on the loop's thread; `queued` (submitted, not yet admitted) is
    counted across threads, under the scheduler's `lock`."""

    def __init__(
        self, opts: SchedulerOptions, lock: threading.Lock, link: Connection, tally: Tally
    ) -> None:
        self.max_queue, self.lock, self.link, self.tally = opts.max_queue, lock, link, tally
        self.slot_wait = SlotWait(opts.slot_wait)
        self.waiting: deque[ActiveSeq] = deque()
        self.queued = 0
        # Waiting when the served model changed: tokenized for the old one, to be refused.
        self.stale: list[ActiveSeq] = []
        self.poll_at = 0.0  # when the service may next be asked for free slots

    # -- from any thread -----------------------------------------------------------------

    def reserve(self) -> None:
        """A request is submitted: counted, unless the queue is full."""
        with self.lock:
            if self.queued >= self.max_queue:
                raise ResourceExhausted(
                    f"{self.queued} requests are already waiting for a slot (the bound is "
                    f"{self.max_queue}); retry later"
                )
            self.queued += 1

    def dequeued(self, n: int) -> None:
        with self.lock:
            self.queued -= n

    # -- on the loop's thread ------------------------------------------------------------

    def put(self, a: ActiveSeq, tokenizer: Tokenizer) -> None:
        """The request waits, unless the tokenizer it was tokenized with went out of use
        before it got here."""
        with self.lock:  # a connect on another thread may change the tokenizer meanwhile
            in_use = self.link.tokenization
            stale = in_use is not None and tokenizer is not in_use.tokenizer
            if not stale:
                self.waiting.append(a)
        if stale:
            self._refuse_stale([a])

    def reconnected(self, facts: ModelFacts, replaced: bool) -> None:
        """A connection came up (under the lock): the waiting requests take its model's
        facts; when it serves another model, they are stale."""
        if replaced:
            self.stale.extend(self.waiting)
        for a in self.waiting:
            if a.facts != facts:
                a.facts = facts

    def drop_stale(self) -> None:
        """Waiting requests tokenized for the model the service served before are refused."""
        if not self.stale:
            return
        with self.lock:
            marked, self.stale = set(self.stale), []
            stale = [a for a in self.waiting if a in marked]
            self.waiting = deque(a for a in self.waiting if a not in marked)
        self._refuse_stale(stale)

    def _refuse_stale(self, stale: list[ActiveSeq]) -> None:
        assert self.link.tokenization is not None
        refuse_stale(stale, self.link.tokenization)
        self.dequeued(len(stale))

    def cancel(self, request_id: str) -> None:
        for a in list(self.waiting):
            if a.req.request_id == request_id:
                self.waiting.remove(a)
                self.dequeued(1)
                a.finish("cancelled")

    def requeue(self, a: ActiveSeq) -> None:
        """A preempted request waits again, at the head."""
        self.waiting.appendleft(a)
        with self.lock:
            self.queued += 1

    def admit(self, prefilling: list[ActiveSeq], paused: bool, now: float) -> None:
        """Waiting requests take free slots in order and join `prefilling`, unless requests
        sit out for the KV pool (`paused`): see the module's docstring."""
        link = self.link
        assert link.model is not None
        if self.waiting and link.free_slots <= 0 and now >= self.poll_at:
            self.poll_at = now + SLOT_POLL_S
            link.free_slots = link.model.capabilities().free_slots
        admitted: list[ActiveSeq] = []
        for a in list(self.waiting):
            if link.free_slots <= 0 or paused:  # a full pool: `pressure.py`
                break
            if link.prefix is not None and prefixing.held(link.prefix, a, [*prefilling, *admitted]):
                continue
            try:
                # Its method's drafter, or the service's default for one that has none.
                a.handle = link.model.alloc_sequence(a.req.penalties, a.method.drafter or MTP_HEAD)
            except ResourceExhausted:
                link.free_slots, self.poll_at = 0, now + SLOT_POLL_S
                break
            except ModelError as e:
                a.handle = None
                a.refuse(e.code, str(e))
            if a.handle is not None:
                # Counted as placed before it leaves the queue: a snapshot from another
                # thread never sees it in neither list while its slot is taken.
                link.free_slots -= 1
                prefilling.append(a)
                admitted.append(a)
            self.waiting.remove(a)
            self.dequeued(1)
            if a.handle is None:
                a.finish("error")
        if admitted and link.prefix is not None:
            prefixing.restore(link.model, link.prefix, admitted, self.tally)

    def refuse_overdue(self, holding: bool, num_slots: int, now: float) -> None:
        """Requests that waited `slot_wait` for a slot while others held them all (this
        scheduler `holding` none)."""
        for a in self.slot_wait.overdue(self.waiting, holding, self.link.free_slots, now):
            self.waiting.remove(a)
            self.dequeued(1)
            a.refuse(ResourceExhausted.code, self.slot_wait.sentence(num_slots))
            a.finish("error")

    def tell_places(self) -> None:
        """Each request still waiting after admission hears where it stands."""
        now = time.monotonic()
        for position, a in enumerate(self.waiting, start=1):
            a.tell_place(position, len(self.waiting), now)

    def hand_off(self, place: Callable[[list[ActiveSeq]], list[ActiveSeq]]) -> None:
        """Requests that hold no slot yet go elsewhere, where `place` takes them."""
        if not self.waiting:
            return
        waiting = list(self.waiting)
        unplaced = place(waiting)
        self.dequeued(len(waiting) - len(unplaced))
        self.waiting = deque(unplaced)

    def fail_all(self, code: str, message: str) -> None:
        for a in self.waiting:
            a.fail(code, message)
        self.dequeued(len(self.waiting))
        self.waiting.clear()
