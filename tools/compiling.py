"""Compiling the triton forward's kernels for a GPU on a CPU, for `tools.kernel_report`: each launch
caught at `JITFunction.run` and bound as Triton's launcher binds it (`Catcher`), and each
distinct compile built with `triton.compile` for a target and read with the wheel's
`cuobjdump` (`compile_all`, in worker processes)."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from triton.runtime.jit import JITFunction
# Triton itself is imported only once `compiler_mode` has run: importing it under
# TRITON_INTERPRET=1 decorates its own library for the interpreter.


def compiler_mode() -> None:
    """The compiler, not the interpreter, for the kernels this process and its compile
    workers import: Triton reads TRITON_INTERPRET as each kernel module is decorated, so this
    runs before any is imported (a process that imported them interpreted cannot report)."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError(
            "tools.kernel_report compiles in a process of its own "
            "(python -m tools.kernel_report): this one imported triton for its interpreter"
        )
    os.environ.pop("TRITON_INTERPRET", None)
    # Triton 3.9 warns when it is unset; its default (fusion on) is what a GPU's launch compiles.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


_USAGE = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclass
class Variant:
    """One compile: a kernel with its argument types, specialisations and constexprs."""

    kernel: str
    fn: JITFunction = field(repr=False)
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any] = field(repr=False)  # the launch's own: a target adds its arch
    warps: int = 4
    stages: int = 3

    @property
    def label(self) -> str:
        """The kernel and its constexprs: what a table row names."""
        consts = {self.fn.arg_names[p[0]]: v for p, v in self.constexprs.items()}
        return f"{self.kernel}({', '.join(f'{k}={v}' for k, v in consts.items())})"

    @property
    def key(self) -> str:
        consts = {self.fn.arg_names[p[0]]: v for p, v in self.constexprs.items()}
        special = sorted(self.fn.arg_names[p[0]] for p, a in self.attrs.items() if a)
        return (
            f"{self.kernel}({', '.join(f'{k}={v}' for k, v in consts.items())}; "
            f"{','.join(t for t in self.signature.values() if t != 'constexpr')}; "
            f"aligned {','.join(special) or '-'}; warps {self.warps}, stages {self.stages})"
        )


@dataclass(frozen=True)
class Launch:
    phase: str
    batch: int
    kernel: str
    variant: str
    programs: int
    sizes: dict[str, int]  # the launch's integer arguments, by name


class Catcher:
    """Stands in for `JITFunction.run`: binds a launch's arguments as the launcher does, for
    a stand-in target (the binding is the same for every CUDA target), and keeps it."""

    def __init__(self) -> None:
        self.variants: dict[str, Variant] = {}
        self.launches: list[Launch] = []
        self.phase, self.batch = "", 0
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self._backend = make_backend(GPUTarget("cuda", 90, 32))
        self._binders: dict[int, Callable[..., Any]] = {}

    def run(self, fn: JITFunction, args: tuple, grid: Any, kwargs: dict[str, Any]) -> None:
        from triton.runtime.jit import create_function_from_signature

        kwargs = {"debug": False, **kwargs}
        binder = self._binders.get(id(fn))
        if binder is None:
            binder = create_function_from_signature(fn.signature, fn.params, self._backend)
            self._binders[id(fn)] = binder
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(
            self._backend, kwargs, bound, specialization, options
        )
        launch_options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
        variant = Variant(
            fn.__name__,
            fn,
            signature,
            constexprs,
            attrs,
            launch_options,
            options.num_warps,
            options.num_stages,
        )
        self.variants.setdefault(variant.key, variant)
        if callable(grid):
            grid = grid(bound)
        programs = 1
        for g in grid:
            programs *= int(g)
        sizes = {
            p.name: bound[p.name]
            for p in fn.params
            if not p.is_constexpr and type(bound[p.name]) is int
        }
        self.launches.append(
            Launch(self.phase, self.batch, fn.__name__, variant.key, programs, sizes)
        )


@contextmanager
def catching() -> Iterator[Catcher]:
    catcher = Catcher()
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        catcher.run(self, args, grid, kwargs)

    JITFunction.run = run
    try:
        yield catcher
    finally:
        JITFunction.run = original


# -- compiling -------------------------------------------------------------------------------


def for_arch(variant: Variant, arch: int) -> dict[tuple[int, ...], Any]:
    """The variant's constexprs as a launch on a GPU of `arch` (80 for sm_80) would bind them.
    A kernel whose code path depends on the GPU (FP8 tensor cores from sm_89) says so in its
    module's `ARCH_CONSTEXPRS`, name -> value for an arch: a launch caught on `meta` binds
    sm_90's."""
    chosen = getattr(importlib.import_module(variant.fn.module), "ARCH_CONSTEXPRS", {})
    names = variant.fn.arg_names
    return {
        path: chosen[names[path[0]]](arch) if names[path[0]] in chosen else value
        for path, value in variant.constexprs.items()
    }


def compile_variant(variant: Variant, arch: int) -> dict[str, Any]:
    """-> registers, spill (stack) bytes, local bytes, shared bytes, warps, stages, seconds"""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    src = ASTSource(variant.fn, variant.signature, for_arch(variant, arch), variant.attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=variant.options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        dump = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage = _USAGE.search(dump)
    if usage is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {variant.kernel}:\n{dump}")
    return {
        "registers": int(usage[2]),
        "spill_bytes": int(usage[3]),
        "local_bytes": int(usage[5]),
        # cuobjdump counts static shared memory; Triton's is dynamic, in the metadata.
        "shared_bytes": max(int(usage[4]), int(kernel.metadata.shared)),
        "warps": int(kernel.metadata.num_warps),
        "stages": int(kernel.metadata.num_stages),
    }


Job = tuple[str, str, dict, dict, dict, dict, int]


def _compile_job(job: Job) -> dict[str, Any]:
    """A variant named by its kernel's module and name, compiled."""
    module, name, signature, constexprs, attrs, options, arch = job
    fn = getattr(importlib.import_module(module), name)
    return compile_variant(Variant(name, fn, signature, constexprs, attrs, options), arch)


def _compile_alone(job: Job, out: str) -> None:
    """`_compile_job` in a process of its own: its figures written to `out` as JSON, and the
    compiler's stderr to `out`.err (an LLVM failure aborts the process, and says why there)."""
    err = os.open(out + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    Path(out).write_text(json.dumps(_compile_job(job)))


def _alone(context: Any, job: Job) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        proc = context.Process(target=_compile_alone, args=(job, str(out)))
        proc.start()
        proc.join()
        if out.exists():
            return dict(json.loads(out.read_text()))
        err = Path(str(out) + ".err")
        lines = err.read_text().strip().splitlines() if err.exists() else []
        last = lines[-1] if lines else "no message"
        return {"error": f"{last} (the compiler's process exited with {proc.exitcode})"}


def compile_all(jobs: list[tuple[Variant, int]], processes: int) -> list[dict[str, Any]]:
    """Each (variant, arch) compiled by a pool of `processes` workers, forked from a server
    that imported the kernels and ran no torch (a fork of a process that has can deadlock in
    its thread pools). A compile that aborts its worker (LLVM does, on what it cannot
    select) breaks the pool: the compiles it left undone then run each in a process of its
    own, so that the one that aborts fails alone, with its last line."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tools.compiling"])
    specs: list[Job] = [
        (v.fn.module, v.kernel, v.signature, v.constexprs, v.attrs, v.options, arch)
        for v, arch in jobs
    ]
    results: list[dict[str, Any] | None] = [None] * len(specs)
    workers = max(1, min(processes, len(specs)))
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = [pool.submit(_compile_job, spec) for spec in specs]
        for i, future in enumerate(futures):
            try:
                results[i] = future.result()
            except BrokenProcessPool:
                pass
    return [r if r is not None else _alone(context, specs[i]) for i, r in enumerate(results)]
