"""OpenAI request bodies' fields read by type, each refusal an `InvalidParam` naming the
parameter and quoting what the client sent: the readers `openai_body` and `openai_formats`
share."""

from __future__ import annotations

import json
from typing import Any

import grpc

from control_plane.admission.door import INVALID, BadRequest
from protos import checks
from protos.checks import UINT32


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


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_field(
    obj: dict, key: str, param: str | None = None, most: int = UINT32, least: int = 0
) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not is_int(value) or not least <= value <= most:
        name = param or key
        raise InvalidParam(
            name, f"{name} is {shown(value)}; it must be an integer, {least} to {most}"
        )
    return value


def ids_field(values: list, param: str) -> list[int]:
    bad = [v for v in values if not is_int(v) or not 0 <= v <= UINT32]
    if bad:
        raise InvalidParam(
            param, f"{param} holds {shown(bad[0])}; a token id is an integer, 0 to {UINT32}"
        )
    return values


def number_field(obj: dict, key: str) -> float | None:
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
    raise InvalidParam(key, f"{key} is {shown(value)}; it must be a number")


def typed_field(obj: dict, key: str, kind: type, what: str, param: str | None) -> Any:
    """`obj[key]` when absent, null or of `kind`; otherwise refused, naming `param`."""
    value = obj.get(key)
    if value is None or isinstance(value, kind):
        return value
    name = param or key
    raise InvalidParam(name, f"{name} is {shown(value)}; it must be {what}")


def bool_field(obj: dict, key: str, param: str | None = None) -> bool | None:
    return typed_field(obj, key, bool, "true or false", param)


def str_field(obj: dict, key: str, param: str | None = None) -> str | None:
    return typed_field(obj, key, str, "a string", param)


def list_field(obj: dict, key: str) -> list:
    value = obj.get(key)
    if value is None or isinstance(value, list):
        return value or []
    raise InvalidParam(key, f"{key} is {shown(value)}; it must be a list")


def object_field(obj: dict, key: str, param: str | None = None) -> dict | None:
    value = obj.get(key)
    if value is None or isinstance(value, dict):
        return value
    name = param or key
    raise InvalidParam(name, f"{name} is {shown(value)}; it must be an object")


def shown(value: Any) -> str:
    """A value as JSON, cut short: sentences quote what the client sent."""
    try:
        text = json.dumps(value)
    except RecursionError:
        return "a value nested past what this server reads"
    return text if len(text) <= 40 else text[:37] + "..."


def json_text(value: Any, param: str) -> str:
    """A parsed value as JSON text again, for the wire; a value the body held nested near
    the parser's bound can nest past the encoder's once wrapped, and is refused naming
    `param`."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:
        raise InvalidParam(param, f"{param} nests too deep") from None


def token_ids_field(obj: dict, key: str) -> tuple[int, ...] | None:
    return tuple(ids_field(list_field(obj, key), key)) or None
