"""`--model ORG/NAME[@REVISION]`: a Hugging Face hub id resolved through huggingface_hub's cache
(protos/hub.py), against a cache laid out here as the hub lays it out, offline."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from control_plane.cli.launch import start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from gpu_service.sizing import plan
from met.main import build_parser
from protos.hub import hub_id, model_name, model_path
from tests.conftest import SERVE_ARGS

ROOT = Path(__file__).resolve().parents[2]
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tiny_dir: Path, tmp_path: Path) -> Path:
    """A hub cache holding org/name at REV, main pointing at it (huggingface_hub's layout:
    file_download.py's repo_folder_name, _snapshot_download.py's refs and snapshots)."""
    root = tmp_path / "hub"
    repo = root / "models--org--name"
    shutil.copytree(tiny_dir, repo / "snapshots" / REV)
    (repo / "refs").mkdir()
    # Read back as written, with no strip: a newline would be part of the commit hash.
    (repo / "refs" / "main").write_text(REV)
    return root


@pytest.fixture
def offline(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The cache offline, for this process (huggingface_hub read its environment on import)
    and for the children it starts (which read it from theirs)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    yield cache / "models--org--name" / "snapshots" / REV


@pytest.mark.parametrize(
    "text, ref",
    [
        ("org/name", ("org/name", None)),
        ("org/name@main", ("org/name", "main")),
        (f"Org-1/na_me.v2@{REV}", ("Org-1/na_me.v2", REV)),
        ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
    ],
)
def test_a_hub_id_is_org_name_and_a_revision(text: str, ref: tuple[str, str | None]) -> None:
    assert hub_id(text) == ref


@pytest.mark.parametrize(
    "text",
    ["name", "/org/name", "./org/name", "org/name/x", "org/-name", "org--a/name", "org/a..b",
     "org/name@", "org/name@a b", f"org/{'n' * 96}", ""],
)  # fmt: skip
def test_anything_else_is_no_hub_id(text: str) -> None:
    assert hub_id(text) is None


def test_a_path_on_disk_stays_a_path(
    offline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert model_path("org/name") == Path("org/name")  # on disk: never looked up
    # Neither on disk nor of the id's form: a path, refused where a missing checkpoint is.
    assert model_path("/nonexistent/model") == Path("/nonexistent/model")
    assert model_path("name") == Path("name")


def test_a_hub_id_is_its_cached_snapshot(offline: Path) -> None:
    assert model_path("org/name") == offline
    assert model_path("org/name@main") == offline
    assert model_path(f"org/name@{REV}") == offline
    assert model_name(offline) == "org/name"


def test_a_missing_id_is_one_sentence_naming_the_cache_and_the_hub(offline: Path) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        model_path("org/missing")
    cache = constants.HF_HUB_CACHE
    assert str(refused.value) == (
        f"org/missing is no path on disk and not in the Hugging Face cache at {cache}, and the "
        "hub is offline (HF_HUB_OFFLINE is set)"
    )
    with pytest.raises(argparse.ArgumentTypeError, match=r"^org/name@v9 is no path .* offline"):
        model_path("org/name@v9")


def test_an_unreachable_hub_falls_back_to_the_cache(
    offline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # refuses at once
    assert model_path("org/name") == offline
    with pytest.raises(argparse.ArgumentTypeError, match="and the hub could not be reached$"):
        model_path("org/missing")


def test_a_directory_is_named_as_before(tiny_dir: Path) -> None:
    assert model_name(tiny_dir) == tiny_dir.resolve().name


@pytest.mark.parametrize(
    "argv",
    [
        ["gpu-service", "serve", "--model", "org/name"],
        ["gpu-service", "plan", "org/name"],
        ["up", "--model", "org/name"],
        ["circuit", "diff", "--verify-batch", "--model", "org/name"],
        ["bench", "--model", f"org/name@{REV}"],
    ],
)
def test_every_model_flag_resolves_a_hub_id(offline: Path, argv: list[str]) -> None:
    # `met up` hands its children this directory, so that all serve the same snapshot.
    assert build_parser().parse_args(argv).model == offline


def test_plan_names_the_hub_id(offline: Path) -> None:
    args = build_parser().parse_args(["gpu-service", "plan", "org/name@main", "--device", "cpu"])
    assert plan.from_args(args, torch.device("cpu"), graphs=False).model == "org/name"


# Slow: starts a GPU service process for each id.
@pytest.mark.slow
@pytest.mark.parametrize("model", ["org/name", f"org/name@{REV}"])
def test_serve_serves_a_cached_hub_id(offline: Path, model: str) -> None:
    proc, target = start_gpu_service(model, *SERVE_ARGS)
    try:
        client = GrpcModel(target)
        assert client.capabilities().model_name == "org/name"
        client.close()
    finally:
        assert stop(proc) == 0


@pytest.mark.parametrize("command", [["gpu-service", "serve", "--model"], ["gpu-service", "plan"]])
def test_a_missing_id_ends_the_process_with_status_2(offline: Path, command: list[str]) -> None:
    cmd = [sys.executable, "-m", "met", *command, "org/missing"]
    done = subprocess.run(cmd, cwd=ROOT, env=os.environ, capture_output=True, timeout=60, text=True)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stdout == ""
    flag = "--model" if "--model" in command else "MODEL"
    assert done.stderr.splitlines()[-1] == (
        f"met {' '.join(command[:2])}: error: argument {flag}: org/missing is no path on disk "
        f"and not in the Hugging Face cache at {offline.parents[2]}, and the hub is offline "
        "(HF_HUB_OFFLINE is set)"
    ), done.stderr
