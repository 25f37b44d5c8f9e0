"""Stops at any moment, over real processes: SIGTERM or Ctrl-C (SIGINT) ends the GPU service
and the control plane with status 0 within `STOP_S` during a cold start's compile (in the
background: the service serves at once), a background compile a call queued, a model load and
a request, never with a C++ abort or a traceback;
the calls in flight end UNAVAILABLE (HTTP 503) with a sentence. `met up` stopped during a cold
start leaves no process behind, and a child whose parent was killed stops by itself.

The compiles are real: the tiny model at one key (`ONE_KEY`), compiled into a cache of the
module's own, so that the first start compiles cold and the second loads its start-up key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from control_plane.cli.launch import spawn, start_control_plane, start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from gpu_service.engine.compiled import CACHE_ENV, NO_COMPILE_ENV
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.stopping import STOP_S

# Slow: starts, compiles and stops service processes.
pytestmark = pytest.mark.slow

# One compiled key: no drafts (the verify of one row, no chain), one key length.
ONE_KEY = ("--compile", "--verify-tiers", "8:0", "--max-context", "256")
SHUTTING_DOWN = "is shutting down; retry the request"
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inductor")


def stopped(proc: subprocess.Popen, moment: str, sig: int = signal.SIGTERM) -> float:
    """`sig` to `proc`, checked to end it with status 0 within `STOP_S` -> the seconds it took
    (past `STOP_S`, `stop` kills it and the status fails the check)."""
    start = time.monotonic()
    status = stop(proc, STOP_S, sig)
    seconds = time.monotonic() - start
    print(f"\n{moment}: {signal.Signals(sig).name} -> status {status} in {seconds:.2f} s")
    assert status == 0 and seconds < STOP_S, (status, seconds)
    return seconds


def until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.1)  # polling another process's progress


def compiling(cache: Path) -> bool:
    """Whether inductor has begun writing into `cache`: the step is being compiled."""
    return any(files for _, _, files in os.walk(cache))


def clean(capfd: pytest.CaptureFixture) -> str:
    """What the processes wrote to stderr, checked for a C++ abort and a traceback; what the
    test printed goes on to its report."""
    out, err = capfd.readouterr()
    sys.stdout.write(out)
    assert "terminate called" not in err and "Traceback" not in err, err[-3000:]
    return err


def on_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """`fn` on a thread -> the thread and a list that gets its result or its error."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def refused(out: list[object]) -> None:
    """The call ended UNAVAILABLE with the stop's sentence."""
    (error,) = out
    assert isinstance(error, grpc.RpcError), error
    assert error.code() == UNAVAILABLE and SHUTTING_DOWN in (error.details() or ""), error


def test_start_up_compile(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """Ctrl-C a second into a cold start's compile, which runs in the background of a service
    already serving, and SIGTERM to a control plane started against it."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    gpu, target = spawn("gpu-service", ["--model", str(tiny_dir), "--port", "0", *ONE_KEY])
    control, _ = spawn("control-plane", ["--gpu-service", target, "--port", "0"])
    until(lambda: compiling(tmp_path), 120, "the start-up compile")
    time.sleep(1.0)
    stopped(control, "control plane, its service compiling at start-up", signal.SIGINT)
    stopped(gpu, "GPU service in its start-up compile", signal.SIGINT)
    err = clean(capfd)
    assert "compiles the step for the CPU in the background" in err
    assert "gpu-service shutting down" in err


def settled(model: GrpcModel, seconds: float = 300) -> None:
    until(lambda: not model.capabilities().compiles_pending, seconds, "the compiles")


def test_model_load(capfd: pytest.CaptureFixture) -> None:
    """SIGTERM as soon as the port is announced: the bundled model is loading (eagerly)."""
    gpu, _ = spawn("gpu-service", ["--port", "0"])
    stopped(gpu, "GPU service loading")
    err = clean(capfd)
    assert "gpu-service serving" not in err, "the load ended before the signal: no load stopped"


def test_background_compile(
    tiny_dir: Path,
    compile_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
) -> None:
    """Two sequences verified at once, where only the bucket of one is built: the call runs in
    parts, and the bucket of two compiles in the background meanwhile."""
    monkeypatch.setenv(CACHE_ENV, str(compile_cache))
    gpu, target = start_gpu_service(tiny_dir, *ONE_KEY, timeout=300)
    model = GrpcModel(target)
    settled(model)  # the start-up key, built in the background
    seqs = [model.alloc_sequence() for _ in range(2)]
    model.prefill(seqs, [[5, 6, 7], [8, 9]])
    model.decode_verify_batched([1, 2], [1, 1], seqs)
    assert model.capabilities().compiles_pending == 1
    time.sleep(1.0)
    stopped(gpu, "GPU service, a background compile running")
    model.close()
    clean(capfd)


def test_call_compile(
    tiny_dir: Path,
    compile_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
) -> None:
    """A verify that writes the live state, a key no start-up compiles and no smaller bucket
    stands in for: the call runs eagerly at once and queues the key, which compiles in the
    background while a control plane's request is served beside it (no call waits for a
    compile); both stopped during that compile."""
    monkeypatch.setenv(CACHE_ENV, str(compile_cache))  # the start-up key loads from it
    gpu, target = start_gpu_service(tiny_dir, *ONE_KEY, "--grace", "1", timeout=300)
    control, control_target = start_control_plane(
        target, "--tokenizer", str(tiny_dir), "--grace", "1"
    )
    model = GrpcModel(target)
    settled(model)
    (seq,) = [model.alloc_sequence()]
    model.prefill([seq], [[5, 6, 7]])
    model.decode_verify_batched([1], [1], [seq], write_on_accept=False)
    assert model.capabilities().compiles_pending == 1, "the call returned before its compile"
    with grpc.insecure_channel(control_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=[5], max_new_tokens=4, ignore_eos=True)
        tokens = [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]
        assert len(tokens) == 4
        assert model.capabilities().compiles_pending == 1, "served while the key compiled"
        stopped(control, "control plane, its service compiling a call's key")
    stopped(gpu, "GPU service compiling a call's key")
    model.close()
    clean(capfd)


@pytest.fixture
def long_streams(tiny_dir: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A GPU service (eager) whose context lets a stream run for seconds."""
    gpu, target = start_gpu_service(tiny_dir, "--max-context", "2048")
    yield gpu, target
    stop(gpu)


def http_completion(base: str, model: str, stream: bool) -> tuple[int, str]:
    body = {"model": model, "prompt": [5], "max_tokens": 2000, "ignore_eos": True}
    request = urllib.request.Request(
        f"{base}/completions",
        json.dumps({**body, "stream": stream}).encode(),
        {"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_request(
    capfd: pytest.CaptureFixture, long_streams: tuple[subprocess.Popen, str], tiny_dir: Path
) -> None:
    """Requests streaming when the control plane (grace 1 s) is stopped: the gRPC stream ends
    UNAVAILABLE, the HTTP stream with an error event, the whole HTTP completion with 503, each
    with the sentence; then the GPU service stopped while a second control plane's stream
    runs on it."""
    gpu, target = long_streams
    seen: list[str] = []
    control, control_target = start_control_plane(
        target, "--tokenizer", str(tiny_dir), "--http-port", "0", "--grace", "1", seen=seen
    )
    base = next(line.split(" on ")[1].split()[0] for line in seen if "OpenAI API" in line)
    long = pb.GenerateRequest(prompt_token_ids=[5], ignore_eos=True, max_new_tokens=2000)
    with grpc.insecure_channel(control_target) as channel:
        replies = pb_grpc.GenerationServiceStub(channel).Generate(long, timeout=60)
        assert next(replies).token_ids
        streamed, streamed_out = on_thread(lambda: http_completion(base, tiny_dir.name, True))
        whole, whole_out = on_thread(lambda: http_completion(base, tiny_dir.name, False))
        time.sleep(0.5)
        stopped(control, "control plane, requests streaming")
        with pytest.raises(grpc.RpcError) as ended:
            list(replies)
    assert ended.value.code() == UNAVAILABLE and SHUTTING_DOWN in ended.value.details()
    streamed.join(5)
    whole.join(5)
    ((status, body),) = streamed_out
    assert status == 200 and SHUTTING_DOWN in body.rsplit("data: ", 1)[1], body[-500:]
    assert whole_out == [(503, whole_out[0][1])] and SHUTTING_DOWN in whole_out[0][1]

    second, second_target = start_control_plane(target, "--tokenizer", str(tiny_dir))
    with grpc.insecure_channel(second_target) as channel:
        replies = pb_grpc.GenerationServiceStub(channel).Generate(long, timeout=60)
        assert next(replies).token_ids
        stopped(gpu, "GPU service, a request streaming")
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as lost:
            list(replies)
        print(
            f"the stream on the stopped service: {lost.value.code()} after "
            f"{time.monotonic() - start:.2f} s: {lost.value.details()}"
        )
    stopped(second, "control plane, its service gone")
    clean(capfd)


def _table() -> dict[int, tuple[str, int, int]]:
    """Every process: pid -> (state, parent pid, session id), from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            out[int(name)] = (fields[0], int(fields[1]), int(fields[3]))
    return out


def descendants(root: int) -> set[int]:
    table, found, todo = _table(), set(), [root]
    while todo:
        parent = todo.pop()
        for pid, (_, ppid, _) in table.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


def living(pids: set[int]) -> list[int]:
    """Those of `pids`, or in a session one of them leads, still running (a zombie has ended:
    its parent, if it is init, reaps it when it will)."""
    table = _table()
    return sorted(p for p, (state, _, sid) in table.items() if state != "Z" and {p, sid} & pids)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_met_up_stopped_during_a_cold_start_leaves_nothing(
    tiny_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """SIGTERM to `met up` while its GPU service compiles cold, with `met up`'s stdout read by
    no one: it exits 0 after its child, and no process it or its child started remains."""
    env = {k: v for k, v in os.environ.items() if k != NO_COMPILE_ENV}
    env[CACHE_ENV] = str(tmp_path)
    up = subprocess.Popen(
        [sys.executable, "-m", "met", "up", "--model", str(tiny_dir)]
        + ["--port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE,
        env=env,
    )
    assert up.stdout is not None
    up.stdout.close()  # its reader gone: its lines must not raise
    seen: set[int] = set()

    def compiling_child() -> bool:
        seen.update(descendants(up.pid))
        return compiling(tmp_path)

    until(compiling_child, 120, "the child's start-up compile")
    time.sleep(1.0)
    seen.update(descendants(up.pid))
    start = time.monotonic()
    up.send_signal(signal.SIGTERM)
    assert up.wait(STOP_S + 5) == 0
    print(f"\nmet up: status 0 in {time.monotonic() - start:.2f} s")
    until(lambda: not living(seen), 5, "the end of every process met up started")
    clean(capfd)


def test_orphan_stops_itself(tiny_dir: Path, capfd: pytest.CaptureFixture) -> None:
    """A GPU service whose parent is killed (SIGKILL: it stops nothing) stops by itself, and
    says so without a broken-pipe traceback (its stdout's reader died with the parent)."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from control_plane.cli.launch import spawn; "
            f"proc, _ = spawn('gpu-service', ['--model', {str(tiny_dir)!r}, '--port', '0']); "
            "print(proc.pid, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    start = time.monotonic()
    until(lambda: not living({child}), STOP_S, "the orphan's stop")
    print(f"\norphan gone {time.monotonic() - start:.2f} s after its parent")
    clean(capfd)
