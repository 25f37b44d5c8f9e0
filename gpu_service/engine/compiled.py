"""The step compiled on the CPU: each of `Graphs`' keys (a batch bucket, rows per sequence, key
length) compiled by `torch.compile` with inductor's C++ wrapper, so that a replay is one C++
function over the persistent buffers instead of Python over some 1,700 torch ops.

Static shapes per key and no graph breaks (`fullgraph`): a key that does not compile falls back
to the eager forward with its reason kept (`Graphs.failed`). Each key gets a code object of its
own, so that dynamo holds one cache entry per code object; its guards (one per weight and
buffer) are then not evaluated at a replay (`skip_guard_eval_unsafe`): a key's buffers never
change shape, dtype or place, which is all the guards would check.

Inductor's caches (its FX graph cache and AOT autograd cache) live in the directory
`--compile-cache` names, so that a second start loads each compiled key instead of compiling
it again."""

from __future__ import annotations

import os
import shutil
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch

Run = Callable[[], None]

# Inductor's own switch for its cache directory, read when a compile starts.
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_COMPILED = 0


def compiler_missing() -> str | None:
    """Why this machine cannot compile the step (None: it can): inductor's CPU backend builds
    C++ with the compiler `CXX` names, else the first of its usual names on the PATH."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "clang++", "c++"]
    if any(shutil.which(n) for n in names):
        return None
    return f"no C++ compiler ({', '.join(names)}) is on the PATH, which inductor needs"


def use_cache(directory: Path) -> None:
    """Inductor's caches in `directory` (made if missing), for every compile from now on."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(directory)


def compile_run(run: Run) -> Run:
    """`run` compiled and run once -> its replay."""
    global _COMPILED
    _COMPILED += 1
    # A code object of its own: dynamo keeps its cache entries on the code object.
    code = run.__code__.replace(co_name=f"{run.__code__.co_name}_{_COMPILED}")
    own = types.FunctionType(code, run.__globals__, code.co_name, None, run.__closure__)
    compiled = torch.compile(
        own,
        fullgraph=True,
        dynamic=False,
        options={"cpp_wrapper": True},
    )
    compiled()

    def replay() -> None:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            compiled()

    return replay


def interpreter_note() -> str:
    return f"python {sys.version_info.major}.{sys.version_info.minor}, torch {torch.__version__}"
