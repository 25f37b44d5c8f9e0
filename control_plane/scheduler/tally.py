"""The scheduler's counters (what `GetStats` and the bench read) and their Prometheus twins,
kept together under one lock."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from control_plane.scheduler.metrics import ReplicaMetrics, Retired
from control_plane.scheduler.seq import ActiveSeq, SpecStats


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
    plans: int = 0  # pipelined steps (step plans read back)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of them, tokens a cached prefix gave
    preemptions: int = 0  # requests whose sequence was freed for the KV pool's sake
    engine_waited_s: float = 0.0  # the service's idle time between them, as it measured it


def merge_counters(a: Counters, b: Counters) -> Counters:
    """Two schedulers' counters as one: sums, the step widths' histograms added, and the
    wider of the two last widths."""
    out = Counters(**{f: getattr(a, f) + getattr(b, f) for f in SUMMED})
    out.step_widths = {
        w: a.step_widths.get(w, 0) + b.step_widths.get(w, 0)
        for w in {*a.step_widths, *b.step_widths}
    }
    out.last_width = max(a.last_width, b.last_width)
    return out


SUMMED = (
    "requests",
    "finished",
    "prompt_tokens",
    "completion_tokens",
    "steps",
    "copies",
    "dcut_steps",
    "plans",
    "engine_waited_s",
    "prefix_queries",
    "prefix_hits",
    "preemptions",
)


class Tally:
    def __init__(self, metrics: ReplicaMetrics | None) -> None:
        self.metrics = metrics
        self.counters, self.spec = Counters(), SpecStats()
        self._lock = threading.Lock()

    def copy(self) -> tuple[Counters, SpecStats]:
        """A snapshot, for another thread."""
        with self._lock:
            spec = SpecStats()
            spec.merge(self.spec)
            counters = Counters(**vars(self.counters))
            counters.step_widths = dict(counters.step_widths)
            return counters, spec

    def submitted(self) -> None:
        with self._lock:
            self.counters.requests += 1
        if self.metrics is not None:
            self.metrics.requests.inc()

    def planned(self, waited_s: float) -> None:
        """A pipelined step read back, and how long the service waited before it."""
        with self._lock:
            self.counters.plans += 1
            self.counters.engine_waited_s += waited_s

    def prefix(self, queries: int, hits: int) -> None:
        """Prompt tokens looked up in the prefix cache, and those a cached prefix gave."""
        with self._lock:
            self.counters.prefix_queries += queries
            self.counters.prefix_hits += hits
        if self.metrics is not None:
            self.metrics.prefix_cache_queries.inc(queries)
            self.metrics.prefix_cache_hits.inc(hits)

    def preempted(self) -> None:
        with self._lock:
            self.counters.preemptions += 1
        if self.metrics is not None:
            self.metrics.preemptions.inc()

    def stepped(self, width: int, copies: int, dcut: bool, step_nd: int) -> None:
        with self._lock:
            c = self.counters
            c.steps += 1
            c.step_widths[width] = c.step_widths.get(width, 0) + 1
            c.copies += copies
            c.dcut_steps += int(dcut)
            c.last_width = step_nd
        if self.metrics is not None:
            self.metrics.steps.inc()
            self.metrics.copies.inc(copies)
            self.metrics.dcut_steps.inc(int(dcut))
            self.metrics.step_width.set(step_nd)

    def finished(self, a: ActiveSeq) -> None:
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
            prompt, generated = len(a.req.prompt_ids), len(a.generated)
            times = (a.submitted, a.scheduled, a.first_emit, a.last_emit, time.monotonic())
            self.metrics.record_retired(Retired(prompt, generated, *times))
