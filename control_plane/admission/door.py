"""The one way in for every front (the gRPC API, the HTTP one): a request's parameters
(`protos.params`) checked and converted against the served model, handed to the scheduler, its
events on a queue. A request that cannot be taken raises `BadRequest` with its status and a
sentence."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from typing import Any

import grpc
from opentelemetry.trace import Span

from control_plane.admission.chats import check_tools, output_format, render
from control_plane.admission.refusal import INVALID, BadRequest
from control_plane.replicas.router import Drives
from control_plane.scheduler.metrics import REPLICA_ATTRIBUTE
from control_plane.scheduler.seq import Event, GenRequest, Queued
from control_plane.text.chat import KWARGS, ChatTemplate
from control_plane.text.detok import Tokenizer
from control_plane.text.grammar import Grammar, GrammarCompiler
from control_plane.text.tokenizer import Tokenization
from control_plane.text.tools import (
    THINK_OPEN,
)
from protos import checks
from protos.handles import MAX_TOP
from protos.model import Capabilities, ModelError, Penalties
from protos.params import DFLASH, MTP, RequestParams, penalties

DEFAULT_METHOD = MTP  # for requests that leave the speculative method unspecified
# For requests that leave max_new_tokens unset: None, the rest of the context (vLLM's).
DEFAULT_MAX_NEW_TOKENS: int | None = None
# UTF-8 bytes of a text prompt or a rendered chat, checked before tokenizing: a tokenizer's ids
# and offsets take hundreds of bytes per token, so an unbounded prompt grows the process before
# it is refused.
DEFAULT_MAX_PROMPT_BYTES = 1 << 20
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")  # a request gives exactly one
OWN_TEMPLATES = 16  # requests' own chat templates kept compiled, the oldest dropped first


@dataclasses.dataclass(frozen=True)
class Admission:
    """What the server fills in for a request that leaves it unset, and the bound it holds
    every text prompt and rendered chat to; `met control-plane serve` sets each from its
    flag."""

    default_method: str = DEFAULT_METHOD
    default_max_new: int | None = DEFAULT_MAX_NEW_TOKENS
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES


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
) -> tuple[GenRequest, ChatShape]:
    """The wire request as the scheduler's `GenRequest` and its chat's `ChatShape`, or
    `BadRequest` with a sentence. The fields that need no tokenizer are checked first, the
    prompt's size before it is tokenized, and the grammar compiled last. `chat` is the
    model's template, for a request with messages (None: the model has none)."""
    _check_method(r, caps)
    _check_sampling(r, caps)
    _check_vocab("stop_token_ids", r.stop_token_ids, caps)
    tools = check_tools(r)
    ids, opened = _prompt_ids(r, tokenizer, caps, admission.max_prompt_bytes, chat, tools)
    max_new = _max_new_tokens(r, len(ids), caps, admission.default_max_new)
    if r.min_new_tokens > max_new:
        raise BadRequest(
            INVALID,
            f"min_new_tokens is {r.min_new_tokens}; it must not exceed max_new_tokens ({max_new})",
            "min_tokens",
        )
    pen = _penalties(r, len(ids), caps)
    form = output_format(r, tools, chat)
    shape = ChatShape(
        tools if tools and r.tool_choice != "none" else None,
        chat is not None and chat.thinks,
        opened,
        r.parallel_tool_calls is not False,
    )
    return GenRequest(
        request_id=request_id,
        prompt_ids=tuple(ids),
        max_new_tokens=max_new,
        min_new_tokens=r.min_new_tokens,
        stop=tuple(r.stop),
        include_stop=r.include_stop_str_in_output,
        stop_token_ids=tuple(r.stop_token_ids),
        ignore_eos=r.ignore_eos,
        method=r.method or admission.default_method,
        num_drafts=r.num_drafts,
        logprobs=r.logprobs,
        prompt_logprobs=_prompt_logprobs(r),
        grammar=_grammar(form, compiler),
        sampling=r.sampling,
        penalties=pen,
    ), shape


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


def _prompt_ids(
    r: RequestParams,
    tokenizer: Tokenizer,
    caps: Capabilities,
    max_bytes: int,
    chat: ChatTemplate | None,
    tools: dict[str, dict[str, Any]],
) -> tuple[list[int], bool]:
    """The prompt's ids, and whether it ends inside an opened reasoning block."""
    given = [name for name in PROMPT_FIELDS if getattr(r, name)]
    if len(given) > 1:
        raise BadRequest(
            INVALID,
            f"give one of prompt, prompt_token_ids and messages; this request has "
            f"{' and '.join(given)}",
            "prompt",
        )
    if r.chat_template_kwargs and not r.messages:
        raise BadRequest(
            INVALID,
            f"{KWARGS} are variables of the chat template; this request has no messages",
            KWARGS,
        )
    text, field = (render(r, chat), "the rendered chat") if r.messages else (r.prompt, "prompt")
    opened = bool(r.messages) and text.rstrip().endswith(THINK_OPEN)
    size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise BadRequest(
            INVALID,
            f"{field} is {size} bytes; this server takes at most {max_bytes}",
            "messages" if r.messages else "prompt",
        )
    # A chat is tokenized as transformers tokenizes one: its template wrote the special tokens.
    ids = list(r.prompt_token_ids) or tokenizer.encode(text)
    if not ids:
        raise BadRequest(INVALID, "the prompt is empty", "prompt")
    if r.truncate_prompt_tokens is not None:
        # 0: as many as the context holds with room for one more (vLLM's -1).
        keep = r.truncate_prompt_tokens or caps.max_context - 1
        ids = ids[-keep:]
    # Before the vocabulary scan: a context's worth at most.
    _room(len(ids), caps, "messages" if r.messages else "prompt")
    _check_vocab(
        "prompt_token_ids" if r.prompt_token_ids else "the tokenized prompt", ids, caps, "prompt"
    )
    return ids, opened


def overflow_sentence(max_context: int, asked: int, prompt_len: int, new: int) -> str:
    """vLLM's sentence for a request of `asked` tokens in all past a context of
    `max_context`, `prompt_len` of them the prompt's."""
    return (
        f"This model's maximum context length is {max_context} tokens. However, you requested "
        f"{asked} tokens ({prompt_len} in the messages, {new} in the completion). Please reduce "
        "the length of the messages or completion."
    )


def _room(prompt_len: int, caps: Capabilities, param: str = "messages") -> int:
    """Context positions left after the prompt, at least one."""
    room = caps.max_context - prompt_len
    if room < 1:
        sentence = overflow_sentence(caps.max_context, prompt_len + 1, prompt_len, 1)
        raise BadRequest(INVALID, sentence, param)
    return room


def _check_vocab(
    field: str, ids: Iterable[int], caps: Capabilities, param: str | None = None
) -> None:
    bad = next((t for t in ids if t >= caps.vocab_size), None)
    if bad is not None:
        raise BadRequest(
            INVALID,
            f"{field} holds token id {bad}, outside the vocabulary (0 .. {caps.vocab_size - 1})",
            param or field,
        )


def _max_new_tokens(
    r: RequestParams, prompt_len: int, caps: Capabilities, default_max_new: int | None
) -> int:
    """The request's token budget: its own, or the server's default (None: the rest of the
    context) cut to the context."""
    room = _room(prompt_len, caps)
    default = room if default_max_new is None else min(default_max_new, room)
    max_new = r.max_new_tokens if r.max_new_tokens is not None else default
    if max_new == 0:
        raise BadRequest(INVALID, "max_new_tokens is 0; ask for at least one token", "max_tokens")
    if max_new > room:
        sentence = overflow_sentence(caps.max_context, prompt_len + max_new, prompt_len, max_new)
        raise BadRequest(INVALID, sentence, "max_tokens")
    return max_new


def _check_method(r: RequestParams, caps: Capabilities) -> None:
    """DFlash's drafter, and the draft count (a method's name is the fronts' to check)."""
    most = max(caps.slot_verify_drafts)
    if r.method == DFLASH:
        if not caps.dflash_block:
            raise BadRequest(
                INVALID,
                "speculative method dflash needs a GPU service with a DFlash drafter (met "
                "gpu-service serve --drafter PATH); this one has none",
                "speculative",
            )
        most = min(most, caps.dflash_block - 1)
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


def _grammar(form: tuple[str, str] | None, compiler: GrammarCompiler | None) -> Grammar | None:
    """The compiled grammar, or None when the request has none."""
    if form is None:
        return None
    if compiler is None:
        raise BadRequest(grpc.StatusCode.UNIMPLEMENTED, "this server has no grammar engine")
    kind, text = form
    try:
        return compiler.compile(kind, text)
    except ValueError as e:
        raise BadRequest(INVALID, f"response_format: {e}", "response_format") from None


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
        self._own_templates: dict[str, ChatTemplate] = {}  # requests' own, by source

    async def enter(self, request: RequestParams, key: str, span: Span) -> Entered:
        """Check, convert and submit the request under `key`; its events (and `Queued`
        notices) arrive on the returned queue. Raises `BadRequest` for a request this server
        will not take, the GPU service out of reach included."""
        caps = await self.capabilities()
        span.set_attribute("gen_ai.request.model", caps.model_name)
        tokenizer = self.scheduler.tokenizer
        compiler = self._grammar_compiler(request, tokenizer, caps)
        chat = self._chat_template(request)
        req, shape = admit(request, tokenizer, caps, self.admission, key, compiler, chat)
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
        chat = self._chat_template(request)
        tokenizer = self.scheduler.tokenizer
        tools = check_tools(request)
        return _prompt_ids(request, tokenizer, caps, self.admission.max_prompt_bytes, chat, tools)[
            0
        ]

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
        """Requests without a `response_format` or a `tool_choice` that constrains never touch
        the grammar engine."""
        if request.response_format is None and request.tool_choice in ("", "auto", "none"):
            return None
        if self._compiler is None or self._compiled_for is not tokenizer:
            self._compiler = GrammarCompiler(tokenizer, caps.vocab_size, caps.eos_token_ids)
            self._compiled_for = tokenizer
        return self._compiler

    def _chat_template(self, request: RequestParams) -> ChatTemplate | None:
        """Requests without messages never read the template; a request's own (vLLM's
        `chat_template`) takes the model's special tokens."""
        if not request.messages:
            if request.chat_template or request.continue_final_message:
                raise BadRequest(
                    INVALID,
                    "chat_template and continue_final_message go with messages; this request "
                    "has none",
                    "chat_template" if request.chat_template else "continue_final_message",
                )
            return None
        model = self._model_template()
        if not request.chat_template:
            return model
        own = self._own_templates.get(request.chat_template)
        if own is None:
            try:
                own = (model or ChatTemplate("", {})).with_source(request.chat_template)
            except ValueError as e:
                raise BadRequest(INVALID, f"chat_template: {e}", "chat_template") from None
            if len(self._own_templates) >= OWN_TEMPLATES:
                self._own_templates.pop(next(iter(self._own_templates)))
            self._own_templates[request.chat_template] = own
        return own

    def _model_template(self) -> ChatTemplate | None:
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
