"""A sequence's handle and what the operations return: the types the model contract
(`protos.model`) and the step stream (`protos.steps`) both speak, apart from either."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SequenceHandle:
    """The caller's handle on a sequence the service owns; every reply updates `seq_len`."""

    seq_id: int  # never reused by the service
    slot: int  # state slot: attention KV rows, GDN state, conv window, drafter KV
    seq_len: int = 0  # tokens in the target's cache, mirrored from the last reply


@dataclass(frozen=True)
class RowDraws:
    p_next: float  # target probability of the next row's token (0 for the last row)
    resample: int  # draw from the residual (the target itself when no draft distribution)
    sample: int  # draw from the target
    # The draws' log-probabilities in the row's processed logits (penalties, bias, allowed ids
    # and masks applied; before temperature and the cuts), as a logprobs list reports them.
    resample_logprob: float = 0.0
    sample_logprob: float = 0.0


@dataclass(frozen=True)
class ScoreAsk:
    """A prompt's rows to score in a prefill: `top` alternatives per row (0 to `MAX_TOP`);
    `next_token`, the token after this chunk when the chunk does not end the prompt, which
    its last row is scored against."""

    top: int = 0
    next_token: int | None = None


MAX_TOP = 20  # alternatives a row's score may list, as vLLM and OpenAI bound them


@dataclass(frozen=True)
class ImageInput:
    """One image of a prefill's prompt, as transformers' processor gives it to the model:
    `pixels`, its patch rows [t * h * w, in_channels * temporal_patch_size * patch_size ** 2]
    (`pixel_values`' rows for this image, in the processor's order) as float32 little-endian
    bytes; `grid_thw`, its (t, h, w) in patches (`image_grid_thw`'s row); `digest`, the
    sha256 of the image's bytes, which keys it in the control plane's prefix cache (the
    service names an image by it in a refusal). Its tokens are `t * h * w / merge_size ** 2`
    image tokens in the prompt, the first of them in the prefill that sends it."""

    pixels: bytes
    grid_thw: tuple[int, ...]
    digest: bytes = b""


@dataclass(frozen=True)
class Scores:
    """A prompt chunk's rows scored, raw (the model's log-softmax: no penalty, no mask):
    `logprobs[j]` is row j's log-probability of the token after it (the chunk's next one, or
    `next_token`), one per row but the last when no `next_token` was given; `top_ids[j]` and
    `top_logprobs[j]` are row j's most probable tokens, every row, the last included."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    ranks: list[int] = field(default_factory=list)  # each of `logprobs`' tokens' (1: the first)


@dataclass(frozen=True)
class Prefilled:
    """What a prefill returns: per prompt, its last row's token (the argmax, or the draw of a
    sampling prompt) and that token's log-probability, the scores of the prompts asked for them
    (None for the others), and the alternatives of the last rows asked for them (`top`)."""

    argmax: list[int]
    logprobs: list[float]
    scores: list[Scores | None] = field(default_factory=list)
    # Per prompt: its last row's `top` most probable tokens, most probable first, and their
    # log-probabilities, from the row's processed logits (empty: none asked).
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class Verified:
    """What a batched verify returns, per row in row order: its argmax, that token's
    log-probability, and for a sampling sequence's rows what rejection sampling needs (None on
    a greedy sequence's rows). Every log-probability is of the row's processed logits (what
    the verdict reads: penalties, bias, allowed ids and masks applied), fp32."""

    argmax: list[int]
    logprobs: list[float]
    draws: list[RowDraws | None]
    # Per row of a sequence that samples or asked `top` (0 elsewhere, and on each sequence's
    # last row): its log-probability of the next row's token, the draft that stands if the
    # verdict keeps it.
    next_logprobs: list[float] = field(default_factory=list)
    # Per row: the `top` most probable tokens its sequence asked for, most probable first,
    # and their log-probabilities (empty lists: none asked).
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class Proposal:
    drafts: list[list[int]]  # [sequences][num_drafts]
    confidences: list[list[float]]  # softmax probability of each draft, same layout


@dataclass(frozen=True)
class StepResult:
    """One greedy speculative step (`decode_step`): the verify's rows and what the verdict
    made of them."""

    argmax: list[int]  # every row's argmax, in row order
    logprobs: list[float]  # each argmax's log-probability
    accepted: list[int]  # per sequence: drafts that stood
    proposers: list[int]  # indexes of the sequences that got new drafts
    proposal: Proposal  # their drafts, in `proposers` order
