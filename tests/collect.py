"""Run requests through a scheduler and collect what each one streamed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import Delta, Event, Failure, Finish, GenRequest, PromptScores
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)  # per token, when asked
    top_logprobs: list[list[float]] = field(default_factory=list)
    finish: Finish | None = None
    failure: Failure | None = None
    prompt: PromptScores | None = None  # the prompt's scores, once, with its first event
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, Delta | Finish) and ev.prompt is not None:
            assert self.prompt is None, "the prompt's scores came twice"
            self.prompt = ev.prompt
        if isinstance(ev, Delta):
            self.tokens += ev.token_ids
            self.text += ev.text
            self.logprobs += ev.logprobs
            self.top_ids += ev.top_ids
            self.top_logprobs += ev.top_logprobs
        elif isinstance(ev, Finish):
            self.finish = ev
            self.done.set()
        else:
            self.failure = ev
            self.done.set()


def run_all(scheduler: Scheduler, reqs: list[GenRequest], timeout: float = 120) -> list[Outcome]:
    outs = [Outcome() for _ in reqs]
    for r, o in zip(reqs, outs, strict=True):
        scheduler.submit(r, o)
    for o in outs:
        assert o.done.wait(timeout), "a request did not finish"
    return outs


@contextmanager
def serving(model_dir: Path, svc: ServiceConfig, cache: bool = True) -> Iterator[Scheduler]:
    """A started scheduler (byte tokenizer, `--prefix-cache` as `cache`) over a fresh engine;
    once left, stopped, with every block and snapshot of the engine free."""
    engine = Engine(model_dir, svc)
    s = Scheduler(
        lambda: engine, ByteTokenizer.default(), SchedulerOptions(prefix_cache=cache), Env()
    )
    s.start()
    try:
        yield s
    finally:
        s.stop()
    assert engine.slots.blocks.num_used == 0 and engine.prefixes.num_held == 0
