"""Measured step costs for the control plane's cost model: verify and verdict+propose times
by batch width and depth, on scratch sequences.

A table is keyed by the architecture, the forward, the thread count and the slot tiers: a
different model shape or machine setup measures again. Widths whose slots cannot verify a
depth are left out. A table shipped with the model is read, never written: measurements go
to the cache directory (`cache_dir`).

A measurement runs in short steps (`measurement`): in process they run back to back; the
servicer queues each as its own engine-thread job, so other clients' calls run between them.

Every entry is a median of timed calls, so positive. A draft's cost is a difference of them,
a drafted verdict's over the plain one's, which a busy machine can turn negative: a drafted
cell whose verdict is not above its width's plain one is measured again with it (while the
scratch sequences have room), and what stays short is raised to `DRAFT_FLOOR` of the plain
verdict a draft (`bounded`), so no table, measured or read, has a draft cost of 0 or less."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import torch

from gpu_service.model.config import ModelConfig, ServiceConfig
from protos.model import CircuitModel, CostEntry, InvalidArgument, ResourceExhausted, SequenceHandle


class MeasuredEngine(CircuitModel, Protocol):
    """What a measurement needs of the engine: the `CircuitModel` operations, and what keys its
    table (the service's settings, the checkpoint's directory and config, the forward)."""

    svc: ServiceConfig
    model_dir: Path
    cfg: ModelConfig

    @property
    def forward_name(self) -> str: ...


PROMPT = [(7 * i + 3) % 251 for i in range(16)]
# A measurement takes widths x depths x repeats engine steps; this bounds the last.
MAX_REPEATS = 100
# A measurement in steps (`measurement`); its result is (entries, whether from the cache).
Job = Generator[None, None, tuple[list[CostEntry], bool]]
# Rounds of the short drafted cells measured again, at most, after the first `repeats`.
MORE_ROUNDS = 3
# The least a draft adds to a verdict, as a fraction of the plain (depth 0) verdict: an MTP
# pass is a forward of a layer, never free.
DRAFT_FLOOR = 0.01
MIN_MS = 1e-3  # the least a median of timed calls counts as (the clock's resolution aside)
Clock = Callable[[], float]  # seconds
Times = dict[tuple[int, int], list[tuple[float, float]]]  # cell -> (verify ms, verdict ms) each


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/met/spec_cost`, by default `~/.cache/met/spec_cost`."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "met" / "spec_cost"


def _file_name(model_dir: Path, forward: str, tiers: str) -> str:
    """Keyed by what the costs depend on: the architecture (a digest of config.json: a
    retrained checkpoint of another shape must not read the old costs), the forward, the
    thread count and the tiers."""
    config = model_dir / "config.json"
    arch = hashlib.sha256(config.read_bytes()).hexdigest()[:12] if config.exists() else "none"
    tier_key = tiers.replace(":", "x").replace(",", "_")
    return f"spec_cost.{arch}-{forward}-t{torch.get_num_threads()}-{tier_key}.json"


def cache_path(model_dir: Path, forward: str, tiers: str) -> Path:
    """The table to read: this machine's measurement in the cache directory, else one shipped
    with the model, else where a measurement will go."""
    name = _file_name(model_dir, forward, tiers)
    measured, shipped = cache_dir() / name, model_dir / name
    return shipped if shipped.exists() and not measured.exists() else measured


def check(svc: ServiceConfig, widths: Sequence[int], max_depth: int, repeats: int) -> None:
    """Refuse, before any work, a measurement the service's shape cannot run: widths from 1 to
    `max_batch`, depths up to the widest verify slot's drafts, 1 to `MAX_REPEATS` repeats."""
    if not widths or min(widths) < 1 or max(widths) > svc.max_batch:
        raise InvalidArgument(
            f"measured widths run from 1 to max_batch ({svc.max_batch}); "
            f"asked for {min(widths, default=0)} to {max(widths, default=0)}"
        )
    capacity = max(svc.slot_verify_drafts)
    if max_depth > capacity:
        raise InvalidArgument(
            f"max_depth {max_depth} is over the {capacity} drafts of the widest verify slot"
        )
    if not 1 <= repeats <= MAX_REPEATS:
        raise InvalidArgument(f"repeats {repeats} is outside 1 to {MAX_REPEATS}")
    # Each repeat of each cell commits one token to the scratch sequences, and the last verify
    # and propose need room for 2 * max_depth + 1 more.
    cells = len(set(widths)) * (max_depth + 1)
    if len(PROMPT) + cells * repeats + 2 * max_depth + 1 > svc.max_context:
        raise InvalidArgument(
            f"{cells} cells of {repeats} repeats grow the scratch sequences past the context "
            f"of {svc.max_context} tokens; ask for fewer widths, depths or repeats"
        )


def load(path: Path, widths: list[int], max_depth: int) -> list[CostEntry] | None:
    if not path.exists():
        return None
    entries = bounded([CostEntry(**e) for e in json.loads(path.read_text())["entries"]])
    have = {(e.width, e.depth) for e in entries}
    covered = (
        all((w, 0) in have for w in widths)
        and max((e.depth for e in entries), default=-1) >= max_depth
    )
    return entries if covered else None


def measurement(
    engine: MeasuredEngine,
    widths: list[int],
    max_depth: int,
    repeats: int,
    refresh: bool,
    cached_only: bool = False,
    clock: Clock = time.perf_counter,
) -> Job:
    """The table from the cache unless `refresh` or it falls short, else measured and saved
    (with `cached_only`: else no entries), as a job in steps: each `next` is a short stretch
    of engine work (the cache read with the scratch sequences' allocation and prefill, then
    one repeat of one cell), so a caller that shares the engine can run other work between
    steps. Closing the job between steps frees the scratch sequences. `advance` runs one
    step, `run` all of them; `clock` times the calls (seconds)."""
    check(engine.svc, widths, max_depth, repeats)
    path = cache_path(engine.model_dir, engine.forward_name, engine.svc.verify_tiers)
    if not refresh and (cached := load(path, widths, max_depth)) is not None:
        return cached, True
    if cached_only:
        return [], False
    seqs: list[SequenceHandle] = []
    try:
        _check_free(engine, max(widths))
        for _ in range(max(widths)):
            seqs.append(engine.alloc_sequence())
        engine.prefill(seqs, [PROMPT] * len(seqs))
        entries = yield from _cells(engine, seqs, widths, max_depth, repeats, clock)
    finally:
        for s in seqs:
            engine.free_sequence(s)
    with suppress(OSError):  # an unwritable cache directory: measured, not cached
        save(path, entries)
    return entries, False


def advance(job: Job) -> tuple[list[CostEntry], bool] | None:
    """Runs `job`'s next step: its result (entries, cached) once it has finished, else None."""
    try:
        next(job)
    except StopIteration as done:
        return done.value
    return None


def run(job: Job) -> tuple[list[CostEntry], bool]:
    """Every step of `job`, back to back. -> (entries, cached)"""
    while (result := advance(job)) is None:
        continue
    return result


def _check_free(engine: MeasuredEngine, width: int) -> None:
    free = engine.capabilities().free_slots
    if width > free:
        raise ResourceExhausted(
            f"measuring a width of {width} needs that many free slots; {free} are free"
        )


def _cells(
    engine: MeasuredEngine,
    seqs: list[SequenceHandle],
    widths: list[int],
    max_depth: int,
    repeats: int,
    clock: Clock,
) -> Generator[None, None, list[CostEntry]]:
    """Each (width, depth) the slots allow, timed as the median of `repeats`; a step before
    each timing. The repeats run in rounds over every cell, not cell after cell: the
    machine's drift over the measurement (clock, cache, other processes) then falls on every
    cell alike instead of on the depths measured last, and the cost model compares depths.
    Then the short drafted cells again, with their plain ones (the module's docstring)."""
    caps = engine.svc.slot_verify_drafts
    cells = [
        (w, depth)
        for w in sorted(set(widths))
        for depth in range(max_depth + 1)
        if all(caps[s.slot] >= depth for s in seqs[:w])
    ]
    times: Times = {c: [] for c in cells}
    yield from _rounds(engine, seqs, cells, repeats, times, clock)
    for _ in range(MORE_ROUNDS if engine.cfg.has_mtp else 0):
        again = _short(times)
        room = engine.svc.max_context - seqs[0].seq_len - 2 * max_depth - 1
        if not again or len(again) * repeats > room:
            break
        yield from _rounds(engine, seqs, again, repeats, times, clock)
    return bounded([CostEntry(w, depth, *_medians(times[(w, depth)])) for w, depth in cells])


def _rounds(
    engine: MeasuredEngine,
    seqs: list[SequenceHandle],
    cells: list[tuple[int, int]],
    repeats: int,
    times: Times,
    clock: Clock,
) -> Generator[None, None, None]:
    for _ in range(repeats):
        for w, depth in cells:
            yield
            times[(w, depth)].append(_time_once(engine, seqs[:w], depth, clock))


def _medians(runs: list[tuple[float, float]]) -> tuple[float, float]:
    verify, verdict = (max(MIN_MS, statistics.median(t)) for t in zip(*runs, strict=True))
    return verify, verdict


def _short(times: Times) -> list[tuple[int, int]]:
    """The drafted cells whose verdict is not above their width's plain one, with those plain
    ones: the cells to measure again."""
    verdict = {cell: _medians(runs)[1] for cell, runs in times.items()}
    short = {(w, d) for (w, d), ms in verdict.items() if d and ms <= verdict.get((w, 0), 0.0)}
    return sorted(short | {(w, 0) for w, _ in short if (w, 0) in times})


def bounded(entries: list[CostEntry]) -> list[CostEntry]:
    """Each drafted entry at least its width's plain one: its verify as long (it checks more
    rows), its verdict longer by `DRAFT_FLOOR` of the plain one a draft. So a draft's cost
    (the verdicts' difference) is above 0, and a drafted step costs more than a plain one."""
    plain = {e.width: e for e in entries if e.depth == 0}
    out = []
    for e in entries:
        if e.depth and (p := plain.get(e.width)) is not None:
            least = max(MIN_MS, p.propose_ms) * (1 + DRAFT_FLOOR * e.depth)
            e = CostEntry(e.width, e.depth, max(e.verify_ms, p.verify_ms), max(e.propose_ms, least))
        out.append(e)
    return out


def _time_once(
    engine: MeasuredEngine, group: list[SequenceHandle], depth: int, clock: Clock
) -> tuple[float, float]:
    """A verify of depth + 1 rows per sequence, then its verdict (fold, commit and, for
    depth > 0, a propose of depth drafts). -> (verify ms, verdict ms)"""
    w = len(group)
    t0 = clock()
    engine.decode_verify_batched([1] * (w * (depth + 1)), [depth + 1] * w, group)
    t1 = clock()
    proposers = list(range(w)) if depth and engine.cfg.has_mtp else []
    engine.settle_verdict(
        group, [1] * w, [depth + 1] * w, proposers, [1] * len(proposers), depth if proposers else 0
    )
    return (t1 - t0) * 1e3, (clock() - t1) * 1e3


def save(path: Path, entries: list[CostEntry]) -> None:
    """Into the cache directory under `path`'s name, whichever table `path` is: one shipped
    with the model is read-only."""
    target = cache_dir() / path.name
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps({"entries": [asdict(e) for e in entries]}, indent=1) + "\n")
    scratch.replace(target)
