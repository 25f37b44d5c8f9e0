"""Start the service processes and wait until they serve."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import tls
from protos.model import ADMIN_KEY_ENV


class ChildExited(RuntimeError):
    """A service child that ended before it served; it said why on its own stderr."""

    def __init__(self, process: str, status: int) -> None:
        super().__init__(f"the {process} exited with status {status} before serving")
        self.status = status


# How long a GPU service child may load before it serves: one compiling its step with a cold
# compile cache loads for minutes (about 170 s for the bundled model on two quiet cores). A
# child that ends is caught at once (`ChildExited`): the bound is only for a load that hangs.
GPU_SERVICE_START_S = 1200.0


def start_gpu_service(
    model_dir: Path | str,
    *extra: str,
    timeout: float = GPU_SERVICE_START_S,
    credentials: grpc.ChannelCredentials | None = None,
) -> tuple[subprocess.Popen, str]:
    """A `met gpu-service serve` child (a free loopback port unless `extra` names one);
    returns it and its address once its health check, over TLS with `credentials` (what a child
    given `--tls-*` flags in `extra` asks of its clients), says SERVING. Its admin key is env
    `ADMIN_KEY_ENV`, set here to a random key unless set already: the child inherits it, and
    so do this process's `GrpcModel`s and the control planes it starts."""
    set_admin_key()
    port = () if "--port" in extra else ("--port", "0")
    return start("gpu-service", ["--model", str(model_dir), *port, *extra], timeout, credentials)


def set_admin_key() -> None:
    """Env `ADMIN_KEY_ENV` set to a random key unless set already. Whoever starts GPU services
    from several threads calls it first, so that no two of them draw different keys."""
    os.environ.setdefault(ADMIN_KEY_ENV, secrets.token_urlsafe(24))


def start_control_plane(
    gpu_service: str,
    *extra: str,
    timeout: float = 60.0,
    credentials: grpc.ChannelCredentials | None = None,
    seen: list[str] | None = None,
) -> tuple[subprocess.Popen, str]:
    port = () if "--port" in extra else ("--port", "0")
    return start(
        "control-plane", ["--gpu-service", gpu_service, *port, *extra], timeout, credentials, seen
    )


def start(
    process: str,
    args: list[str],
    timeout: float,
    credentials: grpc.ChannelCredentials | None = None,
    seen: list[str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """The child and its gRPC address; the lines it printed before that one go to `seen`
    (other addresses it announces: metrics, the HTTP API)."""
    cmd = [sys.executable, "-m", "met", process, "serve", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            break
        sys.stderr.write(f"[{process}] {line}")
        if seen is not None:
            seen.append(line)
    else:
        proc.kill()
        raise ChildExited(process, proc.wait())
    target = line.split("listening on", 1)[1].split()[0]
    # Keep draining the child's output so a full pipe never blocks it.
    threading.Thread(target=_forward, args=(process, proc.stdout), daemon=True).start()
    wait_serving(target, timeout, credentials, proc)
    return proc, target


def _forward(process: str, stream: IO[str]) -> None:
    for line in stream:
        sys.stderr.write(f"[{process}] {line}")


def wait_serving(
    target: str,
    timeout: float = 120.0,
    credentials: grpc.ChannelCredentials | None = None,
    child: subprocess.Popen | None = None,
) -> None:
    """Until `target` says SERVING; TimeoutError after `timeout`, ChildExited as soon as the
    `child` serving it has ended."""
    deadline = time.monotonic() + timeout
    with tls.open_channel(target, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if child is not None and child.poll() is not None:
                raise ChildExited(f"service at {target}", child.returncode)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} did not become SERVING within {timeout} s")
            time.sleep(0.05)  # polling a child that loads its weights


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM, then the exit status."""
    proc.terminate()
    return proc.wait(timeout)
