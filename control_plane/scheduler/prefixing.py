"""The scheduler's side of prefix caching: admitted requests go on from their cached prefixes
(one restore call for all of them), and prefilling ones are snapshotted where the policy
(`prefix_cache.py`) wants, right after the prefill call that reached the point. A refusal
here costs a cache hit, never a request: the request prefills from where it stands."""

from __future__ import annotations

import logging
from bisect import insort

from opentelemetry.context import Context
from opentelemetry.trace import Link
from opentelemetry.util.types import AttributeValue

from control_plane.scheduler.metrics import REPLICA_ATTRIBUTE
from control_plane.scheduler.prefix_cache import PrefixCache
from control_plane.scheduler.seq import ActiveSeq
from control_plane.scheduler.tally import Tally
from protos.model import ModelError, ServingModel
from protos.telemetry import span, tracer

log = logging.getLogger("control_plane.scheduler")
TRACER = tracer("met.control_plane")
HIT_ATTRIBUTE = "met.prefix_hit_tokens"
ANSWER_ATTRIBUTE = "met.prefix_answer_tokens"  # tokens prefilled again to snapshot an answer


def restore(
    model: ServingModel, cache: PrefixCache, admitted: list[ActiveSeq], tally: Tally
) -> None:
    """Each admitted request's cached prefix, restored into its fresh sequence; then where
    its prompt is to be snapshotted while it is prefilled."""
    hits = []
    for a in admitted:
        # A prompt to be scored is prefilled whole: a cached prefix has no rows to score.
        hit = None if a.scores is not None else cache.lookup(a.cache_key)
        if hit is not None:
            hits.append((a, hit))
    links = [Link(a.req.span_context) for a, _ in hits if a.req.span_context is not None]
    restored = sum(h.tokens for _, h in hits)
    with span(TRACER, "prefix_restore", links, **{HIT_ATTRIBUTE: restored}):
        if hits:
            try:
                model.restore_prefixes(
                    [a.live_handle for a, _ in hits], [h.snapshot for _, h in hits]
                )
            except ModelError as e:
                log.warning("restoring %d cached prefixes: %s", len(hits), e)
                for _, h in hits:
                    cache.forget(h.snapshot)
                hits = []
    for a, h in hits:
        a.prefilled = a.prefix_hit = h.tokens
    tally.prefix(sum(len(a.context) for a in admitted), sum(h.tokens for _, h in hits))
    dropped = []
    for a in admitted:
        # With the points a request held behind it asked for (`held`).
        wanted = [p for p in a.snap_points if p > a.prefilled]
        a.snap_points = sorted({*cache.points(a.cache_key, a.prefilled), *wanted})
        dropped += cache.seen(a.cache_key)
    drop(model, dropped)


def held(cache: PrefixCache, a: ActiveSeq, ahead: list[ActiveSeq]) -> bool:
    """Whether `a` waits for a request ahead of it (prefilling, or admitted before it now)
    to reach the whole blocks it shares with `a` past what the cache gives `a`: that one is
    snapshotted there (the point added to its own), and `a` goes on from the snapshot rather
    than prefill the same tokens beside it (SGLang's in-batch prefix caching). It waits no
    longer than that one's prefill up to the point, which it would have spent on the same
    tokens; a snapshot refused ends the wait too, the point being behind."""
    if a.scores is not None:  # a prompt to be scored is prefilled whole: it restores nothing
        return False
    prompt, block = a.cache_key, cache.block
    cached = cache.peek(prompt)
    for b in ahead:
        other = b.cache_key
        shared = 0
        while (
            shared + block < len(prompt)
            and prompt[shared : shared + block] == other[shared : shared + block]
        ):
            shared += block
        if shared > cached and b.prefilled < shared:
            if shared not in b.snap_points:
                insort(b.snap_points, shared)
            return True
    return False


def snapshot(model: ServingModel, cache: PrefixCache, seqs: list[ActiveSeq]) -> None:
    """Snapshots of the sequences the last prefill brought to their next point."""
    due = [
        a
        for a in seqs
        if a.snap_points and a.snap_points[0] == a.prefilled and a.handle is not None
    ]
    if not due:
        return
    for a in due:
        a.snap_points.pop(0)
    # One per prefix: requests admitted together with one start want the same snapshot.
    firsts = {id(a) for a in {a.cache_key[: a.prefilled]: a for a in due}.values()}
    due = [a for a in due if id(a) in firsts][: cache.budget]
    drop(model, cache.evict_for(len(due)))
    try:
        ids = model.snapshot_prefixes([a.live_handle for a in due])
    except ModelError as e:
        log.warning("snapshotting %d prefixes: %s", len(due), e)
        return
    dropped = []
    for a, snap in zip(due, ids, strict=True):
        dropped += cache.taken(a.cache_key, a.prefilled, snap)
    drop(model, dropped)


def forgo(seqs: list[ActiveSeq]) -> None:
    """The snapshots due now are not taken (each would take a block of a pool with none to
    spare): their points pass, so the prefills go on past them."""
    for a in seqs:
        while a.snap_points and a.snap_points[0] <= a.prefilled:
            a.snap_points.pop(0)


def drop(model: ServingModel, snapshots: list[int]) -> None:
    if not snapshots:
        return
    try:
        model.drop_prefixes(snapshots)
    except ModelError as e:
        log.warning("dropping %d prefix snapshots: %s", len(snapshots), e)


def remember(cache: PrefixCache, a: ActiveSeq) -> None:
    """A request that ran to its end leaves its prompt and answer to be snapshotted once the
    loop is idle (`answer`)."""
    if a.finished in ("stop", "length"):
        cache.answers.append((*a.req.cache_key, *a.generated))


def answer(model: ServingModel, cache: PrefixCache, budget: int, replica: str) -> None:
    """The oldest finished request waiting in `cache.answers`: its prompt and answer,
    snapshotted at their last whole block, where the next turn of its chat will resume. Decode
    keeps the GDN state at a block boundary only in the verify buffers of the step that crossed
    it, so the state is computed again: a fresh sequence goes on from the deepest snapshot the
    tokens start with and prefills the rest up to the boundary in whole blocks (the bytes of
    one prefill of all of them). The scheduler calls this only with nothing else to do, in a
    trace of its own, as an iteration is."""
    tokens, block = cache.answers.popleft(), cache.block
    end = len(tokens) // block * block
    hit = cache.deepest(tokens, end)
    start = hit.tokens if hit is not None else 0
    step = budget // block * block
    if end - start < block or step < block:
        return
    rest = tokens[start:end]
    if not all(isinstance(t, int) for t in rest):
        return  # an image's placeholders to prefill again: the cache keeps no image's rows
    attrs: dict[str, AttributeValue] = {
        REPLICA_ATTRIBUTE: replica,
        HIT_ATTRIBUTE: start,
        ANSWER_ATTRIBUTE: end - start,
    }
    with TRACER.start_as_current_span("prefix_answer", context=Context(), attributes=attrs):
        try:
            seq = model.alloc_sequence()
        except ModelError:  # no slot to spare: the next turn resumes from the prompt's snapshot
            return
        try:
            if hit is not None:
                model.restore_prefixes([seq], [hit.snapshot])
            for at in range(start, end, step):
                model.prefill([seq], [[int(t) for t in tokens[at : min(at + step, end)]]])
            drop(model, cache.evict_for(1))
            (snap,) = model.snapshot_prefixes([seq])
            drop(model, cache.taken(tokens, end, snap))
        except ModelError as e:
            log.warning("snapshotting a finished request's answer: %s", e)
        finally:
            model.free_sequence(seq)
