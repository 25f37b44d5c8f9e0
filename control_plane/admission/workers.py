"""Processes that do admission's costly work (`work.Preparer`) under a deadline and a memory
bound, so a request's template, schema or grammar never holds the event loop, `/health` or any
other request. A worker past its deadline is killed (a thread running jinja2 or a Rust library
cannot be interrupted) and its memory given back with it; the next job starts a fresh one."""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import grpc

from control_plane.admission.refusal import INVALID, BadRequest
from control_plane.admission.work import _HEADER, STAGES, Prepared, WorkerSetup, send
from protos.model import Capabilities
from protos.params import RequestParams

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MEMORY_MB = 1024
DEFAULT_WORKERS = 2
SETUP_TIMEOUT_S = 120.0  # a worker loading a model's tokenizer and grammar engine
# A worker that kept this much more than it held when set up is replaced after its job: a
# request's large render left its allocator holding the pages.
KEPT_MB = 256
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass(frozen=True)
class AdmissionBounds:
    """What one request's admission work may take: `timeout_s` of a worker's time,
    `memory_mb` beyond what a worker holds set up; `workers` run at once."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_mb: int = DEFAULT_MEMORY_MB
    workers: int = DEFAULT_WORKERS


class _Late(Exception):
    """The worker did not answer in time."""


class _Gone(Exception):
    """The worker ended (its status in `args[0]`)."""


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control_plane.admission.work"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.digest = ""  # the WorkerSetup it holds
        self.base = 0  # its resident bytes once set up

    def set_up(self, setup: WorkerSetup, memory_mb: int) -> None:
        self.send(("setup", (setup, memory_mb)))
        self.receive(time.monotonic() + SETUP_TIMEOUT_S)
        self.digest, self.base = setup.digest, self.resident()

    def send(self, message: Any) -> None:
        assert self.proc.stdin is not None
        try:
            send(self.proc.stdin, message)
        except (OSError, ValueError):  # a broken or closed pipe
            raise _Gone(self.proc.wait()) from None

    def receive(self, deadline: float) -> Any:
        header = self._read(_HEADER.size, deadline)
        return pickle.loads(self._read(_HEADER.unpack(header)[0], deadline))

    def _read(self, size: int, deadline: float) -> bytearray:
        assert self.proc.stdout is not None
        # A job's result may hold images' rows: tens of MB, arriving in pipe-sized pieces.
        out = bytearray()
        try:
            fd = self.proc.stdout.fileno()
            while len(out) < size:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise _Late
                piece = os.read(fd, size - len(out))
                if not piece:
                    raise _Gone(self.proc.wait())
                out += piece
        except (OSError, ValueError):  # its pipe closed under the read: `close` ended it
            raise _Gone(self.proc.wait()) from None
        return out

    def resident(self) -> int:
        try:
            with open(f"/proc/{self.proc.pid}/statm") as f:
                return int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            return 0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _kill_all(workers: set[_Worker]) -> None:
    for w in list(workers):
        workers.discard(w)
        w.kill()


class Workers:
    """At most `bounds.workers` worker processes, started when first needed. `run` is
    blocking: call it from a thread."""

    def __init__(self, bounds: AdmissionBounds = AdmissionBounds()) -> None:
        self.bounds = bounds
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._started = 0
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self._closed = False
        # A pool dropped unclosed (a test's door) ends its processes with it.
        weakref.finalize(self, _kill_all, self._all)

    def run(
        self, setup: WorkerSetup, request: RequestParams, caps: Capabilities, max_prompt_bytes: int
    ) -> Prepared:
        """`work.Preparer.prepare` of the request in a worker; `BadRequest` with a sentence
        for a refusal, and for work past the deadline or the memory bound (naming the stage)."""
        worker = self._take()
        if worker.digest != setup.digest:
            try:
                worker.set_up(setup, self.bounds.memory_mb)
            except (_Late, _Gone):
                self._drop(worker)
                raise BadRequest(
                    grpc.StatusCode.UNAVAILABLE,
                    f"an admission worker could not load the tokenizer of {setup.origin}",
                ) from None
        stage = "tools"
        try:
            worker.send(("job", (request, caps, max_prompt_bytes)))
            deadline = time.monotonic() + self.bounds.timeout_s
            while (message := worker.receive(deadline))[0] == "stage":
                stage = message[1]
        except (_Late, _Gone) as e:
            self._drop(worker)
            raise self._refusal(stage, e) from None
        except BaseException:
            self._drop(worker)
            raise
        if message[0] == "memory":  # what it grew stays with it: a fresh one takes its place
            self._drop(worker)
        else:
            self._give_back(worker)
        return self._result(message, stage)

    def warm(self, setup: WorkerSetup) -> None:
        """Start and set up every worker now, so the first chats wait for none (blocking)."""
        taken: list[_Worker] = []
        try:
            while len(taken) < self.bounds.workers:
                worker = self._take()
                taken.append(worker)
                if worker.digest != setup.digest:
                    worker.set_up(setup, self.bounds.memory_mb)
        except (_Late, _Gone, BadRequest):
            pass  # a job sets the next one up, and says why it cannot
        finally:
            for worker in taken:
                self._give_back(worker)

    def close(self) -> None:
        """End every worker; `run` refuses from now on."""
        with self._lock:
            self._closed = True
        _kill_all(self._all)

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise BadRequest(grpc.StatusCode.UNAVAILABLE, "the control plane is stopping")
            start = self._idle.empty() and self._started < self.bounds.workers
            if start:
                self._started += 1
        if not start:
            return self._idle.get()
        try:
            worker = _Worker()
        except OSError:
            with self._lock:
                self._started -= 1
            raise
        with self._lock:
            self._all.add(worker)
        return worker

    def _give_back(self, worker: _Worker) -> None:
        if worker.resident() > worker.base + (KEPT_MB << 20):
            self._drop(worker)
        else:
            self._idle.put(worker)

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)
            self._started -= 1

    def _refusal(self, stage: str, e: Exception) -> BadRequest:
        field, doing = STAGES[stage]
        if isinstance(e, _Late):
            sentence = (
                f"{doing} took longer than {self.bounds.timeout_s:g} s, this server's bound "
                "(--admission-timeout)"
            )
        else:
            sentence = (
                f"{doing} ended its worker process (status {e.args[0]}), past this server's "
                f"bound of {self.bounds.memory_mb} MiB (--admission-memory-mb) or its stack"
            )
        return BadRequest(INVALID, sentence, field)

    def _result(self, message: tuple[str, Any], stage: str) -> Prepared:
        kind, body = message
        if kind == "done":
            return body
        field, doing = STAGES[stage]
        if kind == "refused":
            code, sentence, param = body
            raise BadRequest(getattr(grpc.StatusCode, code), sentence, param)
        if kind == "memory":
            sentence = (
                f"{doing} needed more than {self.bounds.memory_mb} MiB, this server's bound "
                "(--admission-memory-mb)"
            )
            raise BadRequest(INVALID, sentence, field)
        raise BadRequest(INVALID, f"{doing} failed: {body}", field)
