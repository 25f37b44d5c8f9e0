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
parts (joined with newlines, as vLLM joins them); an image, audio or video part is refused:
this server serves text only."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any, get_type_hints

import grpc

from control_plane.admission.door import INVALID, BadRequest
from control_plane.text.chat import KWARGS
from protos import checks
from protos.checks import INT32, UINT32, UINT64
from protos.handles import MAX_TOP
from protos.params import METHODS, ChatMessage, RequestParams, SamplingParams

METHOD_NAMES = tuple(METHODS.values())
FORMATS = "text, json_object or json_schema"
SPECULATIVE_KEYS = ("method", "num_drafts")
# OpenAI's bounds on `n` and on a completions batch's prompts; each choice of each prompt is
# a request of its own to the scheduler.
MAX_CHOICES = 128
MAX_PROMPTS = 2048
# Content parts of other media than text, and why none is taken.
MEDIA_PARTS = {
    "image_url": "the checkpoint's vision tower is not loaded",
    "video_url": "the checkpoint's vision tower is not loaded",
    "input_audio": "no audio encoder is loaded",
}

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
    "mm_processor_kwargs": ((), "serves text only"),
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
CHAT_READ = READ | CHAT_FIELDS
COMPLETION_READ = READ | {"prompt", "echo"}


class InvalidParam(BadRequest):
    """A request refused before it reaches the `Door`; `param` names the parameter, `status`
    an HTTP status other than the code's."""

    def __init__(
        self,
        param: str | None,
        message: str,
        code: grpc.StatusCode = INVALID,
        status: int | None = None,
    ) -> None:
        super().__init__(code, message, param)
        self.status = status


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
    ask = _ask(body, _prompt, _completion_logprobs, COMPLETION_READ)
    echo = bool(_bool(body, "echo"))
    top = _int(body, "logprobs", most=MAX_TOP)
    ask = _scored(ask, echo, top or 0, top if echo else None)
    prompts = _prompts(body)
    requests = [dataclasses.replace(ask.request, **p) for p in prompts]
    for r in requests:
        _check_text(r)
    return dataclasses.replace(ask, request=requests[0], more=tuple(requests[1:]))


def chat_request(body: Any) -> Ask:
    """A `/v1/chat/completions` body; `InvalidParam` with a sentence when it cannot be taken."""
    ask = _ask(body, _messages, _chat_logprobs, CHAT_READ)
    top = _int(body, "top_logprobs", most=MAX_TOP) or 0
    if top and not ask.request.logprobs:
        raise InvalidParam("top_logprobs", "top_logprobs needs logprobs: true")
    ask = _scored(ask, False, top, None)
    request = dataclasses.replace(ask.request, **_tools(body))
    _check_text(request)
    return dataclasses.replace(ask, request=request)


def _scored(ask: Ask, echo: bool, top: int, echoed: int | None) -> Ask:
    """What the prompt's scores must hold for the response: the echoed prompt's
    log-probabilities (`echoed` alternatives), vLLM's `prompt_logprobs`, and the first
    generated token's alternatives (`top`), which its prompt's last row gives. Alternatives of
    later generated tokens are not computed: `top` asks `max_tokens` 1."""
    if top and ask.request.max_new_tokens != 1:
        raise InvalidParam(
            "top_logprobs" if ask.request.messages else "logprobs",
            f"alternatives ({top} asked) are listed for the prompt's tokens and the first "
            "generated token only: ask max_tokens 1, or none (0)",
        )
    wanted = [k for k in (echoed, ask.prompt_logprobs, top or None) if k is not None]
    request = dataclasses.replace(ask.request, prompt_logprobs=max(wanted, default=None))
    return dataclasses.replace(ask, request=request, echo=echo, top=top)


TOKENIZE_READ = CHAT_FIELDS | {"model", "prompt", "return_token_strs"}


def tokenize_request(body: Any) -> tuple[RequestParams, bool]:
    """A `/tokenize` body (vLLM's: a prompt, or messages rendered as a chat would be) and
    whether it asks for each token's text; `InvalidParam` with a sentence."""
    if not isinstance(body, dict):
        raise InvalidParam(None, "the body must be a JSON object")
    _refuse_unsupported(body, TOKENIZE_READ)
    if "messages" in body:
        r = RequestParams(**_messages(body), **_tools(body))
    else:
        r = RequestParams(**_prompt(body))
    _check_text(r)
    return r, bool(_bool(body, "return_token_strs"))


def detokenize_request(body: Any) -> tuple[int, ...]:
    """A `/detokenize` body's token ids."""
    if not isinstance(body, dict):
        raise InvalidParam(None, "the body must be a JSON object")
    _refuse_unsupported(body, frozenset({"model", "tokens"}))
    return tuple(_ids(_list(body, "tokens"), "tokens"))


def _tools(body: dict) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls`, or OpenAI's older `functions` and
    `function_call`, as the wire carries them (the `Door` checks them against each other)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    old_tools, old_choice = body.get("functions"), body.get("function_call")
    if old_tools is not None or old_choice is not None:
        if tools is not None or choice is not None:
            raise InvalidParam(
                "functions", "functions and function_call are tools' older names; give one pair"
            )
        tools = [{"type": "function", "function": f} for f in _list(body, "functions")]
        choice = old_choice
    if tools is not None and not isinstance(tools, list):
        raise InvalidParam("tools", f"tools is {_shown(tools)}; it must be a list of tools")
    return {
        "tools": json.dumps(tools, ensure_ascii=False) if tools else "",
        "tool_choice": _tool_choice(choice),
        "parallel_tool_calls": _bool(body, "parallel_tool_calls"),
    }


def _tool_choice(choice: Any) -> str:
    """ "auto", "none", "required" or a tool's name (given as {"type": "function",
    "function": {"name": ...}}, or {"name": ...} as `function_call` gives it)."""
    if choice is None:
        return ""
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        return choice
    fn = choice.get("function", choice) if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidParam(
            "tool_choice",
            f"tool_choice is {_shown(choice)}; use auto, none, required or "
            '{"type": "function", "function": {"name": ...}}',
        )
    return name


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
        request_id=_str(body, "request_id") or "",
        **_speculative(body),
        logprobs=logprobs(body),
        response_format=_response_format(body),
        sampling=_sampling(body),
    )
    _check_text(r)
    options = _object(body, "stream_options") or {}
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise InvalidParam(
            "stream_options",
            f"stream_options.{unknown[0]} is not taken here; it takes include_usage and "
            "continuous_usage_stats",
        )
    return Ask(
        r,
        _str(body, "model") or None,  # "" too: the served one
        bool(_bool(body, "stream")),
        bool(_bool(options, "include_usage", "stream_options.include_usage")),
        bool(_bool(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")),
        bool(_bool(body, "return_token_ids")),
        n=_choices(body),
        prompt_logprobs=_int(body, "prompt_logprobs", most=MAX_TOP),
    )


def _choices(body: dict) -> int:
    n = _int(body, "n")
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
                raise InvalidParam(name, f"{name} is {_shown(value)}; this server {instead}")
        elif name not in read and name not in INERT:
            raise InvalidParam(
                name, f"{name} is not a parameter of this endpoint; this server does not take it"
            )


def _vllm(body: dict) -> dict[str, Any]:
    """vLLM's prompt and stop parameters it honours: `truncate_prompt_tokens` (-1: as many
    as the context holds), `include_stop_str_in_output`."""
    truncate = _int(body, "truncate_prompt_tokens", least=-1)
    if truncate == 0:
        raise InvalidParam(
            "truncate_prompt_tokens",
            "truncate_prompt_tokens is 0; keep at least 1 token, or -1 for the context's most",
        )
    return {
        "truncate_prompt_tokens": None if truncate is None else max(truncate, 0),
        "include_stop_str_in_output": bool(_bool(body, "include_stop_str_in_output")),
    }


def _budget(body: dict) -> dict[str, Any]:
    """The budget and the stops."""
    return {
        "max_new_tokens": _max_tokens(body),
        "min_new_tokens": _int(body, "min_tokens") or 0,
        "stop": tuple(_stop(body)),
        "stop_token_ids": tuple(_ids(_list(body, "stop_token_ids"), "stop_token_ids")),
        "ignore_eos": bool(_bool(body, "ignore_eos")),
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
    texts += [t for m in r.messages for t in dataclasses.astuple(m)]
    try:
        for text in texts:
            text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidParam(None, f"the body holds text that is not valid Unicode: {e}") from None


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's map of token ids, as decimal strings, to biases."""
    given = _object(body, "logit_bias") or {}
    out = {}
    for key in given:
        # At most UINT32's 10 digits before int(), which refuses past 4,300 of them.
        if not (key.isascii() and key.isdecimal() and len(key) <= 10 and int(key) <= UINT32):
            raise InvalidParam(
                "logit_bias", f"logit_bias names {_shown(key)}; a key is a token id, 0 to {UINT32}"
            )
        bias = given[key]
        try:
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise TypeError(bias)
            value = float(bias)
        except (TypeError, ValueError, OverflowError):  # not a number, or an int past a float
            raise InvalidParam(
                "logit_bias", f"logit_bias of {key} is {_shown(bias)}; it must be a number"
            ) from None
        if problem := checks.number_problem("logit_bias", value, f"logit_bias of {key}"):
            raise InvalidParam("logit_bias", problem)
        out[int(key)] = value
    return out


def _max_tokens(body: dict) -> int | None:
    """`max_completion_tokens` where given, else `max_tokens` (vLLM's order; SDKs may send
    both); neither: the server's default."""
    old, new = _int(body, "max_tokens"), _int(body, "max_completion_tokens")
    return new if new is not None else old


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidParam("stop", f"stop is {_shown(stop)}; it must be a string or a list of them")


def _prompt(body: dict) -> dict[str, Any]:
    """The first prompt (`_prompts` reads them all)."""
    return _prompts(body)[0]


def _prompts(body: dict) -> list[dict[str, Any]]:
    """Text, token ids, or a batch of either (each a prompt of its own)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
        return [_one_prompt(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise InvalidParam(
                "prompt", f"prompt holds {len(prompt)} prompts; this server takes {MAX_PROMPTS}"
            )
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise InvalidParam(
        "prompt",
        f"prompt is {_shown(prompt)}; it must be text, a list of token ids, or a non-empty "
        "list of either",
    )


def _is_ids(values: list) -> bool:
    return all(_is_int(t) for t in values)


def _one_prompt(prompt: str | list, where: str) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if _is_ids(prompt):
        return {"prompt_token_ids": tuple(_ids(prompt, "prompt"))}
    raise InvalidParam(
        "prompt", f"{where} is {_shown(prompt)}; it must be text or a list of token ids"
    )


def _messages(body: dict) -> dict[str, Any]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidParam("messages", "messages must be a non-empty list of {role, content}")
    out = [_message(m, i) for i, m in enumerate(messages)]
    kwargs, text = _object(body, KWARGS), ""
    if kwargs is not None:
        try:
            text = json.dumps(kwargs, ensure_ascii=False)
        except RecursionError:
            raise InvalidParam(KWARGS, f"{KWARGS} nests too deep") from None
    return {
        "messages": tuple(out),
        "add_generation_prompt": _bool(body, "add_generation_prompt"),
        "chat_template_kwargs": text,
        "chat_template": _str(body, "chat_template") or "",
        "continue_final_message": bool(_bool(body, "continue_final_message")),
    }


def _message(m: Any, i: int) -> ChatMessage:
    """One message: its role and text, an assistant's calls and reasoning, a tool result's
    call id and name."""
    role = m.get("role") if isinstance(m, dict) else None
    if not isinstance(role, str):
        raise InvalidParam("messages", f"messages[{i}] has no role; each needs one")
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise InvalidParam(
            "messages", f"messages[{i}].tool_calls is {_shown(calls)}; it must be a list"
        )
    where = f"messages[{i}]."
    return ChatMessage(
        role,
        _content(m.get("content"), i),
        tool_calls=json.dumps(calls, ensure_ascii=False) if calls else "",
        tool_call_id=_str(m, "tool_call_id", where + "tool_call_id") or "",
        name=_str(m, "name", where + "name") or "",
        # vLLM takes `reasoning` too.
        reasoning_content=_str(m, "reasoning_content", where + "reasoning_content")
        or _str(m, "reasoning", where + "reasoning")
        or "",
    )


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or text parts, joined with newlines as vLLM joins them."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidParam(
            "messages", f"messages[{i}].content is {_shown(content)}; it must be text or parts"
        )
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind in MEDIA_PARTS:
            raise InvalidParam(
                "messages",
                f"messages[{i}].content[{j}] is of type {kind}; this server serves text only "
                f"({MEDIA_PARTS[kind]})",
            )
        if kind != "text":
            raise InvalidParam(
                "messages",
                f"messages[{i}].content[{j}] is {_shown(part)}; this server takes text parts only",
            )
    texts = [_str(p, "text", f"messages[{i}].content[{j}].text") for j, p in enumerate(content)]
    return "\n".join(t or "" for t in texts)


def _completion_logprobs(body: dict) -> bool:
    """`logprobs: N`: each token's own log-probability, and N alternatives (`_scored`)."""
    return _int(body, "logprobs", most=MAX_TOP) is not None


def _chat_logprobs(body: dict) -> bool:
    return bool(_bool(body, "logprobs"))


# vLLM's structured outputs: each key as (the wire's grammar kind, how its value becomes its
# text); the older top-level `guided_*` names take the same values.
STRUCTURED = {
    "json": ("json_schema", lambda v: v if isinstance(v, str) else json.dumps(v)),
    "regex": ("regex", lambda v: v),
    "choice": ("regex", lambda v: "|".join(regex_literal(c) for c in v)),
    "grammar": ("lark", lambda v: v),
    "json_object": ("json_schema", lambda v: json.dumps({"type": "object"})),
}
STRUCTURED_TYPES: dict[str, type | tuple[type, ...]] = {
    "json": (dict, str, bool),
    "regex": str,
    "choice": list,
    "grammar": str,
}
REGEX_META = set("\\.^$|?*+()[]{}-&~#")


def regex_literal(text: Any) -> str:
    if not isinstance(text, str):
        raise InvalidParam("structured_outputs", f"a choice is {_shown(text)}; each is text")
    return "".join("\\" + c if c in REGEX_META else c for c in text)


def _structured(body: dict) -> tuple[str, str] | None:
    """vLLM's `structured_outputs` (or its `guided_*` fields): json, regex, choice,
    grammar (llguidance's Lark) or json_object, one of them; any other key refused."""
    given = _object(body, "structured_outputs") or {}
    old = {k[len("guided_") :]: body[k] for k in body if k.startswith("guided_")}
    if old and given:
        raise InvalidParam("structured_outputs", "give structured_outputs or guided_*, not both")
    prefix = "guided_" if old else "structured_outputs."
    given = {k: v for k, v in (given or old).items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED))
    if unknown:
        name = prefix + unknown[0]
        raise InvalidParam(
            name.rstrip("."),
            f"{name} is not taken here; this server takes "
            f"{', '.join(prefix + k for k in STRUCTURED)}",
        )
    if len(given) > 1:
        raise InvalidParam(
            "structured_outputs",
            f"structured_outputs gives {' and '.join(sorted(given))}; give one",
        )
    if not given:
        return None
    ((key, value),) = given.items()
    kind, text = STRUCTURED[key]
    want = STRUCTURED_TYPES.get(key)
    if want is not None and not isinstance(value, want):
        raise InvalidParam("structured_outputs", f"structured_outputs.{key} is {_shown(value)}")
    if key == "choice" and not value:
        raise InvalidParam("structured_outputs", "structured_outputs.choice is empty")
    return (kind, text(value))


def _response_format(body: dict) -> tuple[str, str] | None:
    """OpenAI's `response_format`, or vLLM's structured outputs (never both)."""
    structured, form = _structured(body), _openai_format(body)
    if structured is not None and form is not None:
        raise InvalidParam(
            "response_format", "give response_format or structured_outputs, not both"
        )
    return structured or form


def _openai_format(body: dict) -> tuple[str, str] | None:
    form = _object(body, "response_format")
    kind = None if form is None else form.get("type")
    if form is None or kind == "text":
        return None
    if kind == "json_object":
        return ("json_schema", json.dumps({"type": "object"}))  # OpenAI's: an object
    if kind == "json_schema":
        schema = (_object(form, "json_schema", "response_format.json_schema") or {}).get("schema")
        if not isinstance(schema, dict | bool):
            raise InvalidParam(
                "response_format", "response_format.json_schema.schema must be a JSON schema"
            )
        return ("json_schema", json.dumps(schema))
    raise InvalidParam(
        "response_format", f"response_format type {_shown(kind)} is unknown; use {FORMATS}"
    )


def _speculative(body: dict) -> dict[str, Any]:
    spec = _object(body, "speculative")
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
        if not isinstance(method, str) or method not in METHOD_NAMES:
            names = ", ".join(METHOD_NAMES)
            raise InvalidParam(
                "speculative", f"speculative.method is {_shown(method)}; use one of {names}"
            )
    return {"method": method, "num_drafts": _int(spec, "num_drafts", "speculative.num_drafts")}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(
    obj: dict, key: str, param: str | None = None, most: int = UINT32, least: int = 0
) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not _is_int(value) or not least <= value <= most:
        name = param or key
        raise InvalidParam(
            name, f"{name} is {_shown(value)}; it must be an integer, {least} to {most}"
        )
    return value


def _ids(values: list, param: str) -> list[int]:
    bad = [v for v in values if not _is_int(v) or not 0 <= v <= UINT32]
    if bad:
        raise InvalidParam(
            param, f"{param} holds {_shown(bad[0])}; a token id is an integer, 0 to {UINT32}"
        )
    return values


def _number(obj: dict, key: str) -> float | None:
    """A number in its range of `checks.FLOATS`, as sent (JSON's double, not the wire's float)."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer past any float
            pass
        else:
            if (problem := checks.number_problem(key, number)) is not None:
                raise InvalidParam(key, problem)
            return number
    raise InvalidParam(key, f"{key} is {_shown(value)}; it must be a number")


def _typed(obj: dict, key: str, kind: type, what: str, param: str | None) -> Any:
    """`obj[key]` when absent, null or of `kind`; otherwise refused, naming `param`."""
    value = obj.get(key)
    if value is None or isinstance(value, kind):
        return value
    name = param or key
    raise InvalidParam(name, f"{name} is {_shown(value)}; it must be {what}")


def _bool(obj: dict, key: str, param: str | None = None) -> bool | None:
    return _typed(obj, key, bool, "true or false", param)


def _str(obj: dict, key: str, param: str | None = None) -> str | None:
    return _typed(obj, key, str, "a string", param)


def _list(obj: dict, key: str) -> list:
    value = obj.get(key)
    if value is None or isinstance(value, list):
        return value or []
    raise InvalidParam(key, f"{key} is {_shown(value)}; it must be a list")


def _object(obj: dict, key: str, param: str | None = None) -> dict | None:
    value = obj.get(key)
    if value is None or isinstance(value, dict):
        return value
    name = param or key
    raise InvalidParam(name, f"{name} is {_shown(value)}; it must be an object")


def _shown(value: Any) -> str:
    """A value as JSON, cut short: sentences quote what the client sent."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _token_ids(obj: dict, key: str) -> tuple[int, ...] | None:
    return tuple(_ids(_list(obj, key), key)) or None


# How a `SamplingParams` field is read from a body: by its type, or, where its range or form
# is its own, by its name.
TYPE_READERS: dict[Any, Callable[[dict, str], Any]] = {
    float: _number,
    float | None: _number,
    int: _int,
    int | None: _int,
    tuple[int, ...]: _token_ids,
}
SAMPLING_READERS: dict[str, Callable[[dict, str], Any]] = {
    "top_k": lambda body, key: _int(body, key, least=-1, most=INT32),
    "seed": lambda body, key: _int(body, key, most=UINT64),
    "logit_bias": lambda body, key: _logit_bias(body) or None,
}
