"""The status and sentence a failed step ends its requests with."""

from __future__ import annotations

import grpc

from protos.model import ModelError


def step_status(error: Exception) -> tuple[str, str]:
    """-> (gRPC status code name, sentence) a failed step ends its requests with."""
    if isinstance(error, grpc.RpcError):
        code = getattr(error, "code", lambda: None)()
        details = getattr(error, "details", lambda: None)() or str(error)
        name = code.name if code is not None else "UNAVAILABLE"
        if name == "UNAUTHENTICATED":
            # The service ended this control plane's session (it stopped answering past the
            # session timeout): the link was lost; the client's own credentials are fine.
            name = "UNAVAILABLE"
        return name, f"the GPU service failed: {details}"
    if isinstance(error, OSError):
        return "UNAVAILABLE", f"the GPU service is unreachable: {error}"
    if isinstance(error, ModelError):
        return error.code, f"the GPU service refused: {error}"
    return "INTERNAL", f"the scheduler failed: {type(error).__name__}: {error}"
