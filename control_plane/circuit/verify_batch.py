"""`met circuit diff --verify-batch`: the batched verify as the scheduler runs it, compared
byte for byte between the reference forward and each other forward.

`n` prompts are prefilled, then verified together step by step with write-on-accept, each
sequence's rows `[last, d1 .. d_{k-1}]`; the drafts come from each sequence's greedy
continuation with one corrupted when `step + sequence` is odd, so full and partial accepts
both occur. After each verify: the accepted rows stashed (with the drafter), the GDN fold of
the batch, each accepted prefix committed; with the drafter, the batched propose and a trim.
With `mix`, the sequences of a batch take the roles `mix.py` gives them in turn (one-row
verifies, MTP and DFlash drafts, rows under allowed-token masks), and only the drafting ones
stash and propose.

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
from dataclasses import dataclass, field

from control_plane.circuit import mix
from control_plane.circuit.compare import Comparison, Run, Step, compare
from control_plane.circuit.images import PromptImages, preprocessor, with_images
from control_plane.circuit.shapes import (
    batch_prompts,
    batch_shapes,
    capped,
    continuation,
    dedup,
    drafts,
    prefill_one,
    slot_caps,
    slot_of,
    snapshot_prefix,
)
from control_plane.scheduler.verdict import accepted, offsets
from control_plane.text.preprocessor import Preprocessor
from protos.model import DFLASH, MTP_HEAD, CircuitModel, SequenceHandle, fits_batch


class DiffError(Exception):
    """The diff could not run as asked (not a verdict)."""


@dataclass(frozen=True)
class BatchStep:
    tokens: list[int]
    accepted: list[int]
    masks: dict[int, bytes]  # row -> allowed tokens (the masked sequences' rows)


@dataclass(frozen=True)
class Setup:
    prompts: list[list[int]]
    fragment: bool
    drafter: int | None  # drafts per propose, or None without the drafter
    # Also run each forward with every prompt's start restored from a prefix snapshot, the
    # rest prefilled, and compare it with the same forward's run after a whole prefill.
    snapshot: bool = False
    kind: str = MTP_HEAD  # the sequences' drafter (`alloc_sequence`): the MTP head or DFlash
    # Each sequence's role in a mixed batch (`mix.py`); empty: all alike, as `kind` says.
    roles: tuple[str, ...] = ()
    # Each prompt's images (`images.py`, `--images`); empty: text prompts alone.
    images: tuple[PromptImages, ...] = ()

    def images_of(self, i: int) -> PromptImages:
        return self.images[i] if self.images else PromptImages()

    def kinds(self) -> list[str]:
        """Each sequence's drafter, for `alloc_sequence`."""
        if self.roles:
            return [mix.drafter_of(r) for r in self.roles]
        return [self.kind] * len(self.prompts)

    def proposers(self) -> list[int]:
        """The sequences that stash and propose after each verdict."""
        if self.roles:
            return mix.proposers(self.roles)
        return list(range(len(self.prompts))) if self.drafter else []


@dataclass
class ShapeReport:
    ks: list[int]
    accepted: list[list[int]]  # the reference's, per step, per sequence
    comparisons: list[Comparison]
    timings: list[dict]
    detection_control: Comparison
    roles: list[str] = field(default_factory=list)  # each sequence's, in a mixed batch


def _propose_all(
    model: CircuitModel, seqs: list[SequenceHandle], last: list[int], nd: int, step: Step
) -> None:
    """The batched propose after a step, from stash slots 0..n-1 (each with its own drafter);
    then each drafter trimmed as after a verify that accepted nothing."""
    p = model.run_mtp_propose_batched(last, list(range(len(seqs))), nd, seqs)
    if len(p.drafts) != len(seqs) or any(len(d) != nd for d in p.drafts):
        raise DiffError(f"the batched propose of {len(seqs)} sequences returned a short result")
    step.propose_logits = model.read_logits().data
    step.drafts, step.confidences = p.drafts, p.confidences
    model.trim_proposer_state(seqs)


def _alloc(
    model: CircuitModel, kinds: list[str], fragment: bool
) -> tuple[list[SequenceHandle], SequenceHandle | None]:
    """One sequence per drafter in `kinds`, in order."""
    n = len(kinds)
    seqs: list[SequenceHandle] = []
    spare = None
    try:
        for i, kind in enumerate(kinds):
            if fragment and i == n // 2:
                spare = model.alloc_sequence()
            seqs.append(model.alloc_sequence(drafter=kind))
            if seqs[i].slot != slot_of(i, n, fragment):
                raise DiffError(
                    f"sequence {i} took slot {seqs[i].slot}; the widths were "
                    f"capped for slot {slot_of(i, n, fragment)}"
                )
    except BaseException:
        _free(model, seqs, spare, n)
        raise
    return seqs, spare


def _free(
    model: CircuitModel, seqs: list[SequenceHandle], spare: SequenceHandle | None, n: int
) -> None:
    """In the reverse of allocation order (the upper half last-first, the spare, the lower half
    last-first): a pool that hands out the slot freed last then has its free list back as it
    was, and the next run takes the same slots."""
    mid = min(n // 2, len(seqs)) if spare is not None else 0
    for s in [*reversed(seqs[mid:]), *([spare] if spare else []), *reversed(seqs[:mid])]:
        model.free_sequence(s)


def _last_after(ks: list[int], argmax: list[int], na: list[int]) -> list[int]:
    """Each sequence's next last token: the verify's argmax after its accepted drafts."""
    return [argmax[o + a] for o, a in zip(offsets(ks)[:-1], na, strict=True)]


@dataclass(frozen=True)
class Drafted:
    """The reference's feed: each sequence's rows are its last token and drafts from its greedy
    continuation, a masked sequence's under `mix.row_masks`; the verify's argmaxes decide the
    accepts and the next last token."""

    greedy: list[list[int]]
    vocab: int
    roles: tuple[str, ...] = ()

    def masks(self, s: int, ks: list[int], pos: list[int]) -> dict[int, bytes]:
        if not self.roles:
            return {}
        return mix.row_masks(self.roles, ks, self.greedy, pos, s, self.vocab)

    def tokens(self, s: int, ks: list[int], last: list[int], pos: list[int]) -> list[int]:
        return [
            t
            for i, k in enumerate(ks)
            for t in [last[i], *drafts(self.greedy[i], pos[i], s, i, k, self.vocab)]
        ]

    def accepted(self, s: int, ks: list[int], tokens: list[int], argmax: list[int]) -> list[int]:
        off = offsets(ks)
        return [accepted(tokens[a:b], argmax[a:b]) for a, b in zip(off[:-1], off[1:], strict=True)]

    def next_last(self, s: int, ks: list[int], argmax: list[int], na: list[int]) -> list[int]:
        return _last_after(ks, argmax, na)


@dataclass(frozen=True)
class Replayed:
    """Another run's feed, exactly: its rows and accepts, and as each next last token the
    first row of its next step (after its final step, this run's argmax)."""

    log: list[BatchStep]

    def tokens(self, s: int, ks: list[int], last: list[int], pos: list[int]) -> list[int]:
        return list(self.log[s].tokens)

    def masks(self, s: int, ks: list[int], pos: list[int]) -> dict[int, bytes]:
        return dict(self.log[s].masks)

    def accepted(self, s: int, ks: list[int], tokens: list[int], argmax: list[int]) -> list[int]:
        return list(self.log[s].accepted)

    def next_last(self, s: int, ks: list[int], argmax: list[int], na: list[int]) -> list[int]:
        if s + 1 < len(self.log):
            return [self.log[s + 1].tokens[o] for o in offsets(ks)[:-1]]
        return _last_after(ks, argmax, na)


Feed = Drafted | Replayed


@dataclass
class _Cursor:
    """What a run carries from step to step, per sequence: its last token and how far along
    its greedy continuation it is."""

    last: list[int]
    pos: list[int]


def _prefill_all(
    model: CircuitModel, seqs: list[SequenceHandle], setup: Setup, restored: bool = False
) -> tuple[bytes, list[int], str]:
    """Each prompt prefilled on its own, with its images; `restored`, its last whole block's
    prefix from a snapshot of another sequence and only the rest prefilled (an image whose
    first placeholder the snapshot holds is not sent again). -> (the logits rows, the first
    tokens, their dtype)"""
    data, first, dtype = b"", [], ""
    for i, (seq, prompt) in enumerate(zip(seqs, setup.prompts, strict=True)):
        images = setup.images_of(i)
        start = _restore(model, seq, prompt, images) if restored else 0
        first.append(prefill_one(model, seq, prompt[start:], images.starting(start, len(prompt))))
        logits = model.read_logits()
        data, dtype = data + logits.data, logits.dtype
    return data, first, dtype


def _restore(
    model: CircuitModel,
    seq: SequenceHandle,
    prompt: list[int],
    images: PromptImages | None = None,
) -> int:
    """`seq` made from a snapshot of another sequence that prefilled the prompt's start with
    the images it starts (then freed, and the snapshot dropped: `seq` holds what it needs).
    -> the prefix's length"""
    start = snapshot_prefix(prompt, model.capabilities().kv_block_size)
    donor = model.alloc_sequence()
    try:
        sent = images.starting(0, start) if images is not None else []
        prefill_one(model, donor, prompt[:start], sent)
        (snap,) = model.snapshot_prefixes([donor])
    finally:
        model.free_sequence(donor)
    try:
        model.restore_prefixes([seq], [snap])
    finally:
        model.drop_prefixes([snap])
    return start


def _verify(
    model: CircuitModel,
    tokens: list[int],
    ks: list[int],
    seqs: list[SequenceHandle],
    masks: dict[int, bytes],
    run: Run,
) -> Step:
    """The batched verify with write-on-accept (`masks` on their rows), its time appended to
    `run`."""
    if not fits_batch(model.capabilities(), ks):
        raise DiffError(f"the service refuses a batched verify of {ks}")
    t0 = time.perf_counter()
    verified = model.decode_verify_batched(tokens, ks, seqs, True, masks or None)
    argmax = verified.argmax
    t1 = time.perf_counter()
    step = Step(model.read_logits().data, argmax)
    run.enqueue_ms.append((t1 - t0) * 1e3)
    run.step_ms.append((time.perf_counter() - t0) * 1e3)
    return step


def _commit(
    model: CircuitModel,
    proposers: list[int],
    seqs: list[SequenceHandle],
    ks: list[int],
    na: list[int],
) -> None:
    """After a verify: the proposers' accepted rows stashed for their drafters (stash slot j
    for proposer j), the GDN fold of the batch, each accepted prefix committed."""
    kept = [a + 1 for a in na]
    if proposers:
        off = offsets(ks)
        model.stash_verify_hidden_rows([off[i] + na[i] for i in proposers])
    model.gdn_fold_accepted(seqs, kept)
    model.commit_accepted_prefix(seqs, kept, ks)


def _step(
    model: CircuitModel,
    setup: Setup,
    seqs: list[SequenceHandle],
    ks: list[int],
    s: int,
    feed: Feed,
    cursor: _Cursor,
    run: Run,
) -> BatchStep:
    """Step `s`: verify, commit, advance the cursor; with the drafter, the batched propose of
    the sequences that draft."""
    tokens = feed.tokens(s, ks, cursor.last, cursor.pos)
    masks = feed.masks(s, ks, cursor.pos)
    step = _verify(model, tokens, ks, seqs, masks, run)
    na = feed.accepted(s, ks, tokens, step.argmax)
    proposers = setup.proposers()
    _commit(model, proposers, seqs, ks, na)
    cursor.last = feed.next_last(s, ks, step.argmax, na)
    cursor.pos = [p + a + 1 for p, a in zip(cursor.pos, na, strict=True)]
    if setup.drafter and proposers:
        last = [cursor.last[i] for i in proposers]
        _propose_all(model, [seqs[i] for i in proposers], last, setup.drafter, step)
        step.proposers = proposers
    run.steps.append(step)
    return BatchStep(tokens, na, masks)


def run_batch(
    model: CircuitModel, setup: Setup, ks: list[int], steps: int, feed: Feed, restored: bool = False
) -> tuple[list[BatchStep], Run]:
    """One run of `steps` batched verifies at the widths `ks`, rows and accepts from `feed`;
    `restored`, each prompt's start from a snapshot. -> (what each step fed, so that a replay
    can feed it again; the run's bytes)"""
    n = len(setup.prompts)
    seqs, spare = _alloc(model, setup.kinds(), setup.fragment)
    try:
        prefill, first, dtype = _prefill_all(model, seqs, setup, restored)
        run = Run(prefill, first, [], ks, dtype, [], [])
        cursor = _Cursor(list(first), [0] * n)
        log = [_step(model, setup, seqs, ks, s, feed, cursor, run) for s in range(steps)]
        return log, run
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
    model: CircuitModel,
    widths: list[int],
    ks: list[int],
    fragment: bool,
    mtp: bool,
    num_drafts: int,
    steps: int,
    reference: str,
    forwards: list[str],
    progress: Callable[[str], None] = lambda line: None,
    long_prompt: int = 0,
    snapshot: bool = False,
    dflash: bool = False,
    mixed: bool = False,
    images: bool = False,
) -> list[ShapeReport]:
    """The reference and every forward for every width at every shape; each sequence's width
    capped as the scheduler caps a step's drafts (`slot_caps`); with `long_prompt`, the first
    sequence's prompt that long (`batch_prompts`); with `snapshot`, each forward also from
    prefix snapshots; with `dflash`, the sequences draft with the DFlash drafter and its
    batched block propose is diffed (as `mtp` diffs the MTP head's); with `mixed`, each batch
    mixes the roles of `mix.roles` (DFlash among them where the service has the drafter), and
    every drafting sequence proposes with its own drafter; with `images`, every other prompt
    holds an image (`images.with_images`)."""
    caps = model.capabilities()
    pre = _preprocessor(model) if images else None
    out = []
    for n in widths:
        prompts = batch_prompts(n, caps.vocab_size, long=long_prompt)
        pictures: list[PromptImages] = []
        if pre is not None:
            prompts, pictures = with_images(prompts, pre, caps.kv_block_size or 1)
        cap = slot_caps(caps.slot_verify_drafts, n, fragment, num_drafts)
        kind = DFLASH if dflash and not mixed else MTP_HEAD
        roles = mix.roles(n, caps.dflash_block > 0) if mixed else ()
        drafter = num_drafts if mtp or dflash or mixed else None
        setup = Setup(prompts, fragment, drafter, snapshot, kind, roles, tuple(pictures))
        model.set_forward(reference)
        greedy = [
            continuation(model, p, steps * max(ks) + 1, setup.images_of(i).starting(0, len(p)))
            for i, p in enumerate(prompts)
        ]
        feed = Drafted(greedy, caps.vocab_size, roles)
        shapes = [capped(s, cap) for s in batch_shapes(n, ks)]
        for shape in dedup([mix.widths(s, roles) if mixed else s for s in shapes]):
            progress(
                f"verify-batch {shape}: {steps} steps under {reference}, then {len(forwards)} "
                f"forwards and the detection control"
            )
            report = _diff_shape(model, setup, shape, steps, feed, reference, forwards)
            progress(
                f"verify-batch {shape}: "
                + ", ".join(
                    f"{c.variant} {'equal' if _equal(c) else 'DIFFERS'}" for c in report.comparisons
                )
            )
            out.append(report)
    return out


def _preprocessor(model: CircuitModel) -> Preprocessor:
    pre, why = preprocessor(model)
    if pre is None:
        raise DiffError(f"--images: {why}")
    return pre


def _diff_shape(
    model: CircuitModel,
    setup: Setup,
    shape: list[int],
    steps: int,
    feed: Drafted,
    reference: str,
    forwards: list[str],
) -> ShapeReport:
    """The reference at one shape, each forward replaying it, then the detection control."""
    model.set_forward(reference)
    if setup.drafter:
        # An engine whose first propose in a process differs from every later one would show
        # that difference as the forwards'; one discarded run goes first.
        run_batch(model, setup, shape, 1, feed)
    log, ref = run_batch(model, setup, shape, steps, feed)
    comparisons, timings = [], [_timing(reference, ref)]
    if setup.snapshot:
        comparisons.append(_from_snapshot(model, setup, shape, steps, log, reference, ref))
    for name in forwards:
        model.set_forward(name)
        _, run = run_batch(model, setup, shape, steps, Replayed(log))
        comparisons.append(compare(name, ref, run))
        timings.append(_timing(name, run))
        if setup.snapshot:
            comparisons.append(_from_snapshot(model, setup, shape, steps, log, name, run))
    # The control runs under the last forward, still selected.
    changed = Replayed(_one_draft_changed(log, shape, feed.vocab))
    _, ctl = run_batch(model, setup, shape, steps, changed)
    control = compare("last forward, one draft changed", ref, ctl)
    roles = list(setup.roles)
    return ShapeReport(shape, [b.accepted for b in log], comparisons, timings, control, roles)


def _from_snapshot(
    model: CircuitModel,
    setup: Setup,
    shape: list[int],
    steps: int,
    log: list[BatchStep],
    name: str,
    whole: Run,
) -> Comparison:
    """The forward selected (`name`) replaying `log` with the prompts' starts restored from
    snapshots, against its run after whole prefills: the same bytes, prefill and every step."""
    _, run = run_batch(model, setup, shape, steps, Replayed(log), restored=True)
    return compare(f"{name} from a snapshot", whole, run)


def _one_draft_changed(log: list[BatchStep], shape: list[int], vocab: int) -> list[BatchStep]:
    """`log` with the last row of sequence `n / 2` changed at the middle step: the detection
    control's feed, whose difference a sound comparison must see."""
    n, at = len(shape), len(log) // 2
    row = offsets(shape)[n // 2] + shape[n // 2] - 1
    changed = [BatchStep(list(b.tokens), b.accepted, b.masks) for b in log]
    changed[at].tokens[row] = (changed[at].tokens[row] + 1) % vocab
    return changed


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
        # One-row verifies accept their only row: they count only in a shape of nothing else.
        pairs = [(a, k) for step in r.accepted for a, k in zip(step, r.ks, strict=True)]
        pairs = [(a, k) for a, k in pairs if k > 1] or pairs
        full = sum(a == k - 1 for a, k in pairs)
        partial = sum(a < k - 1 for a, k in pairs)
        if full == 0 or partial == 0:
            out.append(
                f"verify-batch {r.ks}: {full} full and {partial} partial accepts; it needs both"
            )
    return out
