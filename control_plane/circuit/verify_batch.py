"""`met circuit diff --verify-batch`: the batched verify as the scheduler runs it, compared
byte for byte between the reference forward and each other forward.

`n` prompts are prefilled, then verified together step by step with write-on-accept, each
sequence's rows `[last, d1 .. d_{k-1}]`; the drafts come from each sequence's greedy
continuation with one corrupted when `step + sequence` is odd, so full and partial accepts
both occur. After each verify: the accepted rows stashed (with the drafter), the GDN fold of
the batch, each accepted prefix committed; with the drafter, the batched propose and a trim.

Invariants:
- every run after the reference replays the reference's tokens and accept counts, so all
  runs verify the same inputs and commit the same prefixes;
- sequences are allocated in batch order, so their slots are contiguous unless `fragment`
  holds a spare slot before sequence `n / 2`;
- the detection control changes one draft halfway; its difference must be seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.circuit.compare import Comparison, Run, Step, compare
from control_plane.circuit.shapes import (
    batch_prompts,
    batch_shapes,
    capped,
    continuation,
    dedup,
    drafts,
    slot_of,
)
from control_plane.scheduler.verdict import accepted, offsets
from protos.model import Model, SequenceHandle


class DiffError(Exception):
    """The diff could not run as asked (not a verdict)."""


@dataclass(frozen=True)
class BatchStep:
    tokens: list[int]
    accepted: list[int]


@dataclass(frozen=True)
class Setup:
    prompts: list[list[int]]
    fragment: bool
    drafter: int | None  # drafts per propose, or None without the drafter


@dataclass
class ShapeReport:
    ks: list[int]
    accepted: list[list[int]]  # the reference's, per step, per sequence
    comparisons: list[Comparison]
    timings: list[dict]
    detection_control: Comparison


def _propose_all(
    model: Model, seqs: list[SequenceHandle], last: list[int], nd: int, step: Step
) -> None:
    """The batched propose after a step, from stash slots 0..n-1; then each drafter trimmed
    as after a verify that accepted nothing."""
    p = model.run_mtp_propose_batched(last, list(range(len(seqs))), nd, seqs)
    if len(p.drafts) != len(seqs) or any(len(d) != nd for d in p.drafts):
        raise DiffError(f"the batched propose of {len(seqs)} sequences returned a short result")
    step.propose_logits = model.read_logits().data
    step.drafts, step.confidences = p.drafts, p.confidences
    model.trim_proposer_state(seqs)


def _alloc(
    model: Model, n: int, fragment: bool
) -> tuple[list[SequenceHandle], SequenceHandle | None]:
    seqs: list[SequenceHandle] = []
    spare = None
    try:
        for i in range(n):
            if fragment and i == n // 2:
                spare = model.alloc_sequence()
            seqs.append(model.alloc_sequence())
            if seqs[i].slot != slot_of(i, n, fragment):
                raise DiffError(
                    f"sequence {i} took slot {seqs[i].slot}; the widths were "
                    f"capped for slot {slot_of(i, n, fragment)}"
                )
    except BaseException:
        _free(model, seqs, spare, n)
        raise
    return seqs, spare


def _free(model: Model, seqs: list[SequenceHandle], spare: SequenceHandle | None, n: int) -> None:
    """In the seed's order: the upper half last-first, the spare, the lower half last-first."""
    mid = min(n // 2, len(seqs)) if spare is not None else 0
    for s in [*reversed(seqs[mid:]), *([spare] if spare else []), *reversed(seqs[:mid])]:
        model.free_sequence(s)


def run_batch(
    model: Model,
    setup: Setup,
    ks: list[int],
    steps: int,
    greedy: list[list[int]] | None = None,
    replay: list[BatchStep] | None = None,
) -> tuple[list[BatchStep], Run]:
    """One run: the reference (drafts from `greedy`) or a replay of `replay` exactly."""
    n, vocab = len(setup.prompts), model.capabilities().vocab_size
    off = offsets(ks)
    seqs, spare = _alloc(model, n, setup.fragment)
    try:
        prefill, last, prefill_argmax = b"", [], []
        for i, p in enumerate(setup.prompts):
            first = model.prefill([seqs[i]], [p])[0]
            prefill += model.read_logits().data
            last.append(first)
            prefill_argmax.append(first)
        pos = [0] * n
        log: list[BatchStep] = []
        out: list[Step] = []
        enqueue_ms, step_ms = [], []
        for s in range(steps):
            if replay is not None:
                tokens = list(replay[s].tokens)
            else:
                assert greedy is not None
                tokens = [
                    t
                    for i in range(n)
                    for t in [last[i], *drafts(greedy[i], pos[i], s, i, ks[i], vocab)]
                ]
            if not model.can_batch_verify(ks):
                raise DiffError(f"the service refuses a batched verify of {ks}")
            t0 = time.perf_counter()
            argmax = model.decode_verify_batched(tokens, ks, seqs, write_on_accept=True)
            t1 = time.perf_counter()
            step = Step(model.read_logits().data, argmax)
            enqueue_ms.append((t1 - t0) * 1e3)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            na = (
                list(replay[s].accepted)
                if replay is not None
                else [
                    accepted(tokens[off[i] : off[i + 1]], argmax[off[i] : off[i + 1]])
                    for i in range(n)
                ]
            )
            if setup.drafter:
                model.stash_verify_hidden_rows([off[i] + na[i] for i in range(n)])
            model.gdn_fold_accepted(seqs, [a + 1 for a in na])
            model.commit_accepted_prefix(seqs, [a + 1 for a in na], ks)
            for i in range(n):
                nxt = replay[s + 1].tokens[off[i]] if replay and s + 1 < len(replay) else None
                last[i] = nxt if nxt is not None else argmax[off[i] + na[i]]
                pos[i] += na[i] + 1
            if setup.drafter:
                _propose_all(model, seqs, last, setup.drafter, step)
            log.append(BatchStep(tokens, na))
            out.append(step)
        dtype = model.read_logits().dtype
        return log, Run(prefill, prefill_argmax, out, ks, dtype, enqueue_ms, step_ms)
    finally:
        _free(model, seqs, spare, n)


def _timing(name: str, run: Run) -> dict:
    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] if xs else 0.0

    return {
        "variant": name,
        "enqueue_ms": run.enqueue_ms,
        "step_ms": run.step_ms,
        "enqueue_ms_median": median(run.enqueue_ms),
        "step_ms_median": median(run.step_ms),
    }


def diff_verify_batch(
    model: Model,
    widths: list[int],
    ks: list[int],
    fragment: bool,
    mtp: bool,
    num_drafts: int,
    steps: int,
    reference: str,
    forwards: list[str],
    progress: Callable[[str], None] = lambda line: None,
) -> list[ShapeReport]:
    """The reference and every forward for every width at every shape."""
    caps = model.capabilities()
    vocab = caps.vocab_size
    out = []
    for n in widths:
        prompts = batch_prompts(n, vocab)
        model.set_forward(reference)
        greedy = [continuation(model, p, steps * max(ks) + 1) for p in prompts]
        cap = [caps.slot_verify_drafts[slot_of(i, n, fragment)] + 1 for i in range(n)]
        setup = Setup(prompts, fragment, num_drafts if mtp else None)
        for shape in dedup([capped(s, cap) for s in batch_shapes(n, ks)]):
            model.set_forward(reference)
            if mtp:
                # The seed's engine proposes differently on its first propose in a process,
                # so one run is discarded first; kept for parity (ours needs none).
                run_batch(model, setup, shape, 1, greedy=greedy)
            log, ref = run_batch(model, setup, shape, steps, greedy=greedy)
            comparisons, timings = [], [_timing(reference, ref)]
            for name in forwards:
                model.set_forward(name)
                _, run = run_batch(model, setup, shape, steps, replay=log)
                comparisons.append(compare(name, ref, run))
                timings.append(_timing(name, run))
            # The control runs under the last forward, still selected.
            changed = [BatchStep(list(b.tokens), b.accepted) for b in log]
            row = offsets(shape)[n // 2] + shape[n // 2] - 1
            at = steps // 2
            changed[at].tokens[row] = (changed[at].tokens[row] + 1) % vocab
            _, ctl = run_batch(model, setup, shape, steps, replay=changed)
            out.append(
                ShapeReport(
                    shape,
                    [b.accepted for b in log],
                    comparisons,
                    timings,
                    compare("last forward, one draft changed", ref, ctl),
                )
            )
            progress(
                f"verify-batch {shape}: "
                + ", ".join(
                    f"{c.variant} {'equal' if _equal(c) else 'DIFFERS'}" for c in comparisons
                )
            )
    return out


def _equal(c: Comparison) -> bool:
    return c.prefill_equal and c.mismatched_steps == 0


def verify_batch_failures(reports: list[ShapeReport]) -> list[str]:
    """Why the report fails; empty for a pass. A shape whose reference never accepted every
    draft of some sequence, or never rejected one, did not exercise both commits: thin."""
    out = []
    for r in reports:
        for c in r.comparisons:
            if not _equal(c):
                out.append(
                    f"verify-batch {r.ks}, {c.variant}: prefill equal {c.prefill_equal}, "
                    f"{c.mismatched_steps} of {c.steps} steps differ (first at "
                    f"{c.first_mismatch}, sequence {c.first_mismatch_sequence}, row "
                    f"{c.first_mismatch_row})"
                )
        if r.detection_control.mismatched_steps == 0:
            out.append(
                f"verify-batch {r.ks}: the detection control saw no difference after "
                "changing a draft"
            )
        pairs = [(a, k) for step in r.accepted for a, k in zip(step, r.ks, strict=True)]
        full = sum(a == k - 1 for a, k in pairs)
        partial = sum(a < k - 1 for a, k in pairs)
        if full == 0 or partial == 0:
            out.append(
                f"verify-batch {r.ks}: {full} full and {partial} partial accepts; it needs both"
            )
    return out
