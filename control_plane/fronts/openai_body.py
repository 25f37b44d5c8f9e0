"""OpenAI request bodies as `RequestParams` (`protos.params`): what the HTTP front takes, what
it refuses.

Every parameter is read (OpenAI's, vLLM's it honours, `speculative`), set aside as one that
changes no output (`INERT`), or refused with a sentence naming it (`REFUSED`: those taken only
at a value that changes nothing; any unknown one): nothing is dropped. Types, and what the wire
types cannot hold, are checked here, and every number's range (`protos.checks`, the ranges the
`Door` holds too) on the value as sent, before it is rounded to the wire's float; the ranges
that depend on the served model, and the tools against `tool_choice`, are the `Door`'s to
check. Every field of `SamplingParams` is read by its name and type; `top_k: -1` is vLLM's no
limit. Left unset, `temperature` is 1 as in OpenAI's API. A message's content is text, or text
parts (joined with newlines, as vLLM joins them), or text and image parts (`openai_prompts`),
which the chat template renders in order; an audio or video part is refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, get_type_hints

from control_plane.fronts.openai_fields import (
    InvalidParam,
    bool_field,
    ids_field,
    int_field,
    list_field,
    number_field,
    object_field,
    shown,
    str_field,
    token_ids_field,
)
from control_plane.fronts.openai_formats import response_format, tools_fields
from control_plane.fronts.openai_prompts import messages_fields, prompt_fields, prompts_fields
from control_plane.scheduler.methods import METHODS
from control_plane.text.chat import KWARGS
from protos import checks
from protos.checks import INT32, UINT32, UINT64
from protos.handles import MAX_TOP
from protos.params import RequestParams, SamplingParams

SPECULATIVE_KEYS = ("method", "num_drafts")
# OpenAI's bound on `n`; each choice of each prompt is a request of its own to the scheduler.
MAX_CHOICES = 128

# Parameters taken only at a value that changes nothing: name -> (those values, what this
# server does instead). An absent or null parameter is always taken.
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((1,), "returns the choices it samples (best_of: 1; use n)"),
    "suffix": (("",), "inserts no suffix"),
    "use_beam_search": ((False,), "has no beam search"),
    "audio": ((), "generates text only"),
    "modalities": ((["text"],), "generates text only"),
    "prediction": ((), "takes no predicted output (see `speculative` for its own drafts)"),
    "reasoning_effort": (
        (),
        "has no reasoning effort (chat_template_kwargs sets a template's "
        "own switches, such as enable_thinking)",
    ),
    "web_search_options": ((), "has no web search"),
    "verbosity": ((), "has no verbosity setting"),
    # vLLM's, beside those it honours.
    "bad_words": (([],), "bans no words (logit_bias or allowed_token_ids ban tokens)"),
    "priority": ((0,), "schedules first come, first served (priority: 0)"),
    "cache_salt": ((), "keeps one prefix cache for every request"),
    "skip_special_tokens": ((True,), "always leaves special tokens out of the text"),
    "spaces_between_special_tokens": ((True,), "always leaves special tokens out of the text"),
    "add_special_tokens": ((False,), "tokenizes prompts as given, adding no special tokens"),
    "length_penalty": ((1, 1.0), "has no beam search"),
    "return_tokens_as_token_ids": ((False,), "spells tokens as their text"),
    "documents": ((), "takes no documents"),
    "mm_processor_kwargs": ((), "sizes images by the checkpoint's preprocessor_config.json"),
    "logits_processors": ((), "takes no logits processors (see logit_bias)"),
    "vllm_xargs": ((), "takes no extra arguments"),
    "kv_transfer_params": ((), "transfers no KV cache"),
    "guided_decoding_backend": ((), "decodes every grammar with llguidance"),
    "guided_whitespace_pattern": ((), "writes JSON without free whitespace"),
}
# Parameters that change no output, taken and set aside: OpenAI's bookkeeping and routing
# hints, and the SDKs' own.
INERT = frozenset(
    {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
)
# Every parameter each endpoint reads; any other is refused, naming it.
READ = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "top_logprobs",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "speculative",
        "truncate_prompt_tokens",
        "include_stop_str_in_output",
        "return_token_ids",
        "request_id",
        "prompt_logprobs",
        *(f.name for f in dataclasses.fields(SamplingParams)),
    }
)
# A chat's own parameters, which `/tokenize` reads too.
CHAT_FIELDS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        KWARGS,
        "chat_template",
        "continue_final_message",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
    }
)
# vLLM's budget of a chat's reasoning tokens, before the close of its block is forced.
BUDGET = "thinking_token_budget"
CHAT_READ = READ | CHAT_FIELDS | {BUDGET}
COMPLETION_READ = READ | {"prompt", "echo"}


@dataclasses.dataclass(frozen=True)
class Ask:
    """One OpenAI request: its parameters and what shapes its response."""

    request: RequestParams
    model: str | None  # None: the served one
    stream: bool
    include_usage: bool  # a last streamed chunk carries the usage
    continuous_usage: bool = False  # every streamed chunk carries the usage so far
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids
    echo: bool = False  # completions: the prompt leads the text (and its logprobs, if asked)
    top: int = 0  # alternatives listed beside each generated token's log-probability
    prompt_logprobs: int | None = None  # vLLM's: the prompt's tokens scored, alternatives each
    n: int = 1  # choices per prompt: requests that differ only in their seed
    # A completions batch: each prompt's request after the first (`request`'s prompt).
    more: tuple[RequestParams, ...] = ()

    @property
    def choices(self) -> int:
        """Choices in all: n for each prompt, prompt by prompt, as OpenAI orders them."""
        return self.n * (1 + len(self.more))

    def choice_request(self, index: int) -> RequestParams:
        """Choice `index`'s request: that of its prompt, a seeded one drawing with seed +
        (its place among its prompt's n), as vLLM's do, so that the n differ and each
        replays."""
        prompt, j = divmod(index, self.n)
        r = (self.request, *self.more)[prompt]
        s = r.sampling
        if j == 0 or s.seed is None:
            return r
        seeded = dataclasses.replace(s, seed=(s.seed + j) % (UINT64 + 1))
        return dataclasses.replace(r, sampling=seeded)


def completion_request(body: Any) -> Ask:
    """A `/v1/completions` body, one prompt or a batch of them; `InvalidParam` with a sentence
    when it cannot be taken."""
    ask = _ask(body, prompt_fields, _completion_logprobs, COMPLETION_READ)
    echo = bool(bool_field(body, "echo"))
    top = int_field(body, "logprobs", most=MAX_TOP)
    ask = _scored(ask, echo, top or 0, top if echo else None)
    prompts = prompts_fields(body)
    requests = [dataclasses.replace(ask.request, **p) for p in prompts]
    for r in requests:
        _check_text(r)
    return dataclasses.replace(ask, request=requests[0], more=tuple(requests[1:]))


def chat_request(body: Any) -> Ask:
    """A `/v1/chat/completions` body; `InvalidParam` with a sentence when it cannot be taken."""
    ask = _ask(body, messages_fields, _chat_logprobs, CHAT_READ)
    top = int_field(body, "top_logprobs", most=MAX_TOP) or 0
    if top and not ask.request.logprobs:
        raise InvalidParam("top_logprobs", "top_logprobs needs logprobs: true")
    ask = _scored(ask, False, top, None)
    budget = int_field(body, BUDGET)
    request = dataclasses.replace(ask.request, **tools_fields(body), thinking_token_budget=budget)
    _check_text(request)
    return dataclasses.replace(ask, request=request)


def _scored(ask: Ask, echo: bool, top: int, echoed: int | None) -> Ask:
    """What the response lists: the echoed prompt's log-probabilities (`echoed` alternatives)
    and vLLM's `prompt_logprobs`, which the prompt's scores hold, and `top` alternatives beside
    each generated token, which come with its log-probability."""
    wanted = [k for k in (echoed, ask.prompt_logprobs) if k is not None]
    request = dataclasses.replace(
        ask.request, prompt_logprobs=max(wanted, default=None), top_logprobs=top
    )
    return dataclasses.replace(ask, request=request, echo=echo, top=top)


TOKENIZE_READ = CHAT_FIELDS | {"model", "prompt", "return_token_strs"}


def tokenize_request(body: Any) -> tuple[RequestParams, bool]:
    """A `/tokenize` body (vLLM's: a prompt, or messages rendered as a chat would be) and
    whether it asks for each token's text; `InvalidParam` with a sentence."""
    if not isinstance(body, dict):
        raise InvalidParam(None, "the body must be a JSON object")
    _refuse_unsupported(body, TOKENIZE_READ)
    if "messages" in body:
        r = RequestParams(**messages_fields(body), **tools_fields(body))
    else:
        r = RequestParams(**prompt_fields(body))
    _check_text(r)
    return r, bool(bool_field(body, "return_token_strs"))


def detokenize_request(body: Any) -> tuple[int, ...]:
    """A `/detokenize` body's token ids."""
    if not isinstance(body, dict):
        raise InvalidParam(None, "the body must be a JSON object")
    _refuse_unsupported(body, frozenset({"model", "tokens"}))
    return tuple(ids_field(list_field(body, "tokens"), "tokens"))


def _ask(
    body: Any,
    prompt: Callable[[dict], dict[str, Any]],
    logprobs: Callable[[dict], bool],
    read: frozenset[str],
) -> Ask:
    if not isinstance(body, dict):
        raise InvalidParam(None, "the body must be a JSON object")
    _refuse_unsupported(body, read)
    r = RequestParams(
        **_budget(body),
        **prompt(body),
        **_vllm(body),
        request_id=str_field(body, "request_id") or "",
        **_speculative(body),
        logprobs=logprobs(body),
        response_format=response_format(body),
        sampling=_sampling(body),
    )
    _check_text(r)
    options = object_field(body, "stream_options") or {}
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise InvalidParam(
            "stream_options",
            f"stream_options.{unknown[0]} is not taken here; it takes include_usage and "
            "continuous_usage_stats",
        )
    return Ask(
        r,
        str_field(body, "model") or None,  # "" too: the served one
        bool(bool_field(body, "stream")),
        bool(bool_field(options, "include_usage", "stream_options.include_usage")),
        bool(
            bool_field(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
        ),
        bool(bool_field(body, "return_token_ids")),
        n=_choices(body),
        prompt_logprobs=int_field(body, "prompt_logprobs", most=MAX_TOP),
    )


def _choices(body: dict) -> int:
    n = int_field(body, "n")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise InvalidParam("n", f"n is {n}; it must be from 1 to {MAX_CHOICES}")
    return 1 if n is None else n


def _refuse_unsupported(body: dict, read: frozenset[str]) -> None:
    """Every parameter is read, set aside as inert, or taken at a value that changes nothing;
    any other is refused, naming it."""
    for name, value in body.items():
        if name in REFUSED:
            takes, instead = REFUSED[name]
            if value is not None and value not in takes:
                raise InvalidParam(name, f"{name} is {shown(value)}; this server {instead}")
        elif name not in read and name not in INERT:
            raise InvalidParam(
                name, f"{name} is not a parameter of this endpoint; this server does not take it"
            )


def _vllm(body: dict) -> dict[str, Any]:
    """vLLM's prompt and stop parameters it honours: `truncate_prompt_tokens` (-1: as many
    as the context holds), `include_stop_str_in_output`."""
    truncate = int_field(body, "truncate_prompt_tokens", least=-1)
    if truncate == 0:
        raise InvalidParam(
            "truncate_prompt_tokens",
            "truncate_prompt_tokens is 0; keep at least 1 token, or -1 for the context's most",
        )
    return {
        "truncate_prompt_tokens": None if truncate is None else max(truncate, 0),
        "include_stop_str_in_output": bool(bool_field(body, "include_stop_str_in_output")),
    }


def _budget(body: dict) -> dict[str, Any]:
    """The budget and the stops."""
    return {
        "max_new_tokens": _max_tokens(body),
        "min_new_tokens": int_field(body, "min_tokens") or 0,
        "stop": tuple(_stop(body)),
        "stop_token_ids": tuple(ids_field(list_field(body, "stop_token_ids"), "stop_token_ids")),
        "ignore_eos": bool(bool_field(body, "ignore_eos")),
    }


def _sampling(body: dict) -> SamplingParams:
    """Every field of `SamplingParams` the body gives, read by its name and type (the special
    ones by `SAMPLING_READERS`); left unset, its default, but the temperature: 1 in OpenAI's
    API."""
    hints = get_type_hints(SamplingParams)
    given = {}
    for f in dataclasses.fields(SamplingParams):
        read = SAMPLING_READERS.get(f.name) or TYPE_READERS[hints[f.name]]
        if (value := read(body, f.name)) is not None:
            given[f.name] = value
    return SamplingParams(**{"temperature": 1.0, **given})


def _check_text(r: RequestParams) -> None:
    """JSON can carry lone surrogates; no tokenizer or chat template takes them."""
    texts = [r.prompt, r.chat_template_kwargs, r.chat_template, r.tools, r.request_id, *r.stop]
    texts += r.response_format or ()
    texts += [v for m in r.messages for v in vars(m).values() if isinstance(v, str)]
    texts += [p.text for m in r.messages for p in m.parts]
    texts += [i.url + i.mime_type for m in r.messages for i in m.images]
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParam(None, f"the body holds text that is not valid Unicode: {e}") from None


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's map of token ids, as decimal strings, to biases."""
    given = object_field(body, "logit_bias") or {}
    out = {}
    for key in given:
        # At most UINT32's 10 digits before int(), which refuses past 4,300 of them.
        if not (key.isascii() and key.isdecimal() and len(key) <= 10 and int(key) <= UINT32):
            raise InvalidParam(
                "logit_bias", f"logit_bias names {shown(key)}; a key is a token id, 0 to {UINT32}"
            )
        bias = given[key]
        try:
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise TypeError(bias)
            value = float(bias)
        except (TypeError, ValueError, OverflowError):  # not a number, or an int past a float
            raise InvalidParam(
                "logit_bias", f"logit_bias of {key} is {shown(bias)}; it must be a number"
            ) from None
        if problem := checks.number_problem("logit_bias", value, f"logit_bias of {key}"):
            raise InvalidParam("logit_bias", problem)
        out[int(key)] = value
    return out


def _max_tokens(body: dict) -> int | None:
    """`max_completion_tokens` where given, else `max_tokens` (vLLM's order; SDKs may send
    both); neither: the server's default."""
    old, new = int_field(body, "max_tokens"), int_field(body, "max_completion_tokens")
    return new if new is not None else old


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidParam("stop", f"stop is {shown(stop)}; it must be a string or a list of them")


def _completion_logprobs(body: dict) -> bool:
    """`logprobs: N`: each token's own log-probability, and N alternatives (`_scored`)."""
    return int_field(body, "logprobs", most=MAX_TOP) is not None


def _chat_logprobs(body: dict) -> bool:
    return bool(bool_field(body, "logprobs"))


def _speculative(body: dict) -> dict[str, Any]:
    spec = object_field(body, "speculative")
    if spec is None:
        return {}
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
    if unknown:
        raise InvalidParam(
            "speculative",
            f"speculative.{unknown[0]} is unknown; it takes {' and '.join(SPECULATIVE_KEYS)}",
        )
    method = spec.get("method")
    if method is not None:
        if not isinstance(method, str) or method not in METHODS:
            names = ", ".join(METHODS)
            raise InvalidParam(
                "speculative", f"speculative.method is {shown(method)}; use one of {names}"
            )
    return {"method": method, "num_drafts": int_field(spec, "num_drafts", "speculative.num_drafts")}


# How a `SamplingParams` field is read from a body: by its type, or, where its range or form
# is its own, by its name.
TYPE_READERS: dict[Any, Callable[[dict, str], Any]] = {
    float: number_field,
    float | None: number_field,
    int: int_field,
    int | None: int_field,
    tuple[int, ...]: token_ids_field,
}
SAMPLING_READERS: dict[str, Callable[[dict, str], Any]] = {
    "top_k": lambda body, key: int_field(body, key, least=-1, most=INT32),
    "seed": lambda body, key: int_field(body, key, most=UINT64),
    "logit_bias": lambda body, key: _logit_bias(body) or None,
}
