"""TLS for both servers and for their clients: the flags, the credentials built from them,
and channels and ports opened with them. Torch-free; no flag set means plaintext.

A server takes `--tls-cert`/`--tls-key` (PEM) and, for mutual TLS, `--tls-client-ca`: it then
requires a client certificate and verifies it against that CA. A client takes three flags
under a prefix (`--gpu-service-ca`, `--gpu-service-cert`, `--gpu-service-key`): the CA that
signed the server's certificate (default: the system's roots) and its own certificate and key
for a server that requires one.

    server_creds = tls.or_exit("met gpu-service serve", tls.server_credentials, args)
    port = tls.add_port(server, f"{args.host}:{args.port}", server_creds)
    channel = tls.open_channel(target, tls.channel_credentials(args, "gpu-service"))

Flags that cannot be honoured (a certificate without its key, a client CA without a server
certificate, a file that cannot be read) raise `FlagError`; `or_exit` ends the process the way
argparse ends it on a bad flag: one sentence on stderr, status 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

T = TypeVar("T")
ChannelOptions = Sequence[tuple[str, Any]]


class FlagError(ValueError):
    """A flag the process cannot honour; the message is one sentence naming the flag."""


def or_exit(prog: str, build: Callable[[argparse.Namespace], T], args: argparse.Namespace) -> T:
    """`build(args)`, or the process ended with status 2 and the error's sentence."""
    try:
        return build(args)
    except FlagError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def read_flag_file(flag: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise FlagError(f"{flag} {path} cannot be read ({e.strerror or e}).") from None


def _read_pem(flag: str, path: Path | None) -> bytes | None:
    if path is None:
        return None
    pem = read_flag_file(flag, path)
    if b"-----BEGIN " not in pem:
        raise FlagError(f"{flag} {path} holds no PEM block.")
    return pem


def _pair(cert_flag: str, cert: Path | None, key_flag: str, key: Path | None) -> None:
    if (cert is None) != (key is None):
        given, missing = (cert_flag, key_flag) if key is None else (key_flag, cert_flag)
        raise FlagError(f"{given} needs {missing}: a certificate is served with its key.")


# -- servers ---------------------------------------------------------------------------------


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls-cert", type=Path, default=None, metavar="PEM", help="serve TLS with this chain"
    )
    parser.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="its key")
    parser.add_argument(
        "--tls-client-ca",
        type=Path,
        default=None,
        metavar="PEM",
        help="mutual TLS: require client certificates signed by this CA",
    )


def server_credentials(args: argparse.Namespace) -> grpc.ServerCredentials | None:
    """The credentials `--tls-*` name, or None for plaintext."""
    _pair("--tls-cert", args.tls_cert, "--tls-key", args.tls_key)
    if args.tls_cert is None:
        if args.tls_client_ca is not None:
            raise FlagError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS.")
        return None
    key = _read_pem("--tls-key", args.tls_key)
    cert = _read_pem("--tls-cert", args.tls_cert)
    client_ca = _read_pem("--tls-client-ca", args.tls_client_ca)
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def add_port(
    server: grpc.aio.Server,
    address: str,
    creds: grpc.ServerCredentials | None,
    flag: str = "--port",
) -> int:
    """Bind `address` (TLS when `creds` is set) and return the port; FlagError naming `flag`
    when it cannot be bound (a server built with `ports.EXCLUSIVE` shares no port)."""
    try:
        if creds is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, creds)
    except RuntimeError:
        host, port = address.rsplit(":", 1)
        raise FlagError(
            f"port {port} ({flag}) cannot be bound on {host}: another process holds it, or the "
            "address is not this machine's"
        ) from None


# -- clients ---------------------------------------------------------------------------------


def add_client_args(parser: argparse.ArgumentParser, prefix: str, peer: str) -> None:
    """`--{prefix}-ca`, `--{prefix}-cert`, `--{prefix}-key` for the channel to `peer`."""
    parser.add_argument(
        f"--{prefix}-ca",
        type=Path,
        default=None,
        metavar="PEM",
        help=f"reach {peer} over TLS, verifying it against this CA",
    )
    parser.add_argument(
        f"--{prefix}-cert",
        type=Path,
        default=None,
        metavar="PEM",
        help=f"client certificate for {peer} under mutual TLS (TLS with the system's roots "
        f"when --{prefix}-ca is not given)",
    )
    parser.add_argument(f"--{prefix}-key", type=Path, default=None, metavar="PEM", help="its key")


def channel_credentials(args: argparse.Namespace, prefix: str) -> grpc.ChannelCredentials | None:
    """The credentials the `add_client_args(parser, prefix, ...)` flags name, or None for
    plaintext (none of them given)."""
    flags = {part: f"--{prefix}-{part}" for part in ("ca", "cert", "key")}
    ca, cert, key = (getattr(args, f"{prefix}_{part}".replace("-", "_")) for part in flags)
    _pair(flags["cert"], cert, flags["key"], key)
    if ca is None and cert is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(flags["ca"], ca),
        private_key=_read_pem(flags["key"], key),
        certificate_chain=_read_pem(flags["cert"], cert),
    )


def open_channel(
    target: str, creds: grpc.ChannelCredentials | None = None, options: ChannelOptions = ()
) -> grpc.Channel:
    """A blocking channel to `target`: TLS with `creds`, plaintext without."""
    if creds is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, creds, options=options)


def open_aio_channel(
    target: str, creds: grpc.ChannelCredentials | None = None, options: ChannelOptions = ()
) -> grpc.aio.Channel:
    """`open_channel` for asyncio code."""
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, creds, options=options)
