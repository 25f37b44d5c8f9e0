"""What an OpenAI request asks of its output's form: `response_format`, vLLM's structured
outputs (and their older `guided_*` names), and the tools with `tool_choice`, as the wire
carries them; the `Door` checks them against each other and the model's template."""

from __future__ import annotations

import json
from typing import Any

from control_plane.fronts.openai_fields import (
    InvalidParam,
    bool_field,
    json_text,
    list_field,
    object_field,
    shown,
)

FORMATS = "text, json_object or json_schema"


# vLLM's structured outputs: each key as (the wire's grammar kind, how its value becomes its
# text); the older top-level `guided_*` names take the same values.
STRUCTURED = {
    "json": (
        "json_schema",
        lambda v: v if isinstance(v, str) else json_text(v, "structured_outputs"),
    ),
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
        raise InvalidParam("structured_outputs", f"a choice is {shown(text)}; each is text")
    return "".join("\\" + c if c in REGEX_META else c for c in text)


def _structured(body: dict) -> tuple[str, str] | None:
    """vLLM's `structured_outputs` (or its `guided_*` fields): json, regex, choice,
    grammar (llguidance's Lark) or json_object, one of them; any other key refused."""
    given = object_field(body, "structured_outputs") or {}
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
        raise InvalidParam("structured_outputs", f"structured_outputs.{key} is {shown(value)}")
    if key == "choice" and not value:
        raise InvalidParam("structured_outputs", "structured_outputs.choice is empty")
    return (kind, text(value))


def response_format(body: dict) -> tuple[str, str] | None:
    """OpenAI's `response_format`, or vLLM's structured outputs (never both)."""
    structured, form = _structured(body), _openai_format(body)
    if structured is not None and form is not None:
        raise InvalidParam(
            "response_format", "give response_format or structured_outputs, not both"
        )
    return structured or form


def _openai_format(body: dict) -> tuple[str, str] | None:
    form = object_field(body, "response_format")
    kind = None if form is None else form.get("type")
    if form is None or kind == "text":
        return None
    if kind == "json_object":
        return ("json_schema", json.dumps({"type": "object"}))  # OpenAI's: an object
    if kind == "json_schema":
        schema = (object_field(form, "json_schema", "response_format.json_schema") or {}).get(
            "schema"
        )
        if not isinstance(schema, dict | bool):
            raise InvalidParam(
                "response_format", "response_format.json_schema.schema must be a JSON schema"
            )
        return ("json_schema", json_text(schema, "response_format"))
    raise InvalidParam(
        "response_format", f"response_format type {shown(kind)} is unknown; use {FORMATS}"
    )


def tools_fields(body: dict) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls`, or OpenAI's older `functions` and
    `function_call`, as the wire carries them (the `Door` checks them against each other)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    old_tools, old_choice = body.get("functions"), body.get("function_call")
    if old_tools is not None or old_choice is not None:
        if tools is not None or choice is not None:
            raise InvalidParam(
                "functions", "functions and function_call are tools' older names; give one pair"
            )
        tools = [{"type": "function", "function": f} for f in list_field(body, "functions")]
        choice = old_choice
    if tools is not None and not isinstance(tools, list):
        raise InvalidParam("tools", f"tools is {shown(tools)}; it must be a list of tools")
    return {
        "tools": json_text(tools, "tools") if tools else "",
        "tool_choice": _tool_choice(choice),
        "parallel_tool_calls": bool_field(body, "parallel_tool_calls"),
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
            f"tool_choice is {shown(choice)}; use auto, none, required or "
            '{"type": "function", "function": {"name": ...}}',
        )
    return name
