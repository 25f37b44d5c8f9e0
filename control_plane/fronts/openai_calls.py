"""A chat choice's tool calls streamed as vLLM streams them in chat completions: a call's
first delta once its name is written (`index`, `id`, `type`, `function.name`, empty
`arguments`), then its arguments piece by piece as they are generated, the pieces joining to
the whole arguments (`text.arguments.CallReader`)."""

from __future__ import annotations

import uuid
from typing import Any

from control_plane.text.arguments import CallReader, open_block
from control_plane.text.tools import ChatOutput


class CallDeltas:
    """The parts `output` decides (its `push` and `close`), with its calls' parts turned into
    streamed deltas: `parts` takes what the parser returned and gives what to send."""

    def __init__(self, output: ChatOutput) -> None:
        self.output = output
        self.reader: CallReader | None = None  # the open `<tool_call>` block's, named
        self.index = 0  # the streamed call's place among the choice's calls

    def parts(self, parsed: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = [part for p in parsed for part in self._part(p)]
        return out + self._peek()

    def _part(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        if "tool_calls" not in part:
            # Text after a block seen open: the block did not parse and stays text.
            self.reader = None
            return [part]
        reader, self.reader = self.reader, None
        if reader is None:  # parsed before its name was ever read: sent whole
            return [part]
        call = part["tool_calls"][0]
        rest, _ = reader.finish(call["function"]["arguments"])
        if not rest:
            return []
        return [_arguments(call["index"], rest)]

    def _peek(self) -> list[dict[str, Any]]:
        body = open_block(self.output)
        if body is None:
            return []
        assert self.output.tools is not None
        out = []
        if self.reader is None:
            reader = CallReader(self.output.tools)
            reader.read(body)
            if reader.name is None:
                return []
            self.reader, self.index = reader, len(self.output.calls)
            head = {"name": reader.name, "arguments": ""}
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            out.append(
                {
                    "tool_calls": [
                        {"index": self.index, "id": call_id, "type": "function", "function": head}
                    ]
                }
            )
        else:
            self.reader.read(body)
        piece = self.reader.take()
        if piece:
            out.append(_arguments(self.index, piece))
        return out


def _arguments(index: int, piece: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}
