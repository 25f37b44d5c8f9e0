"""The one way in for every front (the gRPC API, the HTTP one): a request's parameters
(`protos.params`) checked and converted against the served model, handed to the scheduler, its
events on a queue. A request that cannot be taken raises `BadRequest` with its status and a
sentence."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable

import grpc
from opentelemetry.trace import Span

from control_plane.replicas.router import Drives
from control_plane.scheduler.metrics import REPLICA_ATTRIBUTE
from control_plane.scheduler.seq import Event, GenRequest, Queued
from control_plane.text.chat import KWARGS, ChatTemplate, parse_kwargs
from control_plane.text.detok import Tokenizer
from control_plane.text.grammar import Grammar, GrammarCompiler
from control_plane.text.tokenizer import Tokenization
from protos import checks
from protos.model import Capabilities, ModelError, Penalties
from protos.params import MTP, RequestParams, penalties

DEFAULT_METHOD = MTP  # for requests that leave the speculative method unspecified
DEFAULT_MAX_NEW_TOKENS = 256  # for requests that leave max_new_tokens unset
# UTF-8 bytes of a text prompt or a rendered chat, checked before tokenizing: a tokenizer's ids
# and offsets take hundreds of bytes per token, so an unbounded prompt grows the process before
# it is refused.
DEFAULT_MAX_PROMPT_BYTES = 1 << 20
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")  # a request gives exactly one


INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclasses.dataclass(frozen=True)
class Admission:
    """What the server fills in for a request that leaves it unset, and the bound it holds
    every text prompt and rendered chat to; `met control-plane serve` sets each from its
    flag."""

    default_method: str = DEFAULT_METHOD
    default_max_new: int = DEFAULT_MAX_NEW_TOKENS
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES


class BadRequest(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def to_request(
    r: RequestParams,
    tokenizer: Tokenizer,
    caps: Capabilities,
    admission: Admission,
    request_id: str,
    compiler: GrammarCompiler | None = None,
    chat: ChatTemplate | None = None,
) -> GenRequest:
    """The wire request as the scheduler's `GenRequest`, or `BadRequest` with a sentence.
    The fields that need no tokenizer are checked first, the prompt's size before it is
    tokenized, and the grammar compiled last. `chat` is the model's template, for a request
    with messages (None: the model has none)."""
    _check_method(r, caps)
    _check_sampling(r, caps)
    _check_vocab("stop_token_ids", r.stop_token_ids, caps)
    ids = _prompt_ids(r, tokenizer, caps, admission.max_prompt_bytes, chat)
    max_new = _max_new_tokens(r, len(ids), caps, admission.default_max_new)
    if r.min_new_tokens > max_new:
        raise BadRequest(
            INVALID,
            f"min_new_tokens is {r.min_new_tokens}; it must not exceed max_new_tokens ({max_new})",
        )
    pen = _penalties(r, len(ids), caps)
    return GenRequest(
        request_id=request_id,
        prompt_ids=tuple(ids),
        max_new_tokens=max_new,
        min_new_tokens=r.min_new_tokens,
        stop=tuple(r.stop),
        stop_token_ids=tuple(r.stop_token_ids),
        ignore_eos=r.ignore_eos,
        method=r.method or admission.default_method,
        num_drafts=r.num_drafts,
        logprobs=r.logprobs,
        grammar=_grammar(r, compiler),
        sampling=r.sampling,
        penalties=pen,
    )


def _penalties(r: RequestParams, prompt_len: int, caps: Capabilities) -> Penalties | None:
    """The request's penalties and logit bias, checked; None when they change nothing."""
    p = penalties(r.sampling, prompt_len)
    problem = checks.penalties_problem(p, caps.vocab_size)
    if problem is not None:
        raise BadRequest(INVALID, problem)
    return p if p.active else None


def _prompt_ids(
    r: RequestParams,
    tokenizer: Tokenizer,
    caps: Capabilities,
    max_bytes: int,
    chat: ChatTemplate | None,
) -> list[int]:
    given = [name for name in PROMPT_FIELDS if getattr(r, name)]
    if len(given) > 1:
        raise BadRequest(
            INVALID,
            f"give one of prompt, prompt_token_ids and messages; this request has "
            f"{' and '.join(given)}",
        )
    if r.chat_template_kwargs and not r.messages:
        raise BadRequest(
            INVALID, f"{KWARGS} are variables of the chat template; this request has no messages"
        )
    text, field = (_render(r, chat), "the rendered chat") if r.messages else (r.prompt, "prompt")
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise BadRequest(INVALID, f"{field} is {size} bytes; this server takes at most {max_bytes}")
    # A chat is tokenized as transformers tokenizes one: its template wrote the special tokens.
    ids = list(r.prompt_token_ids) or tokenizer.encode(text)
    if not ids:
        raise BadRequest(INVALID, "the prompt is empty")
    _room(len(ids), caps)  # before the vocabulary scan: a context's worth at most
    _check_vocab("prompt_token_ids" if r.prompt_token_ids else "the tokenized prompt", ids, caps)
    return ids


def _render(r: RequestParams, chat: ChatTemplate | None) -> str:
    """The request's messages as prompt text, by the model's chat template."""
    if chat is None:
        raise BadRequest(
            INVALID, "the model has no chat template, so it cannot take messages; send a prompt"
        )
    empty = next((i for i, m in enumerate(r.messages) if not m.role), None)
    if empty is not None:
        raise BadRequest(INVALID, f"messages[{empty}] has an empty role")
    messages = [{"role": m.role, "content": m.content} for m in r.messages]
    generation_prompt = r.add_generation_prompt is None or r.add_generation_prompt
    try:
        return chat.render(messages, generation_prompt, parse_kwargs(r.chat_template_kwargs))
    except ValueError as e:
        raise BadRequest(INVALID, str(e)) from None


def _room(prompt_len: int, caps: Capabilities) -> int:
    """Context positions left after the prompt, at least one."""
    room = caps.max_context - prompt_len
    if room < 1:
        raise BadRequest(
            INVALID,
            f"the prompt has {prompt_len} tokens; the context holds "
            f"{caps.max_context} with room for at least one more",
        )
    return room


def _check_vocab(field: str, ids: Iterable[int], caps: Capabilities) -> None:
    bad = next((t for t in ids if t >= caps.vocab_size), None)
    if bad is not None:
        raise BadRequest(
            INVALID,
            f"{field} holds token id {bad}, outside the vocabulary (0 .. {caps.vocab_size - 1})",
        )


def _max_new_tokens(
    r: RequestParams, prompt_len: int, caps: Capabilities, default_max_new: int
) -> int:
    """The request's token budget: its own, or the server's default cut to the context."""
    room = _room(prompt_len, caps)
    max_new = r.max_new_tokens if r.max_new_tokens is not None else min(default_max_new, room)
    if max_new == 0:
        raise BadRequest(INVALID, "max_new_tokens is 0; ask for at least one token")
    if max_new > room:
        raise BadRequest(
            INVALID,
            f"max_new_tokens is {max_new}; after {prompt_len} prompt tokens "
            f"the context of {caps.max_context} has room for {room}",
        )
    return max_new


def _check_method(r: RequestParams, caps: Capabilities) -> None:
    """The draft count (a method's name is the fronts' to check)."""
    most = max(caps.slot_verify_drafts)
    if r.num_drafts is not None and not 1 <= r.num_drafts <= most:
        raise BadRequest(
            INVALID,
            f"num_drafts is {r.num_drafts}; it must be from 1 to {most}, the most drafts the "
            "GPU service verifies (leave it unset for the server's, or use NONE for no drafts)",
        )


def _check_sampling(r: RequestParams, caps: Capabilities) -> None:
    """temperature, top_p, min_p (their ranges: `checks.FLOATS`) and top_k."""
    s = r.sampling
    for name in ("temperature", "top_p", "min_p"):
        if (problem := checks.number_problem(name, getattr(s, name))) is not None:
            raise BadRequest(INVALID, problem)
    if not -1 <= s.top_k <= caps.vocab_size:
        raise BadRequest(
            INVALID,
            f"top_k is {s.top_k}; it must be at most the vocabulary size {caps.vocab_size} "
            "(0 or -1: no limit)",
        )


def _grammar(r: RequestParams, compiler: GrammarCompiler | None) -> Grammar | None:
    """The compiled `response_format`, or None when the request has none."""
    if r.response_format is None:
        return None
    if compiler is None:
        raise BadRequest(grpc.StatusCode.UNIMPLEMENTED, "this server has no grammar engine")
    kind, text = r.response_format
    try:
        return compiler.compile(kind, text)
    except ValueError as e:
        raise BadRequest(INVALID, f"response_format: {e}") from None


class Door:
    """Admission for one scheduler: the grammar engine is built for the tokenizer in use by
    the first request that carries a grammar, the chat template compiled by the first that
    carries messages, each again when the served model changes."""

    def __init__(self, scheduler: Drives, admission: Admission = Admission()) -> None:
        self.scheduler, self.admission = scheduler, admission
        self._compiler: GrammarCompiler | None = None
        self._compiled_for: Tokenizer | None = None  # the tokenizer `_compiler` was built for
        self._chat: ChatTemplate | None = None
        self._chat_for: Tokenization | None = None  # the files `_chat` was read from

    async def enter(self, request: RequestParams, key: str, span: Span) -> asyncio.Queue:
        """Check, convert and submit the request under `key`; its events (and `Queued`
        notices) arrive on the returned queue. Raises `BadRequest` for a request this server
        will not take, the GPU service out of reach included."""
        caps = await self.capabilities()
        span.set_attribute("gen_ai.request.model", caps.model_name)
        tokenizer = self.scheduler.tokenizer
        compiler = self._grammar_compiler(request, tokenizer, caps)
        chat = self._chat_template(request)
        req = to_request(request, tokenizer, caps, self.admission, key, compiler, chat)
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
        return events

    async def capabilities(self) -> Capabilities:
        """The served model's, connecting first if need be; `BadRequest` with UNAVAILABLE when
        the GPU service is out of reach, or the status of its refusal."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, self.scheduler.capabilities)
        except grpc.RpcError as e:
            raise BadRequest(
                grpc.StatusCode.UNAVAILABLE, f"the GPU service is not reachable: {e.details()}"
            ) from None
        except ModelError as e:  # a served model whose files give no tokenizer, among others
            raise BadRequest(getattr(grpc.StatusCode, e.code), str(e)) from None

    def leave(self, key: str) -> None:
        """The client is gone before its request finished: free its slot."""
        self.scheduler.cancel(key)

    def _grammar_compiler(
        self, request: RequestParams, tokenizer: Tokenizer, caps: Capabilities
    ) -> GrammarCompiler | None:
        """Requests without a `response_format` never touch the grammar engine."""
        if request.response_format is None:
            return None
        if self._compiler is None or self._compiled_for is not tokenizer:
            self._compiler = GrammarCompiler(tokenizer, caps.vocab_size, caps.eos_token_ids)
            self._compiled_for = tokenizer
        return self._compiler

    def _chat_template(self, request: RequestParams) -> ChatTemplate | None:
        """Requests without messages never read the template."""
        if not request.messages:
            return None
        tokenization = self.scheduler.tokenization
        if tokenization is None:  # not connected: `enter` asked for capabilities first
            return None
        if self._chat_for is not tokenization:
            try:
                self._chat = ChatTemplate.from_files(tokenization.files)
            except ValueError as e:
                raise BadRequest(INVALID, f"the model's chat template is unusable: {e}") from None
            self._chat_for = tokenization
        return self._chat
