"""One port, one server: every listener of both processes binds its port exclusively, and a
port in use ends the process with status 2 and a sentence naming the port and its flag, checked
before anything loads. Torch- and grpc-free.

gRPC servers share a port with any other that asks for it (SO_REUSEPORT) unless built with
`EXCLUSIVE`; the HTTP listeners (uvicorn's, Prometheus') set only SO_REUSEADDR, which on Linux
lets a port's lingering closed connections be reused but never a listening socket's port."""

from __future__ import annotations

import errno
import socket

from protos.tls import FlagError

EXCLUSIVE = (("grpc.so_reuseport", 0),)  # grpc server options: refuse a port in use


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (0: a free port) as uvicorn binds one; OSError when the
    port cannot be had."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def refusal(host: str, port: int, flag: str, error: OSError) -> FlagError:
    """The sentence for a port `flag` named that could not be bound."""
    if error.errno == errno.EADDRINUSE:
        return FlagError(f"port {port} ({flag}) is in use by another process")
    return FlagError(f"{host}:{port} ({flag}) cannot be bound: {error.strerror or error}")


def check_free(host: str, ports: dict[str, int | None]) -> None:
    """Each port (by the flag that sets it; 0 and None are skipped) free on `host` now, else
    FlagError naming the first taken one: a process refuses a busy port before it loads."""
    for flag, port in ports.items():
        if not port:
            continue
        try:
            bind(host, port).close()
        except OSError as e:
            raise refusal(host, port, flag, e) from None
