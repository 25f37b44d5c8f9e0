"""The step compiled on the CPU: each of `Graphs`' keys (a batch bucket, rows per sequence, key
length) compiled by `torch.compile` with inductor's C++ wrapper, so that a replay is one C++
function over the persistent buffers instead of Python over some 1,700 torch ops.

Static shapes per key and no graph breaks (`fullgraph`): a key that does not compile falls back
to the eager forward with its reason kept (`Graphs.failed`). Dynamo traces a key once; a replay
then calls what inductor built with the tensors dynamo handed it, as a captured CUDA graph
replays over the addresses it captured: a key's buffers never change shape, dtype or place, nor
are they bound anew, so dynamo's frame, its guards and its stance would check nothing at a
replay, and they cost a quarter of the service's own work a step at one sequence (0.36 ms of a
3.39 ms step in process, two replays).

Inductor's caches (its FX graph cache and AOT autograd cache) live in the directory
`--compile-cache` names, so that a second start loads each compiled key instead of compiling
it again."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import types
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
# torch itself is imported by `compile_run`: the service's flags read this module.

Run = Callable[[], None]
_log = logging.getLogger(__name__)

# Inductor's own switch for its cache directory, read when a compile starts.
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# Set (to anything): a service left to choose runs the step eagerly (the test suite sets it for
# the services it starts, which compile only when a test asks with --compile).
NO_COMPILE_ENV = "METRALE_NO_COMPILE"
_COMPILED = 0


def cache_dir() -> Path:
    """Inductor's own `CACHE_ENV` where set, else `$XDG_CACHE_HOME/met/compile` (by default
    `~/.cache/met/compile`): inductor keys each entry by the graph, the compiler's flags and
    torch's version, so models share it."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "met" / "compile"


def decide(
    asked: bool | None, device: torch.device, tp_size: int, environ: Mapping[str, str]
) -> tuple[bool, str]:
    """Whether a service compiles its step -> (yes, why not when not). `asked`: --compile
    (True), --no-compile (False), neither (None: on the CPU where a C++ compiler is, unless
    NO_COMPILE_ENV is set). ValueError with a sentence where --compile cannot be honoured."""
    why = None
    if device.type != "cpu":
        why = f"the step is compiled on the CPU only; on {device.type} captured graphs do it"
    elif tp_size > 1:
        why = "the step is not compiled under tensor parallelism"
    else:
        why = compiler_missing()
    if asked and why:
        raise ValueError(f"--compile: {why}")
    if asked is None and not why and NO_COMPILE_ENV in environ:
        why = f"{NO_COMPILE_ENV} is set"
    if asked is False:
        why = "--no-compile"
    return why is None, why or ""


def compiler_missing() -> str | None:
    """Why this machine cannot compile the step (None: it can): inductor's CPU backend builds
    C++ with the compiler `CXX` names, else the first of its usual names on the PATH."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
    if any(shutil.which(n) for n in names):
        return None
    return f"no C++ compiler ({', '.join(names)}) is on the PATH, which inductor needs"


def use_cache(path: str) -> None:
    """Inductor's caches in `path` ("": `cache_dir()`), made if missing, for every compile from
    now on."""
    directory = Path(path) if path else cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(directory)


def compile_run(run: Run) -> Run:
    """`run` compiled and run once -> its replay."""
    import torch

    global _COMPILED
    _COMPILED += 1
    # A code object of its own: dynamo keeps its cache entries on the code object.
    code = run.__code__.replace(co_name=f"{run.__code__.co_name}_{_COMPILED}")
    own = types.FunctionType(code, run.__globals__, code.co_name, None, run.__closure__)
    built: list[tuple[Callable[..., object], list[torch.Tensor]]] = []

    def inductor(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., object]:
        from torch._inductor.compile_fx import compile_fx

        # Inductor's own kernels on one thread: split over several, a reduction's order would
        # follow the bucket's shape (the products it calls still use torch's threads).
        graph = compile_fx(gm, inputs, config_patches={"cpp_wrapper": True, "cpp.threads": 1})
        if not callable(graph):  # what an ahead-of-time export gives, never asked for here
            raise RuntimeError(f"inductor gave {type(graph).__name__}, not a callable graph")
        built.append((graph, list(inputs)))
        return graph

    compiled = torch.compile(own, backend=inductor, fullgraph=True, dynamic=False)
    with warnings.catch_warnings():
        # The forward's cached index tables (`functools.cache`) are traced through: they hold
        # constants of the shapes, which is what dynamo warns might not be so.
        warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools")
        compiled()
    if len(built) != 1:
        raise RuntimeError(f"dynamo made {len(built)} graphs of one step, not one")
    (graph, inputs), broken = built[0], list[str]()

    def replay() -> None:
        """The compiled graph; should it fail, `run` itself from then on: the call, and every
        later one, gets the eager forward over the same buffers, never an error."""
        if not broken:
            try:
                graph(*inputs)
                return
            except RuntimeError as e:
                broken.append(str(e))
                _log.warning("a compiled step graph runs eagerly from now on: %s", e)
        run()

    return replay


def queued(keys: int, cache: str) -> str:
    """The start-up line of a service that compiles in the background."""
    return (
        f"gpu-service serves now and compiles the step for the CPU in the background: {keys} "
        f"graphs queued (one request's verify and chain at each key length, then those calls "
        f"ask for first); a call whose graph is not built yet runs the eager forward; cache "
        f"{cache or cache_dir()}"
    )


class Later:
    """Keys compiled by a thread of their own, one at a time, while the step goes on: a cold
    compile takes tens of seconds (more on a busy machine), which no step may stall for, nor an
    RPC's deadline wait out. `pending` holds the keys queued or compiling; a build is
    `Graphs`' capture, which keeps the graph (or its failure) where the step finds it."""

    def __init__(self) -> None:
        self.pending: set[tuple] = set()
        self._jobs: deque[tuple[tuple, Callable[[], object]]] = deque()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()

    def submit(self, key: tuple, build: Callable[[], object], first: bool = False) -> None:
        """`build` run on the thread unless `key` is pending already; `first`: before the keys
        queued (a call asked for it: the likeliest to be asked again), else after them."""
        with self._idle:
            if key in self.pending:
                if first and (job := next((j for j in self._jobs if j[0] == key), None)):
                    self._jobs.remove(job)
                    self._jobs.appendleft(job)
                return
            self.pending.add(key)
            (self._jobs.appendleft if first else self._jobs.append)((key, build))
            self._idle.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="compile", daemon=True)
                self._thread.start()

    def settle(self, key: tuple | None = None) -> None:
        """Until `key` (None: every key) is no longer pending."""
        with self._idle:
            self._idle.wait_for(
                lambda: not self.pending if key is None else key not in self.pending
            )

    def _work(self) -> None:
        import torch

        while True:
            with self._idle:
                self._idle.wait_for(lambda: bool(self._jobs))
                key, build = self._jobs.popleft()
            try:
                # As the engine's operations run: a graph traced outside inference mode would
                # write inference tensors (the state) in place, which torch refuses.
                with torch.inference_mode():
                    build()
            finally:
                with self._idle:
                    self.pending.discard(key)
                    self._idle.notify_all()
