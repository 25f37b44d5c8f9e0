"""One greedy `decode_step` (verify k = 4, settle, 3 drafts), as
tests/gpu_service/test_step_cost.py counts it, on an engine in this process on the check's
device: its kernel launches under `torch.profiler` and its time at each batch size, and its
host syncs under CUDA's sync debug mode."""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from scripts.gpu_check.report import guarded
from scripts.gpu_check.settings import ROOT, Settings

PROMPT = [5, 9, 14, 3, 7, 7, 2, 8]
NUM_DRAFTS = 3


def build_engine(settings: Settings, device: torch.device) -> Engine:
    """Room for the widest batch, each sequence verifying k = 4; one intra-op thread, as the
    service runs its engine (more contend on a small CPU: 700 ms steps instead of 6)."""
    torch.set_num_threads(1)
    width = max(settings.profile_batches)
    svc = ServiceConfig(
        verify_tiers=f"{width}:{NUM_DRAFTS}",
        max_context=256,
        max_rows=width * (NUM_DRAFTS + 1),
        max_batch=width,
    )
    engine = Engine(settings.model, svc, device=device)
    engine.set_forward(settings.forward)
    return engine


def one_step(
    engine: Engine, batch: int, around: AbstractContextManager, results: list | None = None
) -> None:
    """A prefill and a first step that makes every sequence's drafts, then the measured step
    inside `around`; both steps' results onto `results` when given."""
    seqs = [engine.alloc_sequence() for _ in range(batch)]
    try:
        first = engine.prefill(seqs, [PROMPT] * batch).argmax
        res = engine.decode_step(first, [1] * batch, seqs, [True] * batch, NUM_DRAFTS)
        if len(res.proposers) != batch:
            raise RuntimeError(f"{len(res.proposers)} of {batch} sequences got drafts")
        rows = [[res.argmax[i], *res.proposal.drafts[i]] for i in range(batch)]
        tokens = [t for r in rows for t in r]
        with around:
            last = engine.decode_step(
                tokens, [len(r) for r in rows], seqs, [True] * batch, NUM_DRAFTS
            )
        if results is not None:
            results += [res, last]
    finally:
        for s in seqs:
            engine.free_sequence(s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _timed(device: torch.device, out: list[float]) -> Iterator[None]:
    _sync(device)
    t0 = time.perf_counter()
    yield
    _sync(device)
    out.append((time.perf_counter() - t0) * 1e3)


def _is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset"))


def _counts(prof: profile, device: torch.device) -> dict[str, int | None]:
    """CUDA kernels and copies on a GPU; on the CPU, the aten ops (nested ones included)."""
    events = prof.events()
    if device.type != "cuda":
        return {"launches": sum(e.name.startswith("aten::") for e in events), "copies": None}
    gpu = [
        e.name
        for e in events
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    copies = sum(_is_copy(n) for n in gpu)
    return {"launches": len(gpu) - copies, "copies": copies}


def profile_batch(engine: Engine, batch: int, settings: Settings, device: torch.device) -> dict:
    # Triton compiles on a kernel's first launch, and the allocator grows: one step unmeasured.
    one_step(engine, batch, nullcontext())
    times: list[float] = []
    for _ in range(settings.repeats):
        one_step(engine, batch, _timed(device, times))
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    one_step(engine, batch, prof)
    return {
        **_counts(prof, device),
        "ms_per_step": round(statistics.median(times), 3),
        "ms": [round(t, 3) for t in times],
    }


def check_profile(get_engine: Callable[[], Engine], settings: Settings) -> dict:
    engine = get_engine()
    batches = {
        str(b): profile_batch(engine, b, settings, engine.device) for b in settings.profile_batches
    }
    unit = "cuda kernels" if engine.device.type == "cuda" else "aten ops"
    return {
        "ok": all(r["launches"] > 0 for r in batches.values()),
        "summary": ", ".join(
            f"{b}: {r['launches']} {unit}, {r['ms_per_step']:.1f} ms" for b, r in batches.items()
        ),
        "unit": unit,
        "batches": batches,
    }


class SyncWarnings(AbstractContextManager):
    """Every synchronizing CUDA call inside the `with`, as `set_sync_debug_mode("warn")`
    reports them; `sites` are the Python lines that made them."""

    def __init__(self) -> None:
        self.caught: list[warnings.WarningMessage] = []
        self._record = warnings.catch_warnings(record=True)

    def __enter__(self) -> SyncWarnings:
        self.caught = self._record.__enter__()
        # Each sync counts, not only the first from a line.
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._record.__exit__(*exc)

    @property
    def syncs(self) -> list[warnings.WarningMessage]:
        return [w for w in self.caught if "synchroniz" in str(w.message)]

    @property
    def sites(self) -> list[str]:
        def site(w: warnings.WarningMessage) -> str:
            path = Path(w.filename)
            return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{w.lineno}"

        return sorted({site(w) for w in self.syncs})


def check_host_syncs(get_engine: Callable[[], Engine], settings: Settings) -> dict:
    if settings.device != "cuda":
        return {"ok": True, "summary": "not counted off CUDA", "syncs": None}
    engine = get_engine()
    batches = {}
    for b in settings.profile_batches:
        one_step(engine, b, nullcontext())
        caught = SyncWarnings()
        one_step(engine, b, caught)
        batches[str(b)] = {"syncs": len(caught.syncs), "sites": caught.sites}
    return {
        "ok": True,
        "summary": ", ".join(f"{b}: {r['syncs']} syncs" for b, r in batches.items()),
        "syncs": {b: r["syncs"] for b, r in batches.items()},
        "batches": batches,
    }


def step_checks(settings: Settings, device: torch.device) -> dict[str, dict]:
    """The profile and host-sync sections, over one engine built when first asked for."""
    engine = functools.cache(lambda: build_engine(settings, device))
    return {
        "profile": guarded(lambda: check_profile(engine, settings)),
        "host_syncs": guarded(lambda: check_host_syncs(engine, settings)),
    }
