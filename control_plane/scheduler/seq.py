"""A request as the scheduler sees it, and the per-sequence state `step_mtp` works on."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Protocol

from opentelemetry.trace import SpanContext

from control_plane.scheduler.methods import HEAD, PLAIN, Method, method
from control_plane.text.detok import Detokenizer, Tokenizer
from control_plane.text.images import Image, ImageSpan, Keyed, keyed
from protos import checks
from protos.handles import Scores
from protos.model import (
    Capabilities,
    FailedPrecondition,
    ModelError,
    Penalties,
    Sampling,
    SequenceHandle,
)
from protos.params import MTP, SamplingParams

if TYPE_CHECKING:  # llguidance is imported only where grammars are compiled
    from control_plane.text.grammar import Grammar

QUEUED_UPDATE_S = 0.25  # the least time between two `Queued` notices to one request
VERDICTS_KEPT = 64  # verdicts a sequence holds for the chooser, which reads them every step


@dataclass(frozen=True)
class GenRequest:
    """What a client asked for, converted from the wire at the API edge."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop: bool = False  # the stop string that ends the text stays in it
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    method: str = MTP  # one of `methods.METHODS`' names
    num_drafts: int | None = None  # cap on this request's drafts; None: the server's
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: alternatives listed beside each generated token
    # The prompt's rows scored (vLLM's prompt_logprobs, OpenAI's echo): None, not scored; else
    # the alternatives each row lists.
    prompt_logprobs: int | None = None
    span_context: SpanContext | None = None  # the request's `generate` span, steps link to it
    grammar: Grammar | None = None  # a compiled grammar its tokens must follow
    sampling: SamplingParams = field(default_factory=SamplingParams)
    penalties: Penalties | None = None  # applied by the service to every row it judges
    # The prompt's images (`Prepared.images`, in the order of their placeholders), each sent
    # with the prefill chunk that holds its first placeholder, again after a preemption; and
    # where their placeholders lie (`Prepared.image_spans`), what the prefix cache keys them by.
    images: tuple[Image, ...] = ()
    image_spans: tuple[ImageSpan, ...] = ()

    @property
    def cache_key(self) -> Keyed:
        """The prompt as the prefix cache names it (`prefix_cache.keyed`)."""
        return keyed(self.prompt_ids, self.image_spans)


@dataclass
class MethodCounts:
    """What one method did for a request: its verifies (plain ones under none), drafts
    verified and accepted."""

    verifies: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, other: MethodCounts) -> None:
        self.verifies += other.verifies
        self.drafted += other.drafted
        self.accepted += other.accepted


@dataclass
class SpecStats:
    steps: int = 0  # scheduler steps the sequence took part in
    verifies: int = 0  # verify calls of its rows (bootstrap and plain decodes included)
    drafted: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    grammar_truncations: int = 0  # verifies whose drafts a grammar cut short
    by_method: dict[str, MethodCounts] = field(default_factory=dict)  # by the drafts' method

    def record(self, drafted: int, accepted: int, by: str = MTP) -> None:
        self.verifies += 1
        self.drafted += drafted
        self.accepted += accepted
        self.by_method.setdefault(by, MethodCounts()).add(MethodCounts(1, drafted, accepted))
        grow = max(0, drafted - len(self.drafted_at))
        self.drafted_at.extend([0] * grow)
        self.accepted_at.extend([0] * grow)
        for j in range(drafted):
            self.drafted_at[j] += 1
            self.accepted_at[j] += int(j < accepted)

    def merge(self, other: SpecStats) -> None:
        self.steps += other.steps
        self.verifies += other.verifies
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.grammar_truncations += other.grammar_truncations
        for name, counts in other.by_method.items():
            self.by_method.setdefault(name, MethodCounts()).add(counts)
        grow = max(0, len(other.drafted_at) - len(self.drafted_at))
        self.drafted_at.extend([0] * grow)
        self.accepted_at.extend([0] * grow)
        for j, (d, a) in enumerate(zip(other.drafted_at, other.accepted_at, strict=True)):
            self.drafted_at[j] += d
            self.accepted_at[j] += a

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verify, the bonus token included."""
        return (self.accepted + self.verifies) / self.verifies if self.verifies else 0.0

    @property
    def acceptance_at(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]


@dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[float]
    # On a request's first delta, when it asked: its prompt's rows scored.
    prompt: PromptScores | None = None
    # Per token, when the request asked `top_logprobs`: that many alternatives, most probable
    # first, and their log-probabilities (of the row its token came from, as `logprobs`).
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass
class PromptScores:
    """A prompt's rows scored, raw: `logprobs[j]` of prompt token j + 1; `top_ids[j]` and
    `top_logprobs[j]` row j's alternatives, the last row's those of the first generated
    token."""

    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def extend(self, s: Scores) -> None:
        self.logprobs += s.logprobs
        self.top_ids += s.top_ids
        self.top_logprobs += s.top_logprobs
        self.ranks += s.ranks


@dataclass(frozen=True)
class Finish:
    reason: str  # stop, length, cancelled, error
    prompt_tokens: int
    completion_tokens: int
    stats: SpecStats
    cached_tokens: int = 0  # of the prompt's, those a cached prefix gave
    prompt: PromptScores | None = None  # the prompt's scores, when no delta carried them


@dataclass(frozen=True)
class Failure:
    code: str  # a gRPC status code name
    message: str


@dataclass(frozen=True)
class Queued:
    """Where a request waiting for a slot stands; sent only to those that ask for it."""

    position: int  # 1: the next to be admitted
    queue_length: int  # requests waiting, this one included


Event = Delta | Finish | Failure
Sink = Callable[[Event], None]
QueueSink = Callable[[Queued], None]


class Observer(Protocol):
    def record_verify(self, drafted: int, accepted: int, method: str) -> None: ...
    def record_tokens(self, count: int, first: bool, seconds: float) -> None: ...


@dataclass(frozen=True)
class ModelFacts:
    """What a sequence needs to know of the served model, from its capabilities, once per
    connection; the defaults stand until the first."""

    max_context: int = 1 << 30  # positions a sequence may hold
    vocab_size: int = 0  # 0: unknown, and `row_mask` masks no EOS by vocabulary
    eos_ids: tuple[int, ...] = ()
    dflash_block: int = 0  # the service's DFlash block (0: it has no DFlash drafter)
    drafters: frozenset[str] = frozenset({MTP})  # what it proposes with (`Capabilities`')

    @classmethod
    def of(cls, caps: Capabilities) -> ModelFacts:
        return cls(
            caps.max_context, caps.vocab_size, caps.eos_token_ids, caps.dflash_block, caps.drafters
        )


class ActiveSeq:
    """One request from submission on: its handle on the service, its drafts, its output so
    far. `facts` is the served model's, replaced whole when a connection brings others."""

    def __init__(
        self,
        req: GenRequest,
        sink: Sink,
        tokenizer: Tokenizer,
        facts: ModelFacts,
        observer: Observer | None = None,
        draft_stop: float | None = None,
        on_queued: QueueSink | None = None,
    ) -> None:
        self.req, self.sink, self.facts = req, sink, facts
        self.tokenizer = tokenizer  # the one its prompt was tokenized with
        self.handle: SequenceHandle | None = None
        # What a prefill puts in the service's cache: the prompt; after a preemption, the
        # prompt and every generated token but the newest (`preempt`).
        self.context: tuple[int, ...] = req.prompt_ids
        self._keyed: tuple[tuple[int, ...], Keyed] = (req.prompt_ids, req.cache_key)
        self.prefilled = 0  # tokens of `context` in the service's cache
        self.preemptions = 0  # times its sequence was freed for the KV pool's sake
        self.prefix_hit = 0  # of them, tokens a cached prefix gave (`prefixing.py`)
        self.snap_points: list[int] = []  # where its prompt is to be snapshotted, ascending
        self.last: int | None = None  # the newest token, not yet in the cache
        self.pending_drafts: list[int] = []
        self.pending_conf: list[float] = []
        self.copy = 0  # drafts of this step copied by prompt lookup (0: none)
        named = method(req.method)
        # A seeded sampled request replays only while its uniforms are spent the same way;
        # the server's choice follows the machine's timing, so such a request keeps the MTP
        # head's drafts at the step's width.
        seeded = req.sampling.seed is not None and req.sampling.temperature > 0
        self.chooses = named.chooses and not seeded  # the server picks `method` each step
        # The strategy it steps with: the one its request names, or the chooser's this step.
        self.method: Method = (HEAD if seeded else PLAIN) if named.chooses else named
        self.drafted_by = self.method.name  # the method whose drafts it holds
        self.cut_all = False  # its grammar cut every draft its next verify was to hold
        # Its verdicts since the chooser last read them: (method, drafted, accepted).
        self.verdicts: deque[tuple[str, int, int]] = deque(maxlen=VERDICTS_KEPT)
        self.draft_stop = draft_stop  # --draft-confidence-stop, as a log-probability
        self.grammar = req.grammar
        self.rng = random.Random(req.sampling.seed)
        self.generated: list[int] = []
        self.finished: str | None = None
        self.failure: Failure | None = None  # a refusal that ends this request alone
        self.stats = SpecStats()
        self.detok = Detokenizer(tokenizer, req.stop, req.include_stop)
        self.observer = observer
        self.submitted = time.monotonic()
        self.scheduled: float | None = None  # first given a slot (the loop stamps it)
        self.first_emit: float | None = None
        self.last_emit: float | None = None
        self.on_queued = on_queued
        self.told: tuple[int, float] | None = None  # the last (position, time) sent on_queued
        # The prompt's scores as its prefill gathers them, sent with the first delta.
        self.scores = PromptScores() if req.prompt_logprobs is not None else None

    @property
    def samples(self) -> bool:
        return self.req.sampling.temperature > 0

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains its next tokens: one that holds only after the output's
        reasoning does not while the model reasons (`cut_drafts` first, then it steps as an
        unconstrained sequence)."""
        return self.grammar is not None and self.grammar.constrains()

    def cut_drafts(self) -> None:
        """Its drafts cut before the first one its grammar refuses (or, for a grammar not
        constraining yet, the first one after which it would)."""
        if self.grammar is None:
            return
        kept = self.grammar.valid_prefix(self.pending_drafts)
        if kept < len(self.pending_drafts):
            self.stats.grammar_truncations += 1
            self.cut_all = kept == 0
            self.pending_drafts = self.pending_drafts[:kept]
            self.pending_conf = self.pending_conf[:kept]

    def sampling(self, draws: int) -> Sampling:
        """This request's sampling parameters with `draws` fresh uniforms: the wire's
        `Sampling` takes the request's knobs by name."""
        params = self.req.sampling
        shared = {f.name: getattr(params, f.name) for f in fields(Sampling) if f.name != "uniforms"}
        return Sampling(**shared, uniforms=tuple(self.rng.random() for _ in range(draws)))

    def tell_place(self, position: int, queue_length: int, now: float) -> None:
        """Send a `Queued` notice: the first at once, later ones only as the request moves
        forward, at most every QUEUED_UPDATE_S."""
        if self.on_queued is None:
            return
        if self.told is not None:
            last, at = self.told
            if position >= last or now - at < QUEUED_UPDATE_S:
                return
        self.told = (position, now)
        self.on_queued(Queued(position, queue_length))

    @property
    def cache_key(self) -> Keyed:
        """`context` as the prefix cache names it (`prefix_cache.keyed`), kept while the
        context stands."""
        if self._keyed[0] is not self.context:
            self._keyed = (self.context, keyed(self.context, self.req.image_spans))
        return self._keyed[1]

    @property
    def max_context(self) -> int:
        return self.facts.max_context

    @property
    def vocab_size(self) -> int:
        return self.facts.vocab_size

    @property
    def drafter(self) -> bool:
        """Whether the service has the drafter its method drafts with."""
        return self.method.ready(self.facts.drafters)

    @property
    def _eos(self) -> tuple[int, ...]:
        return () if self.req.ignore_eos else self.facts.eos_ids

    def row_mask(self, drafts: list[int]) -> bytes:
        """Allowed tokens for the row after `drafts` (uncommitted tokens after the last one):
        the grammar's, and, before `min_new_tokens`, no EOS or stop token (as vLLM masks
        them). Empty when nothing is masked."""
        bits = self.grammar.mask_after(drafts) if self.grammar is not None else b""
        if len(self.generated) + len(drafts) >= self.req.min_new_tokens:
            return bits
        banned = [*self._eos, *self.req.stop_token_ids]
        if not banned or self.vocab_size == 0:
            return bits
        words = -(-self.vocab_size // 32)
        mask = bytearray(bits) if bits else bytearray(_full_mask(self.vocab_size, words))
        for t in banned:
            if t < 8 * len(mask):
                mask[t // 8] &= ~(1 << (t % 8)) & 0xFF
        return bytes(mask)

    @property
    def live_handle(self) -> SequenceHandle:
        """The handle on the service, set at admission."""
        if self.handle is None:
            raise RuntimeError(f"request {self.req.request_id} has no sequence on the service yet")
        return self.handle

    @property
    def last_token(self) -> int:
        """The newest token, not yet in the cache; set once the prompt is prefilled."""
        if self.last is None:
            raise RuntimeError(f"request {self.req.request_id} has not been prefilled yet")
        return self.last

    @property
    def slot(self) -> int:
        assert self.handle is not None
        return self.handle.slot

    @property
    def remaining(self) -> int:
        return self.req.max_new_tokens - len(self.generated)

    @property
    def wants_drafts(self) -> bool:
        return self.method.drafts and self.drafter and self.finished is None and self.remaining > 1

    def gain(
        self,
        tokens: list[int],
        logprobs: list[float] | None = None,
        top: tuple[list[list[int]], list[list[float]]] | None = None,
    ) -> None:
        """Append what the model produced, stopping at EOS, a stop token, a stop string or
        the length; stream the delta, with each token's log-probability and its alternatives
        (`top`: ids and log-probabilities per token) where the request asked. A row whose
        logprob is not finite had logits that were not (NaN, or an infinity): this request
        fails alone, and no NaN leaves."""
        if logprobs is not None and not checks.finite(logprobs[: len(tokens)]):
            self.refuse(
                FailedPrecondition.code,
                f"the model's logits for output token {len(self.generated)} are not finite "
                "(NaN or infinity), so no token can be chosen from them",
            )
            return
        kept: list[int] = []
        for t in tokens:
            early = len(self.generated) < self.req.min_new_tokens
            if not early and (t in self._eos or t in self.req.stop_token_ids):
                self.finished = "stop"
                break
            self.generated.append(t)
            kept.append(t)
            if self.detok.push([t], check_stop=not early):
                self.finished = "stop"
                break
            if self.remaining <= 0:
                self.finished = "length"
                break
        if self.grammar is not None and kept:
            try:
                self.grammar.advance(kept)
            except (ValueError, ModelError) as e:
                code = e.code if isinstance(e, ModelError) else FailedPrecondition.code
                self.refuse(code, str(e))
                return
            if self.finished is None and self.grammar.is_done():
                self.finished = "stop"
            self.grammar = self.grammar.remaining()
        if self.finished is None:
            self.last = tokens[-1]
        if kept:
            self._observe(len(kept))
        lp = list(logprobs[: len(kept)]) if logprobs is not None and self.req.logprobs else []
        ids, values = top if top is not None and self.req.top_logprobs else ([], [])
        text = self.detok.delta(final=self.finished is not None)
        if kept or text:
            self.sink(Delta(kept, text, lp, self.scores, ids[: len(kept)], values[: len(kept)]))
            self.scores = None

    def record_verify(self, drafted: int, accepted: int) -> None:
        """A verify's verdict on the drafts it held (a plain one's counts under none)."""
        by = self.drafted_by if drafted else PLAIN.name
        self.stats.record(drafted, accepted, by)
        # The chooser reads whose proposal a verify followed: one whose drafts a grammar cut
        # all of still ran its drafter's step (counted as none's, it kept a run under a
        # grammar from ever being measured).
        self.verdicts.append((self.drafted_by if self.cut_all else by, drafted, accepted))
        self.cut_all = False
        if self.observer is not None:
            self.observer.record_verify(drafted, accepted, by)

    def _observe(self, count: int) -> None:
        now = time.monotonic()
        if self.observer is not None:
            first = self.last_emit is None
            since = self.submitted if self.last_emit is None else self.last_emit
            self.observer.record_tokens(count, first, now - since)
        if self.last_emit is None:
            self.first_emit = now
        self.last_emit = now

    def preempt(self) -> None:
        """Its sequence was freed to give the KV pool its blocks back: it waits to be admitted
        again, then prefills its prompt and what it generated before its newest token (that one
        is not in the cache yet: its next step verifies it), and goes on from there. Its
        output, grammar and sampler stand; its drafts went with the sequence."""
        self.handle = None
        self.context = (*self.req.prompt_ids, *self.generated[:-1])
        self.prefilled = self.prefix_hit = 0
        self.snap_points = []
        self.pending_drafts, self.pending_conf, self.copy = [], [], 0
        self.preemptions += 1

    def refuse(self, code: str, message: str) -> None:
        """End this request alone with a failure (sent when it retires, after its sequence is
        freed); the others go on."""
        self.finished = "error"
        self.failure = Failure(code, message)

    def finish(self, reason: str) -> None:
        if self.failure is not None:
            self.sink(self.failure)
            return
        if self.finished is None:
            self.finished = reason
        self.sink(
            Finish(
                self.finished,
                len(self.req.prompt_ids),
                len(self.generated),
                self.stats,
                min(self.prefix_hit, len(self.req.prompt_ids)),
                self.scores,
            )
        )

    def fail(self, code: str, message: str) -> None:
        self.finished = "error"
        self.sink(Failure(code, message))


def _full_mask(vocab: int, words: int) -> bytes:
    bits = bytearray(4 * words)
    for t in range(vocab):
        bits[t // 8] |= 1 << (t % 8)
    return bytes(bits)
