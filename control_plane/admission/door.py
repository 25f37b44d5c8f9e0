"""The one way in for every front (the gRPC API, the HTTP one): a request's parameters
(`protos.params`) checked and converted against the served model, handed to the scheduler, its
events on a queue. A request that cannot be taken raises `BadRequest` with its status and a
sentence."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import grpc
from opentelemetry.trace import Span

from control_plane.admission.bounds import check_per_step
from control_plane.admission.media import Vision
from control_plane.admission.prompt import check_vocab, overflow_sentence, room
from control_plane.admission.refusal import INVALID, BadRequest
from control_plane.admission.work import Prepared, Preparer, WorkerSetup
from control_plane.admission.workers import AdmissionBounds, Workers
from control_plane.replicas.router import Drives
from control_plane.scheduler.methods import method
from control_plane.scheduler.metrics import REPLICA_ATTRIBUTE
from control_plane.scheduler.seq import Event, GenRequest, Queued
from control_plane.text.chat import ChatTemplate
from control_plane.text.detok import Tokenizer
from control_plane.text.grammar import Grammar, GrammarCompiler
from control_plane.text.images import MediaBounds
from control_plane.text.reasoning import Marks, after_reasoning, marks_of
from control_plane.text.tokenizer import TOKENIZER_FILE, Tokenization
from protos import checks
from protos.handles import MAX_TOP
from protos.model import Capabilities, ModelError, Penalties
from protos.params import AUTO, RequestParams, penalties

T = TypeVar("T")
# For requests that leave the speculative method unspecified: the server's choice each step
# (`control_plane/scheduler/choice.py`), which starts from the MTP head on free text and from
# none under a grammar, and matches the best fixed method on the bundled model
# (`tools/bench/choice.py`); `--method` names another.
DEFAULT_METHOD = AUTO
# For requests that leave max_new_tokens unset: None, the rest of the context (vLLM's).
DEFAULT_MAX_NEW_TOKENS: int | None = None
# UTF-8 bytes of a text prompt or a rendered chat, checked before tokenizing: a tokenizer's ids
# and offsets take hundreds of bytes per token, so an unbounded prompt grows the process before
# it is refused.
DEFAULT_MAX_PROMPT_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Admission:
    """What the server fills in for a request that leaves it unset, the bound it holds
    every text prompt and rendered chat to, and the bounds of the work a request's template,
    tools and grammar cost; `met control-plane serve` sets each from its flag."""

    default_method: str = DEFAULT_METHOD
    default_max_new: int | None = DEFAULT_MAX_NEW_TOKENS
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    bounds: AdmissionBounds = AdmissionBounds()
    # The names the model is served under (vLLM's `--served-model-name`; the first is the one
    # reported); empty: the checkpoint's own.
    model_names: tuple[str, ...] = ()
    # Chat template variables for every chat (vLLM's `--default-chat-template-kwargs`, such as
    # {"enable_thinking": false}); a request's own `chat_template_kwargs` override them by name.
    chat_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # What a request's images may take (`--limit-mm-per-prompt`, `--max-image-bytes`,
    # `--max-image-file-pixels`) and where `file://` URLs may read (`--allowed-local-media-path`).
    media: MediaBounds = MediaBounds()


@dataclasses.dataclass(frozen=True)
class ChatShape:
    """What a chat's output may hold beside text, for the fronts that split it (the OpenAI
    one): calls of `tools` (None: calls stay text), reasoning, already opened by the prompt."""

    tools: dict[str, dict[str, Any]] | None = None
    reasoning: bool = False
    opened: bool = False
    parallel: bool = True


@dataclasses.dataclass(frozen=True)
class Entered:
    """A request taken: its events (and `Queued` notices) on `events`, what it became."""

    events: asyncio.Queue
    request: GenRequest
    shape: ChatShape = ChatShape()


def admit(
    r: RequestParams,
    tokenizer: Tokenizer,
    caps: Capabilities,
    admission: Admission,
    request_id: str,
    compiler: GrammarCompiler | None = None,
    chat: ChatTemplate | None = None,
    files: Mapping[str, bytes] | None = None,
) -> tuple[GenRequest, ChatShape]:
    """The wire request as the scheduler's `GenRequest` and its chat's `ChatShape`, or
    `BadRequest` with a sentence, all in this thread (`Door` runs the costly part in a
    worker). `chat` is the model's template, for a request with messages (None: the model has
    none); `files` the checkpoint's (`TOKENIZER_FILES`), which say whether it takes images
    (None: it takes none)."""
    check(r, caps, admission.default_method)
    vision = Vision.of(files, admission.media) if files is not None else None
    preparer = Preparer(
        tokenizer, chat, lambda: compiler, chat_kwargs=admission.chat_kwargs, vision=vision
    )
    prepared = preparer.prepare(r, caps, admission.max_prompt_bytes)
    grammar = compiler.matcher(prepared.grammar) if compiler and prepared.grammar else None
    marks = partial(marks_of, compiler) if compiler else None
    return finish(r, prepared, caps, admission, request_id, grammar, marks)


def check(r: RequestParams, caps: Capabilities, default_method: str = DEFAULT_METHOD) -> None:
    """The fields that need neither a tokenizer nor a worker, checked before either runs."""
    _check_method(r, caps, default_method)
    _check_sampling(r, caps)
    check_vocab("stop_token_ids", r.stop_token_ids, caps)
    check_per_step(r)
    if r.thinking_token_budget is not None and r.thinking_token_budget < 0:
        raise BadRequest(
            INVALID,
            f"thinking_token_budget is {r.thinking_token_budget}; it must be 0 or more",
            "thinking_token_budget",
        )


def finish(
    r: RequestParams,
    prepared: Prepared,
    caps: Capabilities,
    admission: Admission,
    request_id: str,
    grammar: Grammar | None,
    marks: Callable[[], Marks] | None = None,
) -> tuple[GenRequest, ChatShape]:
    """A request whose costly part is done (`prepared`, its grammar's matcher built) as the
    scheduler's `GenRequest` and its chat's `ChatShape`; its grammar follows the output's
    reasoning where the chat's template opens it (`marks`: the vocabulary's, given whenever
    `needs_compiler`)."""
    ids = prepared.ids
    max_new = _max_new_tokens(r, len(ids), caps, admission.default_max_new)
    if r.min_new_tokens > max_new:
        raise BadRequest(
            INVALID,
            f"min_new_tokens is {r.min_new_tokens}; it must not exceed max_new_tokens ({max_new})",
            "min_tokens",
        )
    pen = _penalties(r, len(ids), caps)
    if marks is not None:
        budget = r.thinking_token_budget
        grammar = after_reasoning(grammar, marks, prepared.reasoning, budget, max_new)
    tools = prepared.tools
    shape = ChatShape(
        tools if tools and r.tool_choice != "none" else None,
        prepared.thinks,
        prepared.opened,
        r.parallel_tool_calls is not False,
    )
    return GenRequest(
        request_id=request_id,
        prompt_ids=ids,
        max_new_tokens=max_new,
        min_new_tokens=r.min_new_tokens,
        stop=tuple(r.stop),
        include_stop=r.include_stop_str_in_output,
        stop_token_ids=tuple(r.stop_token_ids),
        ignore_eos=r.ignore_eos,
        method=r.method or admission.default_method,
        num_drafts=r.num_drafts,
        logprobs=r.logprobs,
        top_logprobs=_top_logprobs(r),
        prompt_logprobs=_prompt_logprobs(r),
        grammar=grammar,
        sampling=r.sampling,
        penalties=pen,
        images=prepared.images,
        image_spans=prepared.image_spans,
    ), shape


def needs_compiler(r: RequestParams, prepared: Prepared) -> bool:
    """Whether the request's output has a grammar: its own, or a reasoning budget's."""
    budget = r.thinking_token_budget is not None and bool(prepared.reasoning)
    return prepared.grammar is not None or budget


def _top_logprobs(r: RequestParams) -> int:
    if not 0 <= r.top_logprobs <= MAX_TOP:
        raise BadRequest(
            INVALID,
            f"top_logprobs is {r.top_logprobs}; it must be from 0 to {MAX_TOP}",
            "top_logprobs",
        )
    if r.top_logprobs and not r.logprobs:
        raise BadRequest(INVALID, "top_logprobs needs logprobs: true", "top_logprobs")
    return r.top_logprobs


def _prompt_logprobs(r: RequestParams) -> int | None:
    if r.prompt_logprobs is not None and not 0 <= r.prompt_logprobs <= MAX_TOP:
        raise BadRequest(
            INVALID,
            f"prompt_logprobs is {r.prompt_logprobs}; it must be from 0 to {MAX_TOP}",
            "prompt_logprobs",
        )
    return r.prompt_logprobs


def _penalties(r: RequestParams, prompt_len: int, caps: Capabilities) -> Penalties | None:
    """The request's penalties and logit bias, checked; None when they change nothing."""
    p = penalties(r.sampling, prompt_len)
    problem = checks.penalties_problem(p, caps.vocab_size)
    if problem is not None:
        # The sentence opens with the field it is about.
        raise BadRequest(INVALID, problem, problem.split(" ", 1)[0])
    return p if p.active else None


def _max_new_tokens(
    r: RequestParams, prompt_len: int, caps: Capabilities, default_max_new: int | None
) -> int:
    """The request's token budget: its own, or the server's default (None: the rest of the
    context) cut to the context."""
    left = room(prompt_len, caps)
    default = left if default_max_new is None else min(default_max_new, left)
    max_new = r.max_new_tokens if r.max_new_tokens is not None else default
    if max_new == 0:
        raise BadRequest(INVALID, "max_new_tokens is 0; ask for at least one token", "max_tokens")
    if max_new > left:
        sentence = overflow_sentence(caps.max_context, prompt_len + max_new, prompt_len, max_new)
        raise BadRequest(INVALID, sentence, "max_tokens")
    return max_new


def _check_method(r: RequestParams, caps: Capabilities, default: str) -> None:
    """The method's drafter on this service, and the draft count (a method's name is the
    fronts' to check)."""
    chosen = method(r.method or default)
    refusal = chosen.refusal(caps)
    if refusal is not None:
        raise BadRequest(INVALID, refusal, "speculative")
    most = chosen.most_drafts(caps)
    if r.num_drafts is not None and not 1 <= r.num_drafts <= most:
        raise BadRequest(
            INVALID,
            f"num_drafts is {r.num_drafts}; it must be from 1 to {most}, the most drafts the "
            "GPU service verifies (leave it unset for the server's, or use NONE for no drafts)",
            "speculative",
        )


def _check_sampling(r: RequestParams, caps: Capabilities) -> None:
    """temperature, top_p, min_p (their ranges: `checks.FLOATS`) and top_k."""
    s = r.sampling
    for name in ("temperature", "top_p", "min_p"):
        if (problem := checks.number_problem(name, getattr(s, name))) is not None:
            raise BadRequest(INVALID, problem, name)
    if not -1 <= s.top_k <= caps.vocab_size:
        raise BadRequest(
            INVALID,
            f"top_k is {s.top_k}; it must be at most the vocabulary size {caps.vocab_size} "
            "(0 or -1: no limit)",
            "top_k",
        )


def _costly(r: RequestParams) -> bool:
    """Whether the request carries work whose cost it chooses: a chat (its template), tools,
    a template of its own, or a grammar."""
    constrains = r.tool_choice not in ("", "auto", "none")
    return bool(r.messages or r.tools or r.chat_template or r.response_format or constrains)


class Door:
    """Admission for one scheduler. A request's costly part (`work.Preparer`: its tools, its
    chat rendered, its prompt tokenized, its grammar checked) runs in a worker process under
    the admission bounds when it carries a chat, tools or a grammar, and in a thread when it is
    a plain prompt; the event loop only awaits. The grammar engine of this process (matchers
    for the scheduler) is built by the first request that carries a grammar, again when the
    served model changes."""

    def __init__(self, scheduler: Drives, admission: Admission = Admission()) -> None:
        self.scheduler, self.admission = scheduler, admission
        self.workers = Workers(admission.bounds)
        # Threads that wait on the workers, tokenize plain prompts and build matchers.
        self._threads = ThreadPoolExecutor(4 * admission.bounds.workers, "admission")
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        self._compiled_for: Tokenizer | None = None  # the tokenizer `_compiler` was built for
        self._local: Preparer | None = None  # for plain prompts, in this process
        self._local_for: Tokenizer | None = None
        self._setup: WorkerSetup | None = None
        self._setup_for: Tokenization | None = None

    async def enter(self, request: RequestParams, key: str, span: Span) -> Entered:
        """Check, convert and submit the request under `key`; its events (and `Queued`
        notices) arrive on the returned queue. Raises `BadRequest` for a request this server
        will not take, the GPU service out of reach included."""
        caps = await self.capabilities()
        span.set_attribute("gen_ai.request.model", caps.model_name)
        tokenizer = self.scheduler.tokenizer
        check(request, caps, self.admission.default_method)
        prepared = await self._prepare(request, caps)
        grammar, marks = None, None
        if needs_compiler(request, prepared):
            compiler = self._grammar_compiler(tokenizer, caps)
            marks = partial(marks_of, compiler)
            if prepared.grammar is not None:
                grammar = await self._in_thread(compiler.matcher, prepared.grammar)
        req, shape = finish(request, prepared, caps, self.admission, key, grammar, marks)
        req = dataclasses.replace(req, span_context=span.get_span_context())
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(ev: Event | Queued) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            replica = self.scheduler.submit(req, sink, sink, tokenizer)
        except ModelError as e:
            raise BadRequest(getattr(grpc.StatusCode, e.code), str(e)) from None
        span.set_attribute(REPLICA_ATTRIBUTE, replica)
        return Entered(events, req, shape)

    async def tokenize(self, request: RequestParams) -> list[int]:
        """The prompt's ids as a generation would see them (a chat rendered by its template);
        `BadRequest` with a sentence."""
        caps = await self.capabilities()
        return list((await self._prepare(request, caps)).ids)

    async def capabilities(self) -> Capabilities:
        """The served model's, connecting first if need be; `BadRequest` with UNAVAILABLE when
        the GPU service is out of reach, or the status of its refusal."""
        loop = asyncio.get_running_loop()
        try:
            caps = await loop.run_in_executor(None, self.scheduler.capabilities)
        except grpc.RpcError as e:
            raise BadRequest(
                grpc.StatusCode.UNAVAILABLE, f"the GPU service is not reachable: {e.details()}"
            ) from None
        except ModelError as e:  # a served model whose files give no tokenizer, among others
            raise BadRequest(getattr(grpc.StatusCode, e.code), str(e)) from None
        names = self.admission.model_names
        return dataclasses.replace(caps, model_name=names[0]) if names else caps

    def model_names(self, caps: Capabilities) -> tuple[str, ...]:
        """Every name the model answers to, the reported one first."""
        return self.admission.model_names or (caps.model_name,)

    def check_model(self, name: str | None, caps: Capabilities) -> None:
        """`BadRequest` (NOT_FOUND, naming the model) unless `name` is None or one of the
        served model's names."""
        if name is not None and name not in self.model_names(caps):
            raise BadRequest(
                grpc.StatusCode.NOT_FOUND,
                f"model {name!r} is not served here; this server serves {caps.model_name!r} "
                "(GET /v1/models)",
                "model",
            )

    def leave(self, key: str) -> None:
        """The client is gone before its request finished: free its slot."""
        self.scheduler.cancel(key)

    def warm(self) -> None:
        """Set the workers up for the served model (blocking; where it is known): the first
        chats then wait for no tokenizer to load."""
        tokenization = getattr(self.scheduler, "tokenization", None)
        if tokenization is None or TOKENIZER_FILE not in tokenization.files:
            return
        try:
            caps = self.scheduler.capabilities()
        except (grpc.RpcError, ModelError):
            return  # the first request connects, and says why it cannot
        self.workers.warm(self._setup_of(tokenization, caps))

    def close(self) -> None:
        """End the workers; requests that need one are refused from now on."""
        self.workers.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def _prepare(self, r: RequestParams, caps: Capabilities) -> Prepared:
        bound = self.admission.max_prompt_bytes
        tokenization = getattr(self.scheduler, "tokenization", None)
        # A tokenizer handed over as an object (no files: tests' fakes) cannot reach a worker.
        if tokenization is not None and TOKENIZER_FILE in tokenization.files and _costly(r):
            setup = self._setup_of(tokenization, caps)
            return await self._in_thread(self.workers.run, setup, r, caps, bound)
        return await self._in_thread(self._preparer(caps).prepare, r, caps, bound)

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    def _setup_of(self, tokenization: Tokenization, caps: Capabilities) -> WorkerSetup:
        if self._setup_for is not tokenization:
            kwargs, media = self.admission.chat_kwargs, self.admission.media
            digest = f"{tokenization.digest}:{caps.vocab_size}:{caps.eos_token_ids}:{kwargs}"
            self._setup = WorkerSetup(
                tokenization.files,
                tokenization.origin,
                caps.vocab_size,
                caps.eos_token_ids,
                f"{digest}:{media}",
                kwargs,
                media,
            )
            self._setup_for = tokenization
        assert self._setup is not None
        return self._setup

    def _preparer(self, caps: Capabilities) -> Preparer:
        """This process's own, for plain prompts, and for schedulers that hold a tokenizer
        but no checkpoint files (tests' fakes), whose model has no chat template."""
        tokenizer = self.scheduler.tokenizer
        with self._lock:
            if self._local is None or self._local_for is not tokenizer:
                compiler = lambda: self._grammar_compiler(tokenizer, caps)  # noqa: E731
                kwargs = self.admission.chat_kwargs
                local = Preparer(tokenizer, None, compiler, chat_kwargs=kwargs)
                self._local, self._local_for = local, tokenizer
            return self._local

    def _grammar_compiler(self, tokenizer: Tokenizer, caps: Capabilities) -> GrammarCompiler:
        """Built by the first request that carries a grammar: requests without one never
        touch the grammar engine."""
        with self._lock:
            if self._compiler is None or self._compiled_for is not tokenizer:
                try:
                    self._compiler = GrammarCompiler(tokenizer, caps.vocab_size, caps.eos_token_ids)
                except ValueError as e:
                    raise BadRequest(grpc.StatusCode.UNIMPLEMENTED, str(e)) from None
                self._compiled_for = tokenizer
            return self._compiler
