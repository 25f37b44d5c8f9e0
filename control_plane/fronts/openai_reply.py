"""Scheduler events as OpenAI response bodies: the whole completion, its stream chunks, the
usage and, beside it, the request's `speculative` statistics; errors in OpenAI's shape with
the HTTP status of their gRPC code."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf.json_format import MessageToDict

from control_plane.admission.door import ChatShape
from control_plane.fronts.api import stats_message
from control_plane.scheduler.seq import Delta, Finish, SpecStats
from control_plane.text.detok import Tokenizer
from control_plane.text.tools import ChatOutput, merge

STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    # The model cannot serve the request as asked (no chat template, no MTP head); the same
    # request will not succeed later, so not 409.
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}  # any other status: server_error
DONE = "data: [DONE]\n\n"


def error(status: int, message: str, code: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def grpc_error(
    code: grpc.StatusCode, message: str, param: str | None = None, status: int | None = None
) -> tuple[int, dict]:
    """-> (HTTP status, body) of a request refused or failed with this gRPC code (`status`
    overrides the code's); `code` in the body is the gRPC code's name, in lower case."""
    status = status or STATUS.get(code, 500)
    return status, error(status, message, code.name.lower(), param)


class Stream:
    """One streamed response's chunks, choice by choice: a chat's role with its first token,
    its reasoning and calls split as they are decided, vLLM's token ids and running usage
    where asked."""

    def __init__(
        self,
        reply: Reply,
        shapes: Sequence[ChatShape],
        prompts: Sequence[tuple[int, ...]],
        continuous_usage: bool = False,
    ) -> None:
        self.reply, self.prompts, self.continuous = reply, prompts, continuous_usage
        self.outputs = [reply.output(shape) for shape in shapes]
        self.opened: set[int] = set()
        self.generated = [0] * len(shapes)

    def chunks(self, i: int, ev: Delta | Finish) -> list[dict]:
        out = []
        first = i not in self.opened
        self.opened.add(i)
        # A chat's role goes with its first token, not before: clients stamp the time to
        # first token on the first chunk with choices.
        if first and self.reply.chat:
            out.append(self.reply.opening(i))
        if isinstance(ev, Delta):
            self.generated[i] += len(ev.token_ids)
            made = self.reply.chunks(ev, i, self.outputs[i])
            if self.reply.token_ids and made:
                made[0]["choices"][0]["token_ids"] = ev.token_ids
        else:
            made = self.reply.closings(ev, i, self.outputs[i])
        out += made
        if self.reply.token_ids and first and out:
            where = out[0] if self.reply.chat else out[0]["choices"][0]
            where["prompt_token_ids"] = list(self.prompts[i])
        if self.continuous:
            for chunk in out:
                chunk["usage"] = self._usage()
        return out

    def _usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts[:: self.reply.n])
        completion = sum(self.generated)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }


def _reason(ev: Finish, output: ChatOutput | None) -> str:
    """OpenAI's finish reason: "tool_calls" for a choice that ended on its calls."""
    return (
        "tool_calls" if output is not None and output.calls and ev.reason == "stop" else ev.reason
    )


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def usage(done: Sequence[Finish], n: int = 1) -> dict:
    """One response's usage: each prompt once (its n choices follow one another), every
    choice's completion."""
    prompt = sum(ev.prompt_tokens for ev in done[::n])
    completion = sum(ev.completion_tokens for ev in done)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # What the prefix cache gave of each prompt.
        "prompt_tokens_details": {"cached_tokens": sum(ev.cached_tokens for ev in done[::n])},
    }


def speculative(done: Sequence[Finish]) -> dict:
    """The gRPC API's `SpeculativeStats`, field for field, over every choice given."""
    stats = SpecStats()
    for ev in done:
        stats.merge(ev.stats)
    return MessageToDict(
        stats_message(stats),
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )


@dataclass(frozen=True)
class Whole:
    """One choice of a whole response, gathered."""

    text: str
    ids: list[int]
    logprobs: list[float]
    finish: Finish
    output: ChatOutput | None = None  # a chat's parser of reasoning and calls
    prompt_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Reply:
    """What every body of one response shares; `chat` picks the chat shapes."""

    chat: bool
    id: str
    model: str
    tokenizer: Tokenizer  # spells each token of a logprobs list
    n: int = 1  # choices per prompt
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and each choice's ids
    created: int = field(default_factory=lambda: int(time.time()))

    def opening(self, index: int = 0) -> dict:
        """The first chunk of a choice's chat stream: the assistant's role."""
        return self._body(True, self._choice(True, index, {"role": "assistant", "content": ""}))

    def output(self, shape: ChatShape) -> ChatOutput | None:
        """A chat choice's parser of reasoning and tool calls, when its output may hold them."""
        if not self.chat or (shape.tools is None and not shape.reasoning):
            return None
        return ChatOutput(shape.tools, shape.reasoning, shape.opened, shape.parallel)

    def chunks(self, ev: Delta, index: int, output: ChatOutput | None = None) -> list[dict]:
        """A delta's chunks: one, or with `output`, one per part it decided (its logprobs on
        the first, and an empty content chunk to carry them when it decided none)."""
        logprobs = self._logprobs(ev.token_ids, ev.logprobs)
        if output is None:
            delta = {"content": ev.text} if self.chat else ev.text
            return [self._body(True, self._choice(True, index, delta, logprobs))]
        parts = output.push(ev.text) or ([{"content": ""}] if logprobs else [])
        return [
            self._body(True, self._choice(True, index, part, logprobs if k == 0 else None))
            for k, part in enumerate(parts)
        ]

    def closings(self, ev: Finish, index: int, output: ChatOutput | None = None) -> list[dict]:
        """A choice's last chunks: what its parser held back, then its finish reason and its
        speculative statistics."""
        parts = [] if output is None else output.close()
        out = [self._body(True, self._choice(True, index, part)) for part in parts]
        reason = _reason(ev, output)
        body = self._body(True, self._choice(True, index, {} if self.chat else "", None, reason))
        return [*out, {**body, "speculative": speculative([ev])}]

    def usage_chunk(self, done: Sequence[Finish]) -> dict:
        return {**self._head(True), "choices": [], "usage": usage(done, self.n)}

    def whole(self, choices: Sequence[Whole]) -> dict:
        """The response of every choice: each one's text, the usage and the speculative
        statistics of them all."""
        bodies = []
        for i, c in enumerate(choices):
            message: dict | str = c.text
            if self.chat:
                parts = [] if c.output is None else c.output.push(c.text) + c.output.close()
                message = {"role": "assistant", **(merge(parts) if parts else {"content": c.text})}
            logprobs = self._logprobs(c.ids, c.logprobs)
            reason = _reason(c.finish, c.output)
            body = self._choice(False, i, message, logprobs, reason)
            if self.token_ids:
                body["token_ids"] = c.ids
                if not self.chat:
                    body["prompt_token_ids"] = list(c.prompt_ids)
            bodies.append(body)
        done = [c.finish for c in choices]
        head = self._head(False)
        if self.token_ids and self.chat:
            head["prompt_token_ids"] = list(choices[0].prompt_ids)
        return {
            **head,
            "choices": bodies,
            "usage": usage(done, self.n),
            "speculative": speculative(done),
        }

    def _head(self, chunk: bool) -> dict:
        kind = "text_completion"
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _body(self, chunk: bool, choice: dict) -> dict:
        return {**self._head(chunk), "choices": [choice]}

    def _choice(
        self,
        chunk: bool,
        index: int,
        content: dict | str,
        logprobs: dict | None = None,
        finish: str | None = None,
    ) -> dict:
        name = ("delta" if chunk else "message") if self.chat else "text"
        return {"index": index, name: content, "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(self, ids: list[int], logprobs: list[float]) -> dict | None:
        """Each token's own log-probability (there are no alternatives: top_logprobs 0)."""
        if not logprobs:
            return None
        tokens = [self.tokenizer.decode([t]) for t in ids]
        if self.chat:
            content = [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, logprobs, strict=True)
            ]
            return {"content": content}
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None}
