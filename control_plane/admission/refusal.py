"""A request refused: the exception every part of admission raises, and its usual code."""

from __future__ import annotations

import grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


class BadRequest(Exception):
    """A request refused: its status, a sentence, and the field to blame in OpenAI's or vLLM's
    name (what the HTTP front reports as `param`; None: the request as a whole)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param
