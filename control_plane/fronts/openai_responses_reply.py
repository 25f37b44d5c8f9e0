"""A `/v1/responses` answer: the output items (a reasoning item, a message, function calls)
made from a chat's output as its text arrives, the typed stream events that tell them with
their sequence numbers, and the response object with its usage.

The items come from `ChatOutput`'s split, so a streamed response and a whole one hold the same
items. A call's item opens once its tool's name is written and its arguments follow piece by
piece as they are generated (`response.function_call_arguments.delta`, from
`text.arguments.CallReader`); the pieces join to the arguments of the `.done` event and of the
item. A block that opened as a call and then does not parse (cut short, or not a call after
all) ends its item `incomplete`, and its text follows as the message's."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from control_plane.admission.door import ChatShape
from control_plane.fronts.openai_reply import speculative
from control_plane.scheduler.seq import Finish
from control_plane.text.arguments import CallReader, open_block
from control_plane.text.tools import ChatOutput

THINK = "think"  # `ChatOutput`'s state inside a reasoning block
STATUS = {"stop": "completed", "length": "incomplete"}  # other ends: incomplete too


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_output(shape: ChatShape) -> ChatOutput:
    """The parser of a response's text: its reasoning and calls split where the chat may
    hold them, all of it a message's text otherwise."""
    return ChatOutput(shape.tools, shape.reasoning, shape.opened, shape.parallel)


class Items:
    """A response's output items as its text arrives: `push` each piece of text, then `close`;
    each returns the events it decided (without sequence numbers), the items in `items`."""

    def __init__(self, output: ChatOutput) -> None:
        self.output = output
        self.items: list[dict[str, Any]] = []
        self.places: dict[str, int] = {}  # an item's id -> its output index
        self.open: dict[str, Any] | None = None  # the item being written
        self.reader: CallReader | None = None  # the open `<tool_call>` block's
        self.reasoning_tokens = 0

    def push(self, text: str, tokens: int = 0) -> list[dict]:
        """`text`, `tokens` generated tokens: reasoning's when the block was open before it
        or after it (its close counts)."""
        before = self.output.state
        parts = self.output.push(text)
        if THINK in (before, self.output.state):
            self.reasoning_tokens += tokens
        return [e for part in parts for e in self._part(part)] + self._peek()

    def close(self, status: str) -> list[dict]:
        """The parser's held text, then the open item ended with `status`."""
        events = [e for part in self.output.close() for e in self._part(part)]
        return events + self._end(status)

    def _part(self, part: dict[str, Any]) -> list[dict]:
        if "reasoning_content" in part:
            return self._text("reasoning", part["reasoning_content"])
        if "content" in part:
            return self._text("message", part["content"])
        return [e for call in part["tool_calls"] for e in self._call(call["function"])]

    def _text(self, kind: str, text: str) -> list[dict]:
        events = self._unparsed()
        if self.open is None or self.open["type"] != kind:
            events += self._end("completed") + self._start(_item(kind))
        item = self.open
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        name = "output_text" if kind == "message" else "reasoning_text"
        delta = {**self._at(item), "content_index": 0, "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        return [*events, {"type": f"response.{name}.delta", **delta}]

    def _unparsed(self) -> list[dict]:
        """Text after a block seen open: the block did not parse, and its call (if opened)
        ends incomplete."""
        if self.reader is None:
            return []
        opened, self.reader = self.open is not None and self.open["type"] == "function_call", None
        return self._end("incomplete") if opened else []

    def _peek(self) -> list[dict]:
        """The open block's call: its item once its name is written, its arguments so far."""
        body = open_block(self.output)
        if body is None:
            return []
        assert self.output.tools is not None
        if self.reader is None:
            self.reader = CallReader(self.output.tools)
        self.reader.read(body)
        events: list[dict] = []
        if self.reader.name is None:
            return events
        if self.open is None or self.open["type"] != "function_call":
            events += self._end("completed") + self._start(_call_item(self.reader.name))
        piece = self.reader.take()
        if piece:
            events.append(self._arguments(piece))
        return events

    def _call(self, fn: dict[str, str]) -> list[dict]:
        """A call parsed: the streamed item's rest, or a new item whole."""
        events: list[dict] = []
        reader, self.reader = self.reader, None
        streamed = reader is not None and reader.name is not None
        if not streamed:
            events += self._end("completed") + self._start(_call_item(fn["name"]))
            reader = CallReader({})
        assert reader is not None and self.open is not None
        rest, arguments = reader.finish(fn["arguments"])
        if rest:
            events.append(self._arguments(rest))
        self.open["name"], self.open["arguments"] = fn["name"], arguments
        return events + self._end("completed")

    def _arguments(self, piece: str) -> dict:
        assert self.open is not None
        self.open["arguments"] += piece
        return {
            "type": "response.function_call_arguments.delta",
            **self._at(self.open),
            "delta": piece,
        }

    def _start(self, item: dict[str, Any]) -> list[dict]:
        self.places[item["id"]] = len(self.items)
        self.items.append(item)
        self.open = item
        added = {**item, "content": []} if "content" in item else dict(item)
        events = [
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": added,
            }
        ]
        if "content" in item:
            events.append(
                {
                    "type": "response.content_part.added",
                    **self._at(item),
                    "content_index": 0,
                    "part": dict(item["content"][0]),
                }
            )
        return events

    def _end(self, status: str) -> list[dict]:
        """The open item's closing events, with `status`."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        at = self._at(item)
        events = []
        if item["type"] == "function_call":
            done = {**at, "name": item["name"], "arguments": item["arguments"]}
            events.append({"type": "response.function_call_arguments.done", **done})
        else:
            part = item["content"][0]
            name = "output_text" if item["type"] == "message" else "reasoning_text"
            text = {**at, "content_index": 0, "text": part["text"]}
            if item["type"] == "message":
                text["logprobs"] = []
            events.append({"type": f"response.{name}.done", **text})
            events.append(
                {"type": "response.content_part.done", **at, "content_index": 0, "part": dict(part)}
            )
        index = at["output_index"]
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        return events

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.places[item["id"]]}


def _item(kind: str) -> dict[str, Any]:
    if kind == "message":
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return {
            "id": new_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [part],
        }
    return {
        "id": new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "status": "in_progress",
        "content": [{"type": "reasoning_text", "text": ""}],
    }


def _call_item(name: str) -> dict[str, Any]:
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": f"call_{uuid.uuid4().hex[:24]}",
        "name": name,
        "arguments": "",
        "status": "in_progress",
    }


@dataclass
class ResponseHead:
    """What every body of one response shares: its id, model and the request's settings."""

    id: str
    model: str
    echo: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(
        self,
        status: str,
        output: list[dict],
        finish: Finish | None = None,
        reasoning_tokens: int = 0,
    ) -> dict[str, Any]:
        incomplete = None
        if status == "incomplete" and finish is not None:
            reason = "max_output_tokens" if finish.reason == "length" else finish.reason
            incomplete = {"reason": reason}
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": None if finish is None else usage(finish, reasoning_tokens),
            **self.echo,
        }
        if finish is not None:
            body["speculative"] = speculative([finish])
        return body


def usage(finish: Finish, reasoning_tokens: int) -> dict[str, Any]:
    """The Responses API's usage: the prompt (what the prefix cache gave of it) and the
    output (what went to reasoning, counted in whole pieces of text until it closed)."""
    return {
        "input_tokens": finish.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finish.cached_tokens},
        "output_tokens": finish.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": min(reasoning_tokens, finish.completion_tokens)
        },
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    }


def status_of(finish: Finish) -> str:
    return STATUS.get(finish.reason, "incomplete")


class EventWriter:
    """A response's stream events as server-sent events, each named by its type and
    numbered in order."""

    def __init__(self) -> None:
        self.numbers = itertools.count()

    def __call__(self, event: dict) -> str:
        body = {**event, "sequence_number": next(self.numbers)}
        return f"event: {event['type']}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"
