"""A tool call's arguments as they are generated: the open `<tool_call>` block that `ChatOutput`
holds back, read as far as it is decided, its tool's name once written and its arguments
spelled as `ToolCall.arguments` spells them (`json.dumps`), piece by piece, so that the pieces
join to the whole call's arguments (`CallReader.finish` settles the rest).

Qwen3's JSON form is re-spelled token by token (a number or a literal once it ends, a string
character by character); the XML form of Qwen3-Coder and Qwen3.5 gives each parameter once it
closes, a text parameter character by character (the newline before `</parameter>` held back)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from control_plane.text.tools import TOOL_OPEN, ChatOutput, _is_text, _trim_newlines, _xml_value

_OPENING = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]+)>")
_HEX = re.compile(r"[0-9a-fA-F]{4}")
PARAMETER_CLOSE, FUNCTION_CLOSE = "\n</parameter>", "</function>"
# What the JSON form re-spells between tokens, as `json.dumps` separates them.
PUNCTUATION = {"{": "{", "}": "}", "[": "[", "]": "]", ",": ", ", ":": ": "}
SCALAR = set("0123456789+-.eEtrufalsnNIiy")  # numbers, true, false, null, NaN, Infinity
ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def open_block(output: ChatOutput) -> str | None:
    """The body so far of the `<tool_call>` block `output` holds back, open and not yet
    parsed; None when it holds none that may become a call."""
    if output.tools is None or output.state != "content":
        return None
    if not output.parallel and output.calls:  # a second block stays text
        return None
    rest = output.text[output.at :].lstrip()
    return rest[len(TOOL_OPEN) :] if rest.startswith(TOOL_OPEN) else None


class CallReader:
    """One `<tool_call>` block's body as it arrives (`read` it whole each time: only its new
    end is read): `name` once written, then `take` the arguments' text decided since the last
    take."""

    def __init__(self, tools: Mapping[str, dict[str, Any]]) -> None:
        self.tools = tools
        self.name: str | None = None
        self.sent = ""  # the argument text taken so far
        self._json: _JsonCall | None = None
        self._xml = False
        self._decided = ""

    def read(self, body: str) -> None:
        if self._json is None and not self._xml:
            head = body.lstrip()[:1]
            self._xml = head == "<"
            if head == "{":
                self._json = _JsonCall()
        if self._json is not None:
            self._json.read(body)
            self.name, self._decided = self._json.name, self._json.decided
        elif self._xml:
            self.name, self._decided = _xml_decided(body, self.tools)

    def take(self) -> str:
        """The argument text decided since the last take; nothing before the name is known
        (a client opens the call with its name), nor once the text departs from it."""
        if self.name is None or not self._decided.startswith(self.sent):
            return ""
        piece = self._decided[len(self.sent) :]
        self.sent = self._decided
        return piece

    def finish(self, arguments: str) -> tuple[str, str]:
        """-> (the rest, the arguments as reported) once the block parsed to `arguments`: the
        pieces taken and the rest join to them. Pieces that spell the same JSON another way (a
        key given twice) stand as the arguments."""
        if arguments.startswith(self.sent):
            rest, self.sent = arguments[len(self.sent) :], arguments
            return rest, arguments
        try:
            same = json.loads(self.sent) == json.loads(arguments)
        except (ValueError, RecursionError):
            same = False
        return ("", self.sent) if same else ("", arguments)


def _xml_decided(body: str, tools: Mapping[str, dict[str, Any]]) -> tuple[str | None, str]:
    """The XML form's name and argument text decided by `body`: each closed parameter as
    `json.dumps` writes it, then an open text parameter's characters so far."""
    opening = _OPENING.match(body)
    if opening is None:
        return None, ""
    name = opening.group(1).strip()
    props = (tools.get(name) or {}).get("properties") or {}
    end = body.find(FUNCTION_CLOSE, opening.end())
    region = body[opening.end() : len(body) if end < 0 else end]
    parts, at = [], 0
    for match in _PARAMETER.finditer(region):
        key = match.group(1).strip()
        value = _xml_value(_trim_newlines(match.group(2)), props.get(key))
        parts.append(f"{_dumps(key)}: {_dumps(value)}")
        at = match.end()
    text = "{" + ", ".join(parts)
    if end >= 0:
        return name, text + "}"
    partial = _PARAMETER_OPEN.search(region, at)
    if partial is not None:
        key = partial.group(1).strip()
        if props.get(key) is None or _is_text(props[key]):
            raw = region[partial.end() :]
            raw = raw[: len(raw) - _held_end(raw, PARAMETER_CLOSE)]
            raw = raw.removeprefix("\n")
            text += (", " if parts else "") + f'{_dumps(key)}: "' + _dumps(raw)[1:-1]
    return name, text


def _held_end(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` or `marker` less its
    first character (`</parameter>` may close a value that ends without a newline)."""
    for n in range(min(len(marker), len(text)), 0, -1):
        end = text[len(text) - n :]
        if marker.startswith(end) or marker[1:].startswith(end):
            return n
    return 0


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class _JsonCall:
    """Qwen3's JSON form, `{"name": ..., "arguments": {...}}`, read character by character:
    the name once its string closes, the arguments object re-spelled as `json.dumps` spells
    it. Any text that is not JSON stops the reading (the block will stay text)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.decided = ""  # the arguments' text so far
        self.at = 0  # characters of the body read
        self.depth = 0  # objects and lists open
        self.key: str | None = None  # the top object's key whose value comes next
        self.expect_key = False
        self.text: list[str] | None = None  # a top-level string being read
        self.string: _JsonString | None = None  # a string being read
        self.scalar = ""  # a number or literal being read
        self.arguments = False  # inside the arguments object
        self.arguments_done = False
        self.broken = False

    def read(self, body: str) -> None:
        while self.at < len(body) and not self.broken:
            self._char(body[self.at])
            self.at += 1

    def _char(self, c: str) -> None:
        if self.string is not None:
            self._in_string(c)
        elif self.scalar and c in SCALAR:
            self.scalar += c
        else:
            if self.scalar:
                self._scalar_end()
            if c in SCALAR and not self.broken:
                self.scalar = c
            elif c == '"':
                self.string = _JsonString()
                self._out('"')
            elif c in PUNCTUATION:
                self._punctuation(c)
            elif not c.isspace():
                self.broken = True

    def _in_string(self, c: str) -> None:
        assert self.string is not None
        done = self.string.push(c)
        if self.string.broken:
            self.broken = True
            return
        self._out(_dumps(self.string.take())[1:-1])
        if done:
            text, self.string = self.string.text, None
            self._out('"')
            self._string_end(text)

    def _string_end(self, text: str) -> None:
        """A whole string at the top object's level: a key, or the name."""
        if self.depth != 1 or self.arguments:
            return
        if self.expect_key:
            self.key, self.expect_key = text, False
        elif self.key == "name" and self.name is None:
            self.name = text

    def _scalar_end(self) -> None:
        raw, self.scalar = self.scalar, ""
        try:
            value = json.loads(raw)
        except ValueError:
            self.broken = True
            return
        self._out(json.dumps(value))

    def _punctuation(self, c: str) -> None:
        if c in "{[":
            if self.depth == 1 and self.key == "arguments" and c == "{" and not self.arguments_done:
                self.arguments = True
            self._out(PUNCTUATION[c])
            self.depth += 1
            if self.depth == 1:
                self.expect_key = True
            return
        if c in "}]":
            self.depth -= 1
            self._out(PUNCTUATION[c])
            if self.depth == 1 and self.arguments:
                self.arguments, self.arguments_done = False, True
            if self.depth < 0:
                self.broken = True
            return
        self._out(PUNCTUATION[c])
        if c == "," and self.depth == 1:
            self.expect_key = True

    def _out(self, text: str) -> None:
        if self.arguments:
            self.decided += text


class _JsonString:
    """One JSON string's characters as they arrive, escapes decoded (a surrogate pair's
    halves joined); `push` says whether the string closed."""

    def __init__(self) -> None:
        self.text = ""  # decoded so far
        self.given = 0  # of `text`, handed on by `take`
        self.escape: str | None = None  # the escape being read, after its backslash
        self.high = ""  # a high surrogate waiting for its low half
        self.broken = False

    def push(self, c: str) -> bool:
        if self.escape is not None:
            self._escaped(c)
            return False
        if c == "\\":
            self.escape = ""
        elif c == '"':
            self._add("")
            return True
        elif c < " ":  # JSON's strings take no raw control characters
            self.broken = True
        else:
            self._add(c)
        return False

    def _escaped(self, c: str) -> None:
        assert self.escape is not None
        self.escape += c
        if self.escape[0] != "u":
            if self.escape not in ESCAPES:
                self.broken = True
            else:
                self._add(ESCAPES[self.escape])
            self.escape = None
        elif len(self.escape) == 5:
            digits, self.escape = self.escape[1:], None
            if _HEX.fullmatch(digits) is None:
                self.broken = True
            else:
                self._add(chr(int(digits, 16)))

    def _add(self, c: str) -> None:
        """`c` decoded ("" at the close): a high surrogate waits for the next character."""
        if self.high and "\udc00" <= c[:1] <= "\udfff":
            joined = (self.high + c).encode("utf-16", "surrogatepass").decode("utf-16")
            self.text, self.high = self.text + joined, ""
            return
        self.text, self.high = self.text + self.high, ""
        if "\ud800" <= c <= "\udbff":
            self.high = c
        else:
            self.text += c

    def take(self) -> str:
        piece = self.text[self.given :]
        self.given = len(self.text)
        return piece
