"""Tool calls and reasoning in the forms Qwen's chat templates teach, both ways: a request's
tools checked and a grammar for `tool_choice` "required" or a named tool; the model's output
split into reasoning, content and calls, whole or streamed.

Two call forms sit between `<tool_call>` and `</tool_call>`: Qwen3's JSON
(`{"name": ..., "arguments": {...}}`) and the XML of Qwen3-Coder and Qwen3.5
(`<function=NAME>` with a `<parameter=KEY>` block per argument). Both parse from any output; the
grammar follows the template's own form. A block that does not parse stays in the content as
written, and whitespace around a parsed block goes with it. Reasoning is the text in
`<think>...</think>` at the output's start, or up to `</think>` when the prompt opened it (as
Qwen3.6's template does when thinking is on), as vLLM's `qwen3` reasoning parser reads it.

`ChatOutput` is the one parser: it decides only what no later text can change, so a stream cut
anywhere gives, piece by piece, what the whole text gives at once."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
JSON_FORM, XML_FORM = "json", "xml"
CHOICES = ("auto", "none", "required")  # beside a tool's name
# How deep a tool's parameters may nest, in JSON objects and lists (a schema level is two):
# deeper schemas are refused before any walk, so closing one or compiling its grammar never
# recurses past the stack.
MAX_SCHEMA_DEPTH = 64
MAX_TOOLS = 128  # tools in one request (OpenAI's bound)
MAX_TOOLS_BYTES = 256 << 10  # their definitions, as JSON text
# A parameter's text in the XML form: anything that does not close it.
ANY_TEXT = r"([^<]|<[^\/])*"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def template_form(source: str) -> str:
    """The call form a chat template teaches: XML when it writes `<function=`."""
    return XML_FORM if "<function=" in source else JSON_FORM


def read_tools(text: str) -> dict[str, dict[str, Any]]:
    """A request's tools (OpenAI's definitions as JSON text) by name: each one's parameters
    schema; `ValueError` with a sentence naming the faulty one."""
    if not text:
        return {}
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TOOLS_BYTES:
        raise ValueError(
            f"tools is {size} bytes of JSON; this server takes at most {MAX_TOOLS_BYTES}"
        )
    try:
        tools = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"tools is not JSON text: {e}") from None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {type: function, function: {name, ...}}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools lists {len(tools)} tools; this server takes at most {MAX_TOOLS}")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{type: function, function: {{name, ...}}}}")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name or not re.fullmatch(r"[\w.:-]+", name):
            raise ValueError(
                f"tools[{i}].function.name must be letters, digits, _ . : or - (OpenAI's names)"
            )
        if name in out:
            raise ValueError(f"tools[{i}].function.name {name!r} names a tool twice")
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        check_depth(params, f"tools[{i}].function.parameters")
        out[name] = params
    return out


def json_depth(value: Any) -> int:
    """How deep objects and lists nest in `value` (a scalar: 0), walked without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth + 1)
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return deepest


def check_depth(value: Any, where: str) -> None:
    """`ValueError` with a sentence when `value` nests past `MAX_SCHEMA_DEPTH`."""
    depth = json_depth(value)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"{where} nests {depth} levels deep; this server takes at most {MAX_SCHEMA_DEPTH}"
        )


def check_choice(choice: str, tools: Mapping[str, Any]) -> None:
    """`tool_choice` against the request's tools; `ValueError` with a sentence."""
    if not choice or choice in CHOICES:
        if choice == "required" and not tools:
            raise ValueError('tool_choice is "required"; the request has no tools')
        return
    if choice not in tools:
        names = ", ".join(sorted(tools)) or "none"
        raise ValueError(f"tool_choice names {choice!r}, not one of the request's tools ({names})")


def call_grammar(
    tools: Mapping[str, dict[str, Any]], choice: str, form: str, parallel: bool
) -> str | None:
    """A Lark grammar (llguidance's dialect) whose every sentence is one call (`parallel`:
    one or more) of the chosen tools in `form`, each fitting its schema; None when the choice
    constrains nothing (auto, none)."""
    if choice in ("", "auto", "none"):
        return None
    names = sorted(tools) if choice == "required" else [choice]
    more = ' ("\\n" call)*' if parallel else ""
    rules = [f"start: call{more}"]
    if form == JSON_FORM:
        schema = {
            "anyOf": [_json_call_schema(n, tools[n]) for n in names],
            "x-guidance": {"whitespace_flexible": False},
        }
        rules.append(
            f'call: "{_lark(TOOL_OPEN)}\\n" %json {json.dumps(schema)} "\\n{_lark(TOOL_CLOSE)}"'
        )
        return "\n".join(rules) + "\n"
    functions = " | ".join(f"f{i}" for i in range(len(names)))
    rules.append(f'call: "{_lark(TOOL_OPEN)}\\n" ({functions}) "{_lark(TOOL_CLOSE)}"')
    rules.append(f"TEXT: /{ANY_TEXT}/")
    for i, n in enumerate(names):
        rules.append(f'f{i}: "<function={n}>\\n" {_xml_parameters(tools[n])} "</function>\\n"')
    return "\n".join(rules) + "\n"


def _json_call_schema(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _closed(params)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _closed(schema: Any) -> Any:
    """`schema` with every object that lists its properties closed to others where it does
    not say: a call names the parameters its tool declares (OpenAI's strict mode does the
    same), and a sampled call cannot run on through invented ones. Each node is visited once
    (the schema's depth is bounded by `check_depth`)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    props = schema.get("properties")
    out = {k: _closed(v) for k, v in schema.items() if k != "properties"}
    if isinstance(props, dict):
        out["properties"] = {p: _closed(v) for p, v in props.items()}
        out.setdefault("additionalProperties", False)
    elif "properties" in schema:
        out["properties"] = _closed(props)
    return out


def _xml_parameters(params: dict[str, Any]) -> str:
    """Each property in the schema's order, the required ones always; a string's value as
    text, any other as JSON fitting its schema."""
    props = params.get("properties") or {}
    required = set(params.get("required") or ())
    parts = []
    for key, schema in props.items():
        value = _xml_text(schema) if _is_text(schema) else f"%json {json.dumps(_closed(schema))}"
        part = f'("<parameter={_lark(key)}>\\n" {value} "\\n</parameter>\\n")'
        parts.append(part if key in required else part + "?")
    return " ".join(parts) or '""'


def _is_string(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string" and "enum" not in schema


def _is_text(schema: Any) -> bool:
    """Whether the XML form writes the value as bare text: a string, or one of strings."""
    enum = schema.get("enum") if isinstance(schema, dict) else None
    strings = isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)
    return _is_string(schema) or strings


def _xml_text(schema: dict[str, Any]) -> str:
    """A bare-text value's rule: one of its strings, its pattern, its lengths, or any text."""
    if "enum" in schema:
        return "(" + " | ".join(f'"{_lark(v)}"' for v in schema["enum"]) + ")"
    if isinstance(schema.get("pattern"), str):
        return "/" + schema["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/") + "/"
    if "maxLength" in schema or "minLength" in schema:
        least, most = int(schema.get("minLength", 0)), schema.get("maxLength")
        return f"/[^<]{{{least},{'' if most is None else int(most)}}}/"
    return "TEXT"


def _lark(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's shape: a message's call, or with `index` a streamed one."""
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def parse_call(body: str, tools: Mapping[str, dict[str, Any]]) -> ToolCall | None:
    """The call in one `<tool_call>` block's body, in either form, or None."""
    body = body.strip()
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):  # JSON nested past the stack too
            return None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return None
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or not isinstance(args, dict):
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
    match = _FUNCTION.fullmatch(body)
    if match is None:
        return None
    name = match.group(1).strip()
    props = (tools.get(name) or {}).get("properties") or {}
    args = {}
    for key, raw in _PARAMETER.findall(match.group(2)):
        key = key.strip()
        args[key] = _xml_value(_trim_newlines(raw), props.get(key))
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _trim_newlines(raw: str) -> str:
    """A parameter's value without the newline the form puts on each side of it."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _xml_value(raw: str, schema: Any) -> Any:
    """A value as its schema types it: text for a string (or no schema), else JSON, else the
    text as written (as vLLM's qwen3_coder parser falls back)."""
    if schema is None or _is_text(schema):
        return raw
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


class ChatOutput:
    """One choice's output as OpenAI's message parts, as its text arrives: `push` each piece,
    then `close`; each returns the deltas decided so far (`reasoning_content`, `content` or
    `tool_calls` dicts). `tools`: the request's (None: calls are left as text); `reasoning`:
    split `<think>`; `opened`: the prompt opened the reasoning."""

    def __init__(
        self,
        tools: Mapping[str, dict[str, Any]] | None,
        reasoning: bool,
        opened: bool = False,
        parallel: bool = True,
    ) -> None:
        self.tools, self.parallel = tools, parallel
        self.text = ""
        self.state = ("think" if opened else "start") if reasoning else "content"
        self.at = 0  # the text before it is decided
        self.after_call = False  # whitespace right after a parsed call (or `</think>`) goes with it
        self.calls: list[ToolCall] = []

    def push(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        return self._advance(final=False)

    def close(self) -> list[dict[str, Any]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.state == "start":
            if not final and THINK_OPEN.startswith(self.text):
                return out
            if self.text.startswith(THINK_OPEN):
                self.state, self.at = "think", len(THINK_OPEN)
            else:
                self.state = "content"
        if self.state == "think":
            end = self.text.find(THINK_CLOSE, self.at)
            stop = (
                end
                if end >= 0
                else len(self.text) - (0 if final else _held(self.text, self.at, THINK_CLOSE))
            )
            if stop > self.at:
                out.append({"reasoning_content": self.text[self.at : stop]})
            self.at = stop
            if end < 0:
                return out
            self.state, self.at = "content", end + len(THINK_CLOSE)
            self.after_call = True  # the blank lines after the reasoning go with it
        out += self._content(final)
        return out

    def _content(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self.after_call:
                rest = self.text[self.at :]
                skip = len(rest) - len(rest.lstrip())
                self.at += skip
                if self.at == len(self.text) and not final:
                    return out
                self.after_call = False
            if self.tools is None:
                self._emit(out, len(self.text))
                return out
            q = self.text.find(TOOL_OPEN, self.at)
            if q < 0:
                held = 0 if final else _held(self.text, self.at, TOOL_OPEN)
                tail = self.text[self.at : len(self.text) - held]
                held += 0 if final else len(tail) - len(tail.rstrip())
                self._emit(out, len(self.text) - held)
                return out
            before = self.text[self.at : q]
            start = self.at + len(before.rstrip())  # the block takes the whitespace before it
            e = self.text.find(TOOL_CLOSE, q + len(TOOL_OPEN))
            if e < 0:
                if final:  # cut short: text as written
                    self._emit(out, len(self.text))
                else:
                    self._emit(out, start)
                return out
            call = None
            if self.parallel or not self.calls:
                call = parse_call(self.text[q + len(TOOL_OPEN) : e], self.tools)
            end = e + len(TOOL_CLOSE)
            if call is None:
                self._emit(out, end)
                continue
            self._emit(out, start)
            out.append({"tool_calls": [call.message(len(self.calls))]})
            self.calls.append(call)
            self.at, self.after_call = end, True

    def _emit(self, out: list[dict[str, Any]], stop: int) -> None:
        if stop > self.at:
            out.append({"content": self.text[self.at : stop]})
            self.at = stop


def _held(text: str, at: int, marker: str) -> int:
    """The length of the longest end of `text[at:]` that begins `marker` (and may yet
    become it)."""
    for n in range(min(len(marker) - 1, len(text) - at), 0, -1):
        if marker.startswith(text[len(text) - n :]):
            return n
    return 0


def merge(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """A whole message's parts from its deltas: texts joined, calls listed (None: none)."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    message: dict[str, Any] = {"content": content or None if calls else content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return message
