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
from control_plane.fronts.openai_calls import CallDeltas
from control_plane.scheduler.seq import Delta, Finish, PromptScores, SpecStats
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
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}  # any other status: server_error
DONE = "data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0  # what vLLM lists for a log-probability of -inf


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
        self.calls = [
            CallDeltas(o) if o is not None and o.tools is not None else None for o in self.outputs
        ]
        self.spelled = [Spelled() for _ in shapes]
        self.opened: set[int] = set()
        self.generated = [0] * len(shapes)

    def chunks(self, i: int, ev: Delta | Finish) -> list[dict]:
        out = []
        first = i not in self.opened
        self.opened.add(i)
        reply = self.reply
        if first:
            self.spelled[i].scores = ev.prompt
        # A chat's role goes with its first token, not before: clients stamp the time to
        # first token on the first chunk with choices.
        if first and reply.chat:
            out.append(reply.opening(i))
        if first and reply.echo:
            text, logprobs = reply.echoed(self.prompts[i], self.spelled[i])
            out.append(reply.piece(i, text, logprobs))
        if first and reply.prompt_logprobs is not None:
            scored = reply.scored_prompt(self.prompts[i], ev.prompt)
            if out:
                where = out[0] if reply.chat else out[0]["choices"][0]
            else:
                out.append(reply.piece(i, ""))
                where = out[0]["choices"][0]
            where["prompt_logprobs"] = scored
        if isinstance(ev, Delta):
            self.generated[i] += len(ev.token_ids)
            made = reply.chunks(ev, i, self.outputs[i], self.spelled[i], self.calls[i])
            if self.reply.token_ids and made:
                made[0]["choices"][0]["token_ids"] = ev.token_ids
        else:
            made = reply.closings(ev, i, self.outputs[i], self.calls[i])
        out += made
        if reply.token_ids and first and out:
            where = out[0] if reply.chat else out[0]["choices"][0]
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
    scores: PromptScores | None = None  # the prompt's, when the request asked
    top_ids: list[list[int]] = field(default_factory=list)  # per token: its alternatives
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class Reply:
    """What every body of one response shares; `chat` picks the chat shapes."""

    chat: bool
    id: str
    model: str
    tokenizer: Tokenizer  # spells each token of a logprobs list
    n: int = 1  # choices per prompt
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and each choice's ids
    echo: bool = False  # completions: the prompt leads the text and its logprobs
    top: int = 0  # alternatives listed beside each generated token (and each echoed one)
    prompt_logprobs: int | None = None  # vLLM's: the prompt's tokens scored, alternatives each
    created: int = field(default_factory=lambda: int(time.time()))

    def opening(self, index: int = 0) -> dict:
        """The first chunk of a choice's chat stream: the assistant's role."""
        return self._body(True, self._choice(True, index, {"role": "assistant", "content": ""}))

    def piece(self, index: int, content: dict | str, logprobs: dict | None = None) -> dict:
        """A stream's chunk of one choice."""
        return self._body(True, self._choice(True, index, content, logprobs))

    def output(self, shape: ChatShape) -> ChatOutput | None:
        """A chat choice's parser of reasoning and tool calls, when its output may hold them."""
        if not self.chat or (shape.tools is None and not shape.reasoning):
            return None
        return ChatOutput(shape.tools, shape.reasoning, shape.opened, shape.parallel)

    def chunks(
        self,
        ev: Delta,
        index: int,
        output: ChatOutput | None = None,
        spelled: Spelled | None = None,
        calls: CallDeltas | None = None,
    ) -> list[dict]:
        """A delta's chunks: one, or with `output`, one per part it decided (its logprobs on
        the first, and an empty content chunk to carry them when it decided none); `calls`
        streams its tool calls' arguments as they come."""
        tops = (ev.top_ids, ev.top_logprobs)
        logprobs = self._logprobs(ev.token_ids, ev.logprobs, tops, spelled or Spelled())
        if output is None:
            delta = {"content": ev.text} if self.chat else ev.text
            return [self._body(True, self._choice(True, index, delta, logprobs))]
        parts = output.push(ev.text)
        parts = (calls.parts(parts) if calls else parts) or ([{"content": ""}] if logprobs else [])
        return [
            self._body(True, self._choice(True, index, part, logprobs if k == 0 else None))
            for k, part in enumerate(parts)
        ]

    def closings(
        self,
        ev: Finish,
        index: int,
        output: ChatOutput | None = None,
        calls: CallDeltas | None = None,
    ) -> list[dict]:
        """A choice's last chunks: what its parser held back, then its finish reason and its
        speculative statistics."""
        parts = [] if output is None else output.close()
        parts = calls.parts(parts) if calls else parts
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
            spelled = Spelled(c.scores)
            echoed: dict | None = None
            if self.chat:
                parts = [] if c.output is None else c.output.push(c.text) + c.output.close()
                message = {"role": "assistant", **(merge(parts) if parts else {"content": c.text})}
            elif self.echo:
                prompt, echoed = self.echoed(c.prompt_ids, spelled)
                message = prompt + c.text
            tops = (c.top_ids, c.top_logprobs)
            logprobs = _joined(echoed, self._logprobs(c.ids, c.logprobs, tops, spelled))
            reason = _reason(c.finish, c.output)
            body = self._choice(False, i, message, logprobs, reason)
            if self.prompt_logprobs is not None and not self.chat:
                body["prompt_logprobs"] = self.scored_prompt(c.prompt_ids, c.scores)
            if self.token_ids:
                body["token_ids"] = c.ids
                if not self.chat:
                    body["prompt_token_ids"] = list(c.prompt_ids)
            bodies.append(body)
        done = [c.finish for c in choices]
        head = self._head(False)
        if self.token_ids and self.chat:
            head["prompt_token_ids"] = list(choices[0].prompt_ids)
        if self.prompt_logprobs is not None and self.chat:
            head["prompt_logprobs"] = self.scored_prompt(choices[0].prompt_ids, choices[0].scores)
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

    def _logprobs(
        self,
        ids: list[int],
        logprobs: list[float],
        rows: tuple[list[list[int]], list[list[float]]],
        spelled: Spelled,
    ) -> dict | None:
        """Each token's log-probability and, with `top`, its row's alternatives (`rows`: ids
        and log-probabilities, per token)."""
        if not logprobs:
            return None
        tokens = [self.tokenizer.decode([t]) for t in ids]
        alternatives = [self._alternatives(row) for row in zip(*rows, strict=True)]
        alternatives += [[] for _ in ids[len(alternatives) :]]
        if self.chat:
            content = [
                {
                    "token": t,
                    "logprob": lp,
                    "bytes": list(t.encode()),
                    "top_logprobs": [
                        {"token": a, "logprob": v, "bytes": list(a.encode())} for a, v in alts
                    ],
                }
                for t, lp, alts in zip(tokens, logprobs, alternatives, strict=True)
            ]
            return {"content": content}
        tops = None
        if self.top:
            tops = [
                {**dict(alts), t: lp}
                for t, lp, alts in zip(tokens, logprobs, alternatives, strict=True)
            ]
        offsets = spelled.offsets(tokens)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _alternatives(self, row: tuple[list[int], list[float]]) -> list[tuple[str, float]]:
        """A row's alternatives as spelled out; a token its processors forbid (-inf) at vLLM's
        floor, since JSON has no infinity."""
        if not self.top:
            return []
        ids, values = row
        return [
            (self.tokenizer.decode([t]), max(v, LOGPROB_FLOOR))
            for t, v in zip(ids[: self.top], values, strict=False)
        ]

    def echoed(self, prompt_ids: Sequence[int], spelled: Spelled) -> tuple[str, dict | None]:
        """A completion's echoed prompt: its text, and with logprobs asked its tokens' (the
        first has none, as in OpenAI's and vLLM's)."""
        tokens = [self.tokenizer.decode([t]) for t in prompt_ids]
        text = self.tokenizer.decode(list(prompt_ids))
        scores = spelled.scores
        if scores is None:
            return text, None
        logprobs: list[float | None] = [None, *scores.logprobs[: len(tokens) - 1]]
        tops = None
        if self.top:
            tops = [None] + [
                {
                    **dict(self._alternatives((scores.top_ids[j], scores.top_logprobs[j]))),
                    tokens[j + 1]: lp,
                }
                for j, lp in enumerate(scores.logprobs[: len(tokens) - 1])
            ]
        offsets = spelled.offsets(tokens)
        return text, {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def scored_prompt(self, prompt_ids: Sequence[int], scores: PromptScores | None) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token (the first none), its own log-probability
        and rank and its row's alternatives, by token id."""
        if scores is None:
            return None
        out: list[dict | None] = [None]
        k = self.prompt_logprobs or 0
        for j, lp in enumerate(scores.logprobs[: len(prompt_ids) - 1]):
            token = prompt_ids[j + 1]
            row = {
                str(t): {"logprob": v, "rank": r + 1, "decoded_token": self.tokenizer.decode([t])}
                for r, (t, v) in enumerate(
                    zip(scores.top_ids[j][:k], scores.top_logprobs[j][:k], strict=False)
                )
            }
            rank = scores.ranks[j] if j < len(scores.ranks) else None
            own = {"logprob": lp, "rank": rank, "decoded_token": self.tokenizer.decode([token])}
            out.append({str(token): own, **{t: v for t, v in row.items() if t != str(token)}})
        return out


@dataclass
class Spelled:
    """A choice's logprobs as they are spelled out: where its text stands (`text_offset`),
    and its prompt's scores (an echoed prompt's log-probabilities)."""

    scores: PromptScores | None = None
    at: int = 0  # characters before the next token's

    def offsets(self, tokens: list[str]) -> list[int]:
        out = []
        for t in tokens:
            out.append(self.at)
            self.at += len(t)
        return out


def _joined(first: dict | None, then: dict | None) -> dict | None:
    """Two completions logprobs objects as one, list by list."""
    if first is None or then is None:
        return first or then
    joined = {}
    for key in ("tokens", "token_logprobs", "text_offset"):
        joined[key] = first[key] + then[key]
    tops = (first["top_logprobs"], then["top_logprobs"])
    joined["top_logprobs"] = None if None in tops else tops[0] + tops[1]
    return joined
