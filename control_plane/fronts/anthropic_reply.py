"""Scheduler events as Anthropic Messages replies: a message's content blocks (`thinking` from
the reasoning split, `text`, `tool_use` with its input streamed piece by piece) as the events
of a stream (`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta` with
the stop reason and usage, `message_stop`, `ping`), or folded into one `message`; errors in
Anthropic's shape, their status from their gRPC code as the OpenAI front's.

The usage is Anthropic's: `input_tokens` the prompt's tokens the prefix cache did not give,
`cache_read_input_tokens` those it gave (`cache_creation_input_tokens` is 0: caching costs
nothing here). A thinking block's `signature` is a random token: nothing here checks the one
a client sends back."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from control_plane.fronts.openai_reply import STATUS, speculative
from control_plane.scheduler.seq import Delta, Finish
from control_plane.text.arguments import CallReader, open_block
from control_plane.text.tools import ChatOutput

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
}  # any other status: api_error
PING = {"type": "ping"}


def error_body(status: int, message: str) -> dict:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }


def grpc_error(code: grpc.StatusCode, message: str, status: int | None = None) -> tuple[int, dict]:
    """-> (HTTP status, body) of a request refused or failed with this gRPC code."""
    status = status or STATUS.get(code, 500)
    return status, error_body(status, message)


def event(body: dict) -> str:
    """One server-sent event, named by its type as Anthropic's are."""
    return f"event: {body['type']}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


def usage(ev: Finish) -> dict:
    return {
        "input_tokens": ev.prompt_tokens - ev.cached_tokens,
        "output_tokens": ev.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": ev.cached_tokens,
    }


class StopHold:
    """A stop sequence ends the text it stopped (the request keeps it in the output): held
    back until the next event says whether it ended the message, then reported, not
    written."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = sorted(stops, key=len, reverse=True)  # the longest first: the one matched
        self.longest = len(self.stops[0]) if stops else 0
        self.tail = ""  # the last `longest` characters pushed
        self.held = ""

    def push(self, text: str) -> str:
        if not self.stops:
            return text
        self.tail = (self.tail + text)[-self.longest :]
        text, self.held = self.held + text, ""
        ending = next((s for s in self.stops if self.tail.endswith(s)), "")
        if ending and len(ending) <= len(text):
            text, self.held = text[: len(text) - len(ending)], ending
        return text

    def finish(self, reason: str) -> tuple[str, str | None]:
        """-> (the text still to write, the stop sequence that ended the message or None)."""
        if reason == "stop" and self.held:
            return "", self.held
        return self.held, None


class MessageReply:
    """One message, block by block, as events. `output`: its parser of reasoning and calls
    (None: all text); `eager(name)`: whether that tool's input streams piece by piece as it is
    generated (`text.arguments.CallReader`; False: whole once the call closes). With `eager`
    None a call comes whole once it closes, as a whole message folds it; with it, a block that
    opened as a call and then does not parse (cut short, or not a call after all) closes its
    `tool_use` block as it stands, and its text follows as text."""

    def __init__(
        self,
        id: str,
        model: str,
        output: ChatOutput | None,
        stops: tuple[str, ...] = (),
        show_thinking: bool = True,
        eager: Callable[[str], bool] | None = None,
    ) -> None:
        self.id, self.model, self.show = id, model, show_thinking
        self.output, self.eager = output, eager
        self.reader: CallReader | None = None  # the open `<tool_call>` block's
        self.hold = StopHold(stops)
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.calls = 0  # tool_use blocks of parsed calls
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def start(self, prompt_tokens: int) -> list[dict]:
        """`message_start`, then a `ping`, as Anthropic's streams open."""
        message = self._message([])
        message["usage"] = {
            "input_tokens": prompt_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        return [{"type": "message_start", "message": message}, PING]

    def delta(self, ev: Delta) -> list[dict]:
        return self._text(self.hold.push(ev.text))

    def finish(self, ev: Finish) -> list[dict]:
        """The last blocks, `message_delta` (the stop reason, the usage) and `message_stop`."""
        rest, self.stop_sequence = self.hold.finish(ev.reason)
        out = self._text(rest)
        if self.output is not None:
            out += [e for part in self.output.close() for e in self._part(part)]
        out += self._unparsed() + self._close()
        self.stop_reason = self._reason(ev)
        return [
            *out,
            {
                "type": "message_delta",
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                "usage": usage(ev),
                "speculative": speculative([ev]),
            },
            {"type": "message_stop"},
        ]

    def whole(self, text: str, ev: Finish) -> dict:
        """The message of all its text, folded from the events its stream would send."""
        events = self._text(self.hold.push(text)) + self.finish(ev)
        message = self._message(fold(events))
        return {**message, "usage": usage(ev), "speculative": speculative([ev])}

    def _message(self, content: list[dict]) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
        }

    def _reason(self, ev: Finish) -> str:
        if ev.reason == "length":
            return "max_tokens"
        if self.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if self.calls else "end_turn"

    def _text(self, text: str) -> list[dict]:
        if not text:
            return []
        if self.output is None:
            return self._written("text", text)
        events = [e for part in self.output.push(text) for e in self._part(part)]
        return events + self._peek()

    def _part(self, part: dict[str, Any]) -> list[dict]:
        if "reasoning_content" in part:
            return self._unparsed() + self._written("thinking", part["reasoning_content"])
        if "content" in part:
            return self._unparsed() + self._written("text", part["content"])
        return [e for call in part["tool_calls"] for e in self._call(call["function"])]

    def _written(self, kind: str, text: str) -> list[dict]:
        """Text of a thinking or text block, opened if it is not the open one."""
        if not text:
            return []
        out = []
        if self.kind != kind:
            block = {"type": kind, kind: ""}
            out += self._open({**block, "signature": ""} if kind == "thinking" else block)
        if kind == "text" or self.show:
            out.append(self._delta({"type": f"{kind}_delta", kind: text}))
        return out

    def _unparsed(self) -> list[dict]:
        """Text after a block seen open: the block did not parse; its tool_use block, if it
        opened one, closes as it stands."""
        if self.reader is None:
            return []
        opened, self.reader = self.kind == "tool_use", None
        return self._close() if opened else []

    def _peek(self) -> list[dict]:
        """The open `<tool_call>` block's call: its block once its name is written, its input
        so far."""
        body = None if self.eager is None or self.output is None else open_block(self.output)
        if body is None:
            return []
        assert self.output is not None and self.output.tools is not None
        if self.reader is None:
            self.reader = CallReader(self.output.tools)
        self.reader.read(body)
        name = self.reader.name
        if name is None:
            return []
        out = [] if self.kind == "tool_use" else self._open(_tool_use(name))
        piece = self.reader.take() if self.eager is not None and self.eager(name) else ""
        if piece:
            out.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
        return out

    def _call(self, fn: dict[str, str]) -> list[dict]:
        """A call parsed: its streamed block's rest, or a block whole."""
        reader, self.reader = self.reader, None
        out = []
        if reader is None or reader.name is None or self.kind != "tool_use":
            out += self._open(_tool_use(fn["name"]))
            reader = CallReader({})
        rest, _ = reader.finish(fn["arguments"])
        if rest:
            out.append(self._delta({"type": "input_json_delta", "partial_json": rest}))
        self.calls += 1
        return out + self._close()

    def _open(self, block: dict) -> list[dict]:
        out = self._close()
        self.index += 1
        self.kind = block["type"]
        return [*out, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _close(self) -> list[dict]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": uuid.uuid4().hex}))
        out.append({"type": "content_block_stop", "index": self.index})
        self.kind = None
        return out


def _tool_use(name: str) -> dict:
    return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name, "input": {}}


def fold(events: list[dict]) -> list[dict]:
    """The content blocks a stream's events build, as a client's accumulator builds them (a
    whole reply's calls come whole, so each input parses)."""
    blocks: list[dict[str, Any]] = []
    inputs: dict[int, str] = {}
    for ev in events:
        kind = ev["type"]
        if kind == "content_block_start":
            blocks.append(dict(ev["content_block"]))
        elif kind == "content_block_delta":
            block, delta = blocks[ev["index"]], ev["delta"]
            if delta["type"] == "input_json_delta":
                inputs[ev["index"]] = inputs.get(ev["index"], "") + delta["partial_json"]
            else:
                field = {"text_delta": "text", "thinking_delta": "thinking"}.get(delta["type"])
                if field is not None:
                    block[field] += delta[field]
                else:
                    block["signature"] = delta["signature"]
        elif kind == "content_block_stop" and ev["index"] in inputs:
            try:
                blocks[ev["index"]]["input"] = json.loads(inputs[ev["index"]])
            except ValueError:  # a streamed call cut short: its input as it stood, {}
                pass
    return blocks
