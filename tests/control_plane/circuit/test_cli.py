"""`met circuit diff` as a command: its exit status (0 PASS, 1 FAIL, 2 could not run), the
report written on a FAIL, and the arguments refused before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from control_plane.circuit import report
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from gpu_service.model.state import DeviceState
from tests.control_plane.circuit.test_verify_batch import args


@pytest.mark.parametrize(
    ("flags", "sentence"),
    [
        (("--forwards", ""), "--forwards takes comma-separated names, not ''"),
        (("--forwards", ","), "--forwards takes comma-separated names, not ','"),
        (("--num-drafts", "0", "--mtp"), "--num-drafts takes integers of at least 1, not '0'"),
    ],
    ids=["forwards-empty", "forwards-commas", "num-drafts-0-mtp"],
)
def test_refused_arguments_exit_2(tmp_path: Path, flags: tuple[str, ...], sentence: str) -> None:
    out = tmp_path / "report.json"
    command = ["circuit", "diff", "--verify-batch", *flags, "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "met", *command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert sentence in result.stderr
    assert not out.exists()


@pytest.fixture
def tiny_engine(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """The engine `main` connects to."""
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="8:3", max_context=256))
    monkeypatch.setattr(report, "_connect", lambda *_: engine)
    return engine


def _perturb(state: DeviceState, slots: list[int]) -> None:
    state.gdn[:, slots[0]] *= 1 + 1e-6


def test_a_failing_diff_exits_1_and_writes_its_report(
    tiny_engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny_engine.add_forward("eager-perturbed", _perturb)
    out = tmp_path / "report.json"
    flags = ("--widths", "2", "--ks", "3", "--steps", "2", "--forwards", "eager-perturbed")
    assert report.main(args(*flags, "--out", str(out))) == 1
    written = json.loads(out.read_text())
    assert written["verdict"] == "FAIL" and written["reasons"]
    printed = capsys.readouterr()
    assert printed.out == f"circuit diff FAIL: 1 shapes; the report is in {out}\n"
    assert "verify-batch [3, 3]: 2 steps under eager" in printed.err, "progress before a shape"
    assert "circuit diff FAILED:\n  verify-batch [3, 3], eager-perturbed:" in printed.err


def test_a_diff_that_cannot_run_exits_2_without_a_report(
    tiny_engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    assert report.main(args("--widths", "2", "--forwards", "cuda-graphs", "--out", str(out))) == 2
    assert "circuit diff could not run: forward 'cuda-graphs' is not offered" in (
        capsys.readouterr().err
    )
    assert not out.exists()


def test_drafts_beyond_the_service_exit_2(
    tiny_engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The service's own limit (its widest verify slot) refuses the run, in a sentence."""
    out = tmp_path / "report.json"
    flags = ("--widths", "2", "--ks", "3", "--mtp", "--num-drafts", "9", "--out", str(out))
    assert report.main(args(*flags)) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("circuit diff could not run: ") and "9" in last, last
    assert not out.exists()


def test_out_dash_prints_the_report_alone(
    tiny_engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ("--widths", "2", "--ks", "2", "--steps", "2", "--out", "-")
    assert report.main(args(*flags)) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "PASS"
    assert not (tmp_path / "-").exists()
