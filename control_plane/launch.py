"""Start a GPU service process and wait until it serves."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def start_gpu_service(
    model_dir: Path, *extra: str, timeout: float = 120.0
) -> tuple[subprocess.Popen, str]:
    """A `met gpu-service serve` child on a free loopback port; returns it and its address
    once its health check says SERVING."""
    cmd = [
        sys.executable,
        "-m",
        "control_plane.cli",
        "gpu-service",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"the GPU service did not start: {line!r}")
    target = line.split("listening on", 1)[1].strip()
    # Keep draining the child's output so a full pipe never blocks it.
    threading.Thread(target=_forward, args=(proc.stdout,), daemon=True).start()
    wait_serving(target, timeout)
    return proc, target


def _forward(stream: IO[str]) -> None:
    for line in stream:
        sys.stderr.write(f"[gpu-service] {line}")


def wait_serving(target: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} did not become SERVING within {timeout} s")
            time.sleep(0.05)  # polling a child that loads its weights


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM, then the exit status."""
    proc.terminate()
    return proc.wait(timeout)
