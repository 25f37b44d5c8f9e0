"""The scheduler's prefill: one batched call a loop iteration, each prefilling sequence's next
chunk within the call's token budget; a refusal ends the sequence it concerns alone."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.trace import Link

from control_plane.scheduler.seq import ActiveSeq
from control_plane.text.images import starting_in
from protos.handles import ImageInput, ScoreAsk, Scores
from protos.model import ModelError, Sampling, ServingModel
from protos.telemetry import span, tracer

TRACER = tracer("met.control_plane")


def prefill(
    model: ServingModel, prefilling: list[ActiveSeq], chunk: int, budget: int, block: int = 1
) -> list[ActiveSeq]:
    """The call over each sequence's next chunk (at most `chunk` tokens, `budget` in all); a
    sequence whose whole context is now in gains its first token (one resuming after a
    preemption has it already). -> those sequences."""
    batch, chunks = [], []
    for a in prefilling:
        if budget <= 0:
            break
        n = chunk_length(a, chunk, budget, block)
        if n <= 0:
            continue
        batch.append(a)
        chunks.append(list(a.context[a.prefilled : a.prefilled + n]))
        budget -= n
    if not batch:
        return []
    links = [Link(a.req.span_context) for a in batch if a.req.span_context is not None]
    with span(
        TRACER,
        "prefill",
        links,
        **{"met.sequences": len(batch), "met.tokens": sum(map(len, chunks))},
    ):
        # A preempted request's context ends with tokens it streamed already: none is gained.
        ends = zip(batch, chunks, strict=True)
        last = [a.prefilled + len(c) == len(a.context) and not a.generated for a, c in ends]
        # Grammars and min_new_tokens bind the first generated token too.
        masks = [a.row_mask([]) if end else b"" for a, end in zip(batch, last, strict=True)]
        sampling = [
            a.sampling(1) if a.samples and end else None for a, end in zip(batch, last, strict=True)
        ]
        asks = [_score_ask(a, c) for a, c in zip(batch, chunks, strict=True)]
        # The first generated token's alternatives come as every later token's do.
        tops = [a.req.top_logprobs if end else 0 for a, end in zip(batch, last, strict=True)]
        images = [_images(a, len(c)) for a, c in zip(batch, chunks, strict=True)]
        rows = _rows(model, batch, chunks, Asks(masks, sampling, asks, tops, images))
    done = []
    for a, c, row in zip(batch, chunks, rows, strict=True):
        if row is None:
            continue
        if a.scores is not None and row.scores is not None:
            a.scores.extend(row.scores)
        a.prefilled += len(c)
        if a.prefilled == len(a.context):
            done.append(a)
            if not a.generated:
                a.gain([row.token], [row.logprob], ([row.top_ids], [row.top_logprobs]))
    return done


def chunk_length(a: ActiveSeq, chunk: int, budget: int, block: int) -> int:
    """The sequence's next chunk: up to its next snapshot point or its context's end, at most
    `chunk` and `budget`, and ending on a KV block boundary (`block` tokens, the chunked GDN
    kernel's chunk) unless it ends the prompt: a prompt then leaves the same bytes however its
    prefill is cut, whatever shares the calls, and whether a cached prefix gave its start."""
    end = len(a.context)
    stop = a.snap_points[0] if a.snap_points else end
    n = min(stop - a.prefilled, chunk, budget)
    if a.prefilled + n < end:
        n -= (a.prefilled + n) % block
    return n


def _score_ask(a: ActiveSeq, chunk: list[int]) -> ScoreAsk | None:
    """What a chunk of a prompt to be scored asks: its alternatives, and the token after it
    when the prompt goes on past it (its last row is scored against that one)."""
    if a.scores is None or a.generated:
        return None
    end = a.prefilled + len(chunk)
    after = a.context[end] if end < len(a.context) else None
    return ScoreAsk(a.req.prompt_logprobs or 0, after)


def _images(a: ActiveSeq, n: int) -> list[ImageInput]:
    """The images whose first placeholder is in the sequence's next `n` tokens: the service
    keeps an image's embeddings until its last placeholder is in, in this sequence or in the
    prefix snapshot it was restored from, so no image is sent twice to one sequence (a
    preempted one, prefilled again from its start, sends them again)."""
    if not a.req.images:
        return []
    located = starting_in(a.req.image_spans, a.req.images, a.prefilled, a.prefilled + n)
    return [i.to_input() for i in located]


@dataclass(frozen=True)
class Asks:
    """What a prefill call asks of each sequence besides its chunk."""

    masks: list[bytes]
    sampling: list[Sampling | None]
    scores: list[ScoreAsk | None]
    tops: list[int]  # alternatives of its last row
    images: list[list[ImageInput]]  # the images its chunk starts

    def one(self, i: int) -> Asks:
        at = slice(i, i + 1)
        return Asks(
            self.masks[at], self.sampling[at], self.scores[at], self.tops[at], self.images[at]
        )


@dataclass(frozen=True)
class Row:
    """What a prefill gave one sequence."""

    token: int
    logprob: float
    scores: Scores | None
    top_ids: list[int]
    top_logprobs: list[float]


def _rows(
    model: ServingModel, batch: list[ActiveSeq], chunks: list[list[int]], asks: Asks
) -> list[Row | None]:
    """The prefill call -> each sequence's row, None for one the service refused. A refused
    batch is retried one sequence per call to find the one the refusal concerns (a call is
    checked whole before any of it runs)."""
    scores = asks.scores if any(s is not None for s in asks.scores) else None
    tops = asks.tops if any(asks.tops) else None
    handles = [a.live_handle for a in batch]
    images = asks.images if any(asks.images) else None
    try:
        done = model.prefill(handles, chunks, asks.masks, asks.sampling, scores, tops, images)
    except ModelError as e:
        if len(batch) == 1:
            batch[0].refuse(e.code, str(e))
            return [None]
        return [
            row
            for i in range(len(batch))
            for row in _rows(model, batch[i : i + 1], chunks[i : i + 1], asks.one(i))
        ]
    n = len(batch)
    got = done.scores or [None] * n
    ids, values = done.top_ids or [[]] * n, done.top_logprobs or [[]] * n
    return [Row(*row) for row in zip(done.argmax, done.logprobs, got, ids, values, strict=True)]
