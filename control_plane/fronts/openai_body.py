"""OpenAI request bodies as `GenerateRequest`s: what the HTTP front takes, what it refuses.

A known parameter this server cannot honour (tools, `top_logprobs`, `best_of`, ...)
is refused with a sentence naming it, never dropped. Unknown fields are ignored, as vLLM
ignores them: SDKs add their own (`user`, `metadata`, `store`), and none of those changes the
output. Types, and what the wire types cannot hold, are checked here, and every number's range
(`protos.checks`, the ranges the `Door` holds too) on the value as sent, before it is rounded to
the wire's float; the ranges that depend on the served model are the `Door`'s to check.

Beyond OpenAI's parameters it takes `speculative` ({"method": "none" | "mtp" |
"prompt_lookup", "num_drafts": N}), `add_generation_prompt` (chat), and vLLM's `top_k`,
`min_p`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `repetition_penalty` and
`chat_template_kwargs` (chat); `top_k: -1` is vLLM's no limit. Left unset, `temperature` is 1
as in OpenAI's API, and `max_tokens` the server's `--max-new-tokens`. A message's content is
text, or text parts (joined with newlines, as vLLM joins them); an image, audio or video part is
refused: this server serves text only."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import grpc

from control_plane.admission.door import INVALID, METHODS, BadRequest
from control_plane.text.chat import KWARGS
from protos import checks
from protos.checks import INT32, UINT32, UINT64
from protos.met.v1 import generate_pb2 as pb

METHOD_NAMES = {name: method for method, name in METHODS.items()}
FORMATS = "text, json_object or json_schema"
SPECULATIVE_KEYS = ("method", "num_drafts")
# OpenAI's bound on `n`; each choice is a request of its own to the scheduler.
MAX_CHOICES = 128
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
    "echo": ((False,), "does not echo the prompt"),
    "suffix": (("",), "inserts no suffix"),
    "use_beam_search": ((False,), "has no beam search"),
    "top_logprobs": ((0,), "returns the chosen token's log-probability only (top_logprobs: 0)"),
    "tools": (([],), "has no tool calling"),
    "tool_choice": (("none",), "has no tool calling"),
    "functions": (([],), "has no tool calling"),
    "function_call": (("none",), "has no tool calling"),
    "audio": ((), "generates text only"),
    "modalities": ((["text"],), "generates text only"),
    "prediction": ((), "takes no predicted output (see `speculative` for its own drafts)"),
    "guided_json": ((), "takes structured output as response_format"),
    "guided_regex": ((), "takes structured output as response_format"),
    "guided_choice": ((), "takes structured output as response_format"),
    "guided_grammar": ((), "takes structured output as response_format"),
}


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
        super().__init__(code, message)
        self.param, self.status = param, status


@dataclasses.dataclass(frozen=True)
class Ask:
    """One OpenAI request: the `GenerateRequest` and what shapes its response."""

    request: pb.GenerateRequest
    model: str | None  # None: the served one
    stream: bool
    include_usage: bool  # a last streamed chunk carries the usage
    n: int = 1  # choices: requests that differ only in their seed (`choice_request`)

    def choice_request(self, index: int) -> pb.GenerateRequest:
        """Choice `index`'s request: a seeded one draws with seed + index, as vLLM's do, so
        that its choices differ and each replays."""
        if index == 0 or not self.request.HasField("seed"):
            return self.request
        r = pb.GenerateRequest()
        r.CopyFrom(self.request)
        r.seed = (r.seed + index) % (UINT64 + 1)
        return r


def completion_request(body: Any) -> Ask:
    """A `/v1/completions` body; `InvalidParam` with a sentence when it cannot be taken."""
    return _ask(body, _prompt, _completion_logprobs)


def chat_request(body: Any) -> Ask:
    """A `/v1/chat/completions` body; `InvalidParam` with a sentence when it cannot be taken."""
    return _ask(body, _messages, _chat_logprobs)


def _ask(
    body: Any,
    prompt: Callable[[dict, pb.GenerateRequest], None],
    logprobs: Callable[[dict], bool],
) -> Ask:
    if not isinstance(body, dict):
        raise InvalidParam(None, "the body must be a JSON object")
    _refuse_unsupported(body)
    try:
        r = _sampling(body)
        prompt(body, r)
        r.logprobs = logprobs(body)
        _response_format(body, r)
        _speculative(body, r)
    except UnicodeEncodeError as e:  # JSON can carry lone surrogates; protobuf strings cannot
        raise InvalidParam(None, f"the body holds text that is not valid Unicode: {e}") from None
    options = _object(body, "stream_options") or {}
    return Ask(
        r,
        _str(body, "model") or None,  # "" too: the served one
        bool(_bool(body, "stream")),
        bool(_bool(options, "include_usage", "stream_options.include_usage")),
        _choices(body),
    )


def _choices(body: dict) -> int:
    n = _int(body, "n")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise InvalidParam("n", f"n is {n}; it must be from 1 to {MAX_CHOICES}")
    return 1 if n is None else n


def _refuse_unsupported(body: dict) -> None:
    for name, (takes, instead) in REFUSED.items():
        value = body.get(name)
        if value is not None and value not in takes:
            raise InvalidParam(name, f"{name} is {_shown(value)}; this server {instead}")


def _sampling(body: dict) -> pb.GenerateRequest:
    """The budget, the sampler and the stops."""
    r = pb.GenerateRequest(stop=_stop(body))
    if (max_new := _max_tokens(body)) is not None:
        r.max_new_tokens = max_new
    temperature = _number(body, "temperature")
    r.temperature = 1.0 if temperature is None else temperature
    r.top_p = _number(body, "top_p") or 0.0  # 0: no cut
    r.min_p = _number(body, "min_p") or 0.0
    if (seed := _int(body, "seed", most=UINT64)) is not None:
        r.seed = seed
    r.top_k = _int(body, "top_k", least=-1, most=INT32) or 0
    r.min_new_tokens = _int(body, "min_tokens") or 0
    r.ignore_eos = bool(_bool(body, "ignore_eos"))
    r.stop_token_ids.extend(_ids(_list(body, "stop_token_ids"), "stop_token_ids"))
    r.presence_penalty = _number(body, "presence_penalty") or 0.0
    r.frequency_penalty = _number(body, "frequency_penalty") or 0.0
    if (repetition := _number(body, "repetition_penalty")) is not None:
        r.repetition_penalty = repetition
    for token, bias in _logit_bias(body).items():
        r.logit_bias[token] = bias
    return r


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
    old, new = _int(body, "max_tokens"), _int(body, "max_completion_tokens")
    if old is not None and new is not None and old != new:
        raise InvalidParam(
            "max_tokens", f"max_tokens ({old}) and max_completion_tokens ({new}) differ; give one"
        )
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


def _prompt(body: dict, r: pb.GenerateRequest) -> None:
    """Text, or token ids; a batch of one prompt is that prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        r.prompt = prompt
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        r.prompt_token_ids.extend(_ids(prompt, "prompt"))
    elif isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
        raise InvalidParam("prompt", f"prompt holds {len(prompt)} prompts; send one a request")
    else:
        raise InvalidParam(
            "prompt", f"prompt is {_shown(prompt)}; it must be text or a list of token ids"
        )


def _messages(body: dict, r: pb.GenerateRequest) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidParam("messages", "messages must be a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str):
            raise InvalidParam("messages", f"messages[{i}] has no role; each needs one")
        r.messages.add(role=role, content=_content(m.get("content"), i))
    if (add := _bool(body, "add_generation_prompt")) is not None:
        r.add_generation_prompt = add
    if (kwargs := _object(body, KWARGS)) is not None:
        try:
            r.chat_template_kwargs = json.dumps(kwargs, ensure_ascii=False)
        except RecursionError:
            raise InvalidParam(KWARGS, f"{KWARGS} nests too deep") from None


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
    """`logprobs: 0`: each token's own log-probability, no alternatives."""
    n = _int(body, "logprobs")
    if n:
        raise InvalidParam(
            "logprobs",
            f"logprobs is {n}; this server returns the chosen token's log-probability only "
            "(logprobs: 0)",
        )
    return n == 0


def _chat_logprobs(body: dict) -> bool:
    return bool(_bool(body, "logprobs"))


def _response_format(body: dict, r: pb.GenerateRequest) -> None:
    form = _object(body, "response_format")
    kind = None if form is None else form.get("type")
    if form is None or kind == "text":
        return
    if kind == "json_object":
        r.response_format.json_schema = "{}"  # any JSON value
    elif kind == "json_schema":
        schema = (_object(form, "json_schema", "response_format.json_schema") or {}).get("schema")
        if not isinstance(schema, dict | bool):
            raise InvalidParam(
                "response_format", "response_format.json_schema.schema must be a JSON schema"
            )
        r.response_format.json_schema = json.dumps(schema)
    else:
        raise InvalidParam(
            "response_format", f"response_format type {_shown(kind)} is unknown; use {FORMATS}"
        )


def _speculative(body: dict, r: pb.GenerateRequest) -> None:
    spec = _object(body, "speculative")
    if spec is None:
        return
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
        r.speculative_method = METHOD_NAMES[method]
    if (n := _int(spec, "num_drafts", "speculative.num_drafts")) is not None:
        r.num_drafts = n


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
