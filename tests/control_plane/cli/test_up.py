"""`met up --replicas N`: the flag's validation, and starting and stopping the GPU-service
children with the launch functions replaced (no process starts here)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from types import SimpleNamespace

import pytest

from control_plane.cli import up
from met.main import build_parser
from protos.model import ADMIN_KEY_ENV


class FakeStarts:
    """`start_gpu_service` and `stop` stand-ins: child i is `SimpleNamespace(i=i)` on port
    50100 + i; a start numbered in `failing` raises instead; a stop returns `codes[i]`."""

    def __init__(self, count: int, failing: tuple[int, ...] = (), codes: tuple[int, ...] = ()):
        # Every start waits for all the others: the test fails unless they run at once.
        self.barrier = threading.Barrier(count, timeout=10)
        self.failing = failing
        self.codes = codes
        self.num_started = 0
        self.stopped: list[int] = []
        self.lock = threading.Lock()

    def start(self, *_args: object) -> tuple[SimpleNamespace, str]:
        with self.lock:
            i = self.num_started
            self.num_started += 1
        self.barrier.wait()
        if i in self.failing:
            raise RuntimeError(f"start {i} failed")
        return SimpleNamespace(i=i), f"127.0.0.1:{50100 + i}"

    def stop(self, proc: SimpleNamespace) -> int:
        with self.lock:
            self.stopped.append(proc.i)
        return self.codes[proc.i] if self.codes else 0


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_one_replica_by_default() -> None:
    assert _parse().replicas == 1
    assert _parse("--replicas", "3").replicas == 3


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_fewer_than_one_replica_exits_2(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse("--replicas", value)
    assert exit_info.value.code == 2
    assert "at least 1" in capsys.readouterr().err


def test_every_child_starts_at_once_on_its_own_port() -> None:
    fake = FakeStarts(3)
    children = up.start_all(3, fake.start, fake.stop)
    assert len({target for _, target in children}) == 3
    assert fake.stopped == []


def test_a_failed_start_stops_the_children_that_started() -> None:
    fake = FakeStarts(3, failing=(1,))
    with pytest.raises(RuntimeError, match="start 1 failed"):
        up.start_all(3, fake.start, fake.stop)
    assert sorted(fake.stopped) == [0, 2]


def test_stopping_prints_each_status_and_returns_the_first_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fake = FakeStarts(3, codes=(0, 3, 5))
    children = up.start_all(3, fake.start, fake.stop)
    assert up.stop_all(children, fake.stop) == 3
    assert sorted(fake.stopped) == [0, 1, 2]
    out = capsys.readouterr().out
    assert out.count("gpu-service exited with status") == 3
    assert "status 5" in out
    assert up.stop_all(children[:1], fake.stop) == 0


def test_run_gives_the_control_plane_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeStarts(2)
    served: list[str] = []

    async def serve(args: argparse.Namespace, _security: object) -> None:
        served.append(args.gpu_service)

    monkeypatch.setenv(ADMIN_KEY_ENV, "key")
    monkeypatch.setattr(up, "start_gpu_service", fake.start)
    monkeypatch.setattr(up, "stop", fake.stop)
    monkeypatch.setattr(up, "serve", serve)
    assert up.run(_parse("--replicas", "2"), []) == 0
    (targets,) = served
    assert sorted(targets.split(",")) == ["127.0.0.1:50100", "127.0.0.1:50101"]
    assert sorted(fake.stopped) == [0, 1]


def test_a_signal_while_children_start_raises_stopped_and_the_handlers_come_back() -> None:
    """SIGTERM while the starts run interrupts the wait for them (the caller then stops every
    child started); the process's own handlers are back afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    release = threading.Event()

    def start() -> tuple[SimpleNamespace, str]:
        release.wait(10)  # a child still loading
        return SimpleNamespace(i=0), "127.0.0.1:50100"

    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(up.Stopped, match="SIGTERM"), up.signals_raise():
        up.start_all(1, start, lambda _proc: 0)
    release.set()
    assert signal.getsignal(signal.SIGTERM) is before
