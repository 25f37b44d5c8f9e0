"""What the bench's comparisons run on: an in-process engine compiled where the service
children compile, children that read and fill the user's compile cache while the cost tables
stay the run's own, and the busy processes of `python -m tools.bench.split --load`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from gpu_service.engine import compiled
from gpu_service.model.config import ServiceConfig
from tools.bench.workload import busy, scratch_env, served, settled


def test_the_in_process_engine_compiles_as_a_service_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compiled, "compiler_missing", lambda: None)
    monkeypatch.setenv(compiled.NO_COMPILE_ENV, "1")
    assert served(ServiceConfig(max_context=256)) == ServiceConfig(max_context=256)
    monkeypatch.delenv(compiled.NO_COMPILE_ENV)
    assert served(ServiceConfig(max_context=256)).compile is True
    monkeypatch.setattr(compiled, "compiler_missing", lambda: "no C++ compiler")
    assert served(ServiceConfig()).compile is False


def test_a_scratch_cost_cache_keeps_the_users_compile_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(compiled.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    env = scratch_env(str(tmp_path / "scratch"))
    assert env == {
        "XDG_CACHE_HOME": str(tmp_path / "scratch"),
        compiled.CACHE_ENV: str(tmp_path / "home" / "met" / "compile"),
    }
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "inductor"))
    assert compiled.cache_dir() == tmp_path / "inductor", "inductor's own switch comes first"
    assert scratch_env("s")[compiled.CACHE_ENV] == str(tmp_path / "inductor")


def test_busy_processes_spin_for_the_block_only() -> None:
    with busy(2) as spinners:
        assert len(spinners) == 2 and all(p.poll() is None for p in spinners)
    assert all(p.poll() is not None for p in spinners)
    with busy(0) as none:
        assert none == []


def test_settled_waits_for_the_background_compiles() -> None:
    pending = [2, 1, 0, 5]

    class Model:
        def capabilities(self) -> SimpleNamespace:
            return SimpleNamespace(compiles_pending=pending.pop(0))

    settled(Model, poll_s=0.0)  # type: ignore[arg-type]
    assert pending == [5], "polled until none was pending, and no further"
