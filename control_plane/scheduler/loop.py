"""The scheduler loop, on its own thread: admit, prefill, step, stream, retire.

Requests come in through a queue (bounded: past `max_queue` waiting, `ResourceExhausted`);
events go out through each request's sink. A fault of the GPU service (it went away, or
answered something the loop did not expect) ends every admitted request with a failure and
starts over with a fresh connection: the service the loop reconnects to starts clean.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry.context import Context
from opentelemetry.trace import Link

from control_plane.detok import Tokenizer
from control_plane.env import Env
from control_plane.metrics import Metrics
from control_plane.scheduler.context import StepContext
from control_plane.scheduler.cost_model import CostTable
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.seq import ActiveSeq, GenRequest, Sink, SpecStats
from control_plane.scheduler.step import step_mtp
from protos.model import Capabilities, Model, ModelError, ResourceExhausted
from protos.telemetry import span, tracer

log = logging.getLogger("control_plane.scheduler")
TRACER = tracer("met.control_plane")
Payload = tuple[GenRequest, Sink] | str | None  # submit, cancel, wake


@dataclass
class Counters:
    requests: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    step_widths: dict[int, int] = field(default_factory=dict)  # active sequences -> steps
    copies: int = 0  # prompt-lookup copies verified
    dcut_steps: int = 0  # steps whose batch D-Cut planned
    last_width: int = 0  # the last step's draft width


class Scheduler:
    def __init__(
        self,
        connect: Callable[[], Model],
        tokenizer: Tokenizer,
        opts: SchedulerOptions | None = None,
        env: Env | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.metrics = metrics
        self.connect, self.tokenizer = connect, tokenizer
        # The environment is read once, here; its switches override the options by name.
        self.opts = (opts or SchedulerOptions()).with_env(env or Env.read())
        self.model: Model | None = None
        self.ctx: StepContext | None = None
        self.inbox: queue.Queue[tuple[str, Payload]] = queue.Queue()
        self.waiting: deque[ActiveSeq] = deque()
        self.prefilling: list[ActiveSeq] = []
        self.active: list[ActiveSeq] = []
        self.counters, self.spec = Counters(), SpecStats()
        self._queued = 0  # submitted and not yet admitted, across threads
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

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

    def submit(self, req: GenRequest, sink: Sink) -> None:
        with self._lock:
            if self._queued >= self.opts.max_queue:
                raise ResourceExhausted(
                    f"{self._queued} requests are already waiting for a slot (the bound is "
                    f"{self.opts.max_queue}); retry later"
                )
            self._queued += 1
            self.counters.requests += 1
        if self.metrics is not None:
            self.metrics.requests.inc()
        self.inbox.put(("submit", (req, sink)))

    def cancel(self, request_id: str) -> None:
        self.inbox.put(("cancel", request_id))

    def snapshot(self) -> dict:
        with self._lock:
            spec = SpecStats()
            spec.merge(self.spec)
            free = (
                self.ctx.caps.num_slots - len(self.prefilling) - len(self.active) if self.ctx else 0
            )
            counters = Counters(**vars(self.counters))
            counters.step_widths = dict(counters.step_widths)
            return {
                "counters": counters,
                "spec": spec,
                "active": len(self.active) + len(self.prefilling),
                "queued": self._queued,
                "free_slots": free,
            }

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not (self.waiting or self.prefilling or self.active))
                self._iterate()
            except (grpc.RpcError, ModelError) as e:
                self._reset(e)
            except Exception as e:  # a bug must fail its requests, not stop the loop
                log.exception("the scheduler step failed")
                self._reset(e)

    def _drain(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
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
            req, sink = payload
            max_context = self.ctx.caps.max_context if self.ctx else 1 << 30
            eos = self.ctx.caps.eos_token_ids if self.ctx else ()
            a = ActiveSeq(req, sink, self.tokenizer, eos, max_context)
            a.vocab_size = self.ctx.caps.vocab_size if self.ctx else 0
            a.drafter = self.ctx.caps.has_mtp if self.ctx else True
            a.observer = self.metrics
            a.draft_stop = self.opts.draft_confidence_stop
            self.waiting.append(a)
        elif kind == "cancel":
            self._cancel(str(payload))

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
        if not (self.waiting or self.prefilling or self.active):
            return
        # Each iteration is a trace of its own; requests reach it through span links.
        with TRACER.start_as_current_span("scheduler_iteration", context=Context()):
            self._admit()
            self._prefill()
            self._retire()
            if self.active:
                assert self.model is not None and self.ctx is not None
                width = len(self.active)
                report = step_mtp(self.model, self.active, self.ctx, self.opts.num_drafts)
                with self._lock:
                    self.counters.steps += 1
                    widths = self.counters.step_widths
                    widths[width] = widths.get(width, 0) + 1
                    self.counters.copies += sum(report.copied)
                    self.counters.dcut_steps += int(report.dcut)
                    self.counters.last_width = report.ladder_nd
                if self.metrics is not None:
                    self.metrics.steps.inc()
                    self.metrics.copies.inc(sum(report.copied))
                    self.metrics.dcut_steps.inc(int(report.dcut))
                    self.metrics.step_width.set(report.ladder_nd)
                self._retire()
        self._gauges()

    def _gauges(self) -> None:
        if self.metrics is None or self.ctx is None:
            return
        held = len(self.prefilling) + len(self.active)
        self.metrics.running.set(held)
        self.metrics.waiting.set(self._queued)
        self.metrics.free_slots.set(self.ctx.caps.num_slots - held)

    def _connect(self) -> None:
        model = self.connect()
        caps = model.capabilities()
        self.ctx = StepContext.build(caps, self.opts, self._measure(model, caps))
        self.model = model
        for a in self.waiting:
            a.max_context = caps.max_context
            a.vocab_size = caps.vocab_size
            a.drafter = caps.has_mtp
            a.set_eos(() if a.req.ignore_eos else caps.eos_token_ids)

    def _measure(self, model: Model, caps: Capabilities) -> CostTable | None:
        """The measured cost model's table, once per connection (`--spec-cost-model`)."""
        if self.opts.spec_cost_model != "measured":
            return None
        widths = [w for w in (1, 2, 4, 8, 16, 32) if w <= caps.num_slots]
        depth = min(self.opts.num_drafts, max(caps.slot_verify_drafts))
        entries, _ = model.measure_costs(widths, depth)
        return CostTable(entries)

    def _admit(self) -> None:
        assert self.model is not None and self.ctx is not None
        free = self.ctx.caps.num_slots - len(self.prefilling) - len(self.active)
        while self.waiting and free > 0:
            a = self.waiting.popleft()
            self._dequeued(1)
            a.handle = self.model.alloc_sequence()
            self.prefilling.append(a)
            free -= 1

    def _prefill(self) -> None:
        """One batched prefill call: each prefilling sequence's next chunk, within budget."""
        assert self.model is not None and self.ctx is not None
        budget = self.ctx.caps.max_prefill_tokens
        batch, chunks = [], []
        for a in self.prefilling:
            n = min(len(a.req.prompt_ids) - a.prefilled, self.opts.prefill_chunk, budget)
            if n <= 0:
                break
            batch.append(a)
            chunks.append(list(a.req.prompt_ids[a.prefilled : a.prefilled + n]))
            budget -= n
        if not batch:
            return
        links = [Link(a.req.span_context) for a in batch if a.req.span_context is not None]
        with span(
            TRACER,
            "prefill",
            links,
            **{"met.sequences": len(batch), "met.tokens": sum(map(len, chunks))},
        ):
            # Grammars and min_new_tokens bind the first generated token too.
            masks = [
                a.row_mask([]) if a.prefilled + len(c) == len(a.req.prompt_ids) else b""
                for a, c in zip(batch, chunks, strict=True)
            ]
            sampling = [
                a.sampling(1)
                if a.samples and a.prefilled + len(c) == len(a.req.prompt_ids)
                else None
                for a, c in zip(batch, chunks, strict=True)
            ]
            argmax = self.model.prefill([a.live_handle for a in batch], chunks, masks, sampling)
            logprobs = self.model.last_logprobs()
        for i, (a, chunk) in enumerate(zip(batch, chunks, strict=True)):
            a.prefilled += len(chunk)
            if a.prefilled == len(a.req.prompt_ids):
                self.prefilling.remove(a)
                self.active.append(a)
                a.gain([argmax[i]], logprobs[i : i + 1])

    def _retire(self) -> None:
        for group in (self.prefilling, self.active):
            for a in [a for a in group if a.finished is not None]:
                group.remove(a)
                if self.model is not None and a.handle is not None:
                    self.model.free_sequence(a.handle)
                self._account(a)
                a.finish(a.finished or "stop")

    def _account(self, a: ActiveSeq) -> None:
        with self._lock:
            self.counters.finished += 1
            self.counters.prompt_tokens += len(a.req.prompt_ids)
            self.counters.completion_tokens += len(a.generated)
            self.spec.merge(a.stats)
        if self.metrics is not None:
            self.metrics.request_success.labels(finished_reason=a.finished or "stop").inc()
            self.metrics.prompt_tokens.inc(len(a.req.prompt_ids))
            self.metrics.mean_accepted_length.set(self.spec.mean_accepted_length)
            self.metrics.grammar_truncations.inc(a.stats.grammar_truncations)

    def _dequeued(self, n: int) -> None:
        with self._lock:
            self._queued -= n

    def _reset(self, error: Exception) -> None:
        """A step failed: fail every admitted request. When the service went away, forget the
        connection (the one it comes back on starts clean); otherwise free their sequences
        and carry on with the same connection."""
        gone = isinstance(error, grpc.RpcError)
        if isinstance(error, grpc.RpcError):
            message = f"the GPU service failed: {error.details()}"
        elif isinstance(error, ModelError):
            message = f"the GPU service refused: {error}"
        else:
            message = f"the scheduler failed: {type(error).__name__}: {error}"
        code = "UNAVAILABLE" if gone else "INTERNAL"
        failed = [*self.prefilling, *self.active]
        log.error("%s; failing %d requests", message, len(failed))
        for a in failed:
            a.fail(code, message)
        self.prefilling, self.active = [], []
        if not gone and self.model is not None:
            for a in failed:
                if a.handle is not None:
                    try:
                        self.model.free_sequence(a.handle)
                    except (grpc.RpcError, ModelError):
                        pass
            return
        if self.model is None:  # the connection itself failed: the waiting fail too
            for a in self.waiting:
                a.fail(code, message)
            self._dequeued(len(self.waiting))
            self.waiting.clear()
        getattr(self.model, "close", lambda: None)()
        with self._lock:
            self.model, self.ctx = None, None
        time.sleep(0.1)  # a restarting service gets a moment before the next connect
