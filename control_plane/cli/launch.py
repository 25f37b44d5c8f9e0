"""Start the service processes, wait until they serve, and stop them.

Each child starts in a session (process group) of its own, told this process's pid
(`stopping.PARENT_ENV`) so that it stops itself should this process die. `stop` ends the child
and whatever it started (a compiler inductor runs): SIGTERM, then SIGKILL to its whole group
after `STOP_BOUND_S`; `stop_started` stops every child not stopped yet, however far its start
has got."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import stopping, tls
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
# How long `stop` waits for a child's own stop (`stopping.STOP_S`, with room for a loaded
# machine) before it kills the child's process group.
STOP_BOUND_S = 15.0


class _Started:
    """The children this process started and has not stopped. Once `close`d, no child
    starts: a start racing a stop would otherwise outlive it."""

    def __init__(self) -> None:
        self.procs: set[subprocess.Popen] = set()
        self.closed = False
        self.lock = threading.Lock()

    def spawn(self, process: str, cmd: list[str]) -> subprocess.Popen:
        env = {**os.environ, stopping.PARENT_ENV: str(os.getpid())}
        with self.lock:
            if self.closed:  # refused, not started: nothing to report
                raise ChildExited(process, 0)
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
            )
            self.procs.add(proc)
        return proc

    def close(self) -> list[subprocess.Popen]:
        with self.lock:
            self.closed = True
            return list(self.procs)


_STARTED = _Started()


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
    """The child and its gRPC address, once it serves; the lines it printed before the address
    go to `seen` (other addresses it announces: metrics, the HTTP API)."""
    proc, target = spawn(process, args, seen)
    try:
        wait_serving(target, timeout, credentials, proc)
    except BaseException:
        stop(proc)  # a child that does not serve is not left running
        raise
    return proc, target


def spawn(
    process: str, args: list[str], seen: list[str] | None = None
) -> tuple[subprocess.Popen, str]:
    """A `met PROCESS serve` child and its gRPC address, once announced: it may still be
    loading (`wait_serving` waits until it serves). Its output goes on to this process's
    stderr."""
    proc = _STARTED.spawn(process, [sys.executable, "-m", "met", process, "serve", *args])
    try:
        target = _announced(process, proc, seen)
    except BaseException:
        stop(proc)
        raise
    # Keep draining the child's output so a full pipe never blocks it.
    threading.Thread(target=_forward, args=(process, proc.stdout), daemon=True).start()
    return proc, target


def _announced(process: str, proc: subprocess.Popen, seen: list[str] | None) -> str:
    """The address the child announces, its lines before it to `seen`; ChildExited when it
    ends first."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            return line.split("listening on", 1)[1].split()[0]
        sys.stderr.write(f"[{process}] {line}")
        if seen is not None:
            seen.append(line)
    raise ChildExited(process, stop(proc))


def _forward(process: str, stream: IO[str]) -> None:
    with contextlib.suppress(ValueError):  # the pipe closed by `stop` meanwhile
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


def stop(proc: subprocess.Popen, timeout: float = STOP_BOUND_S, sig: int = signal.SIGTERM) -> int:
    """`sig` (SIGTERM; SIGINT is Ctrl-C's), then the exit status; SIGKILL after `timeout`
    seconds. Either way what the child started and left running (its process group) is
    killed too."""
    proc.send_signal(sig)
    _ended(proc, timeout)
    if proc.returncode is None:  # still its pid (a zombie at most), so still its group's id
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with _STARTED.lock:
        _STARTED.procs.discard(proc)
    return proc.wait()


def _ended(proc: subprocess.Popen, timeout: float) -> None:
    """Until `proc` has ended or `timeout` has passed, without reaping it (`WNOWAIT`)."""
    deadline = time.monotonic() + timeout
    while proc.returncode is None and time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                return
        except ChildProcessError:  # reaped by another thread's `poll`
            return
        time.sleep(0.02)  # polling a child's exit


def stop_started() -> list[int]:
    """Every child this process started and has not stopped, stopped at once (as `stop`), and
    no child started from now on -> their exit statuses."""
    procs = _STARTED.close()
    with ThreadPoolExecutor(max_workers=max(len(procs), 1)) as pool:
        return list(pool.map(stop, procs))
