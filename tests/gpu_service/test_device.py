"""`--device`: the flag resolved or refused with a sentence, a refused device ending the
service before it loads anything, the device a capability names, and the Triton interpreter
decision following the device rather than an import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_service.engine.device import (
    DeviceError,
    default_forward,
    describe_device,
    resolve_device,
)
from gpu_service.engine.facade import Engine
from kernels import configure_interpreter
from tests.conftest import TINY_SERVICE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("flag", ["auto", "cpu"])
def test_cpu_without_cuda(flag: str) -> None:
    assert resolve_device(flag) == torch.device("cpu")


@pytest.mark.usefixtures("one_gpu")
@pytest.mark.parametrize("flag", ["auto", "cuda", "cuda:0"])
def test_cuda_comes_back_with_its_index(flag: str) -> None:
    device = resolve_device(flag)
    assert device == torch.device("cuda", 0)
    assert describe_device(device) == "cuda:0 (NVIDIA H200)"


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize(
    ("flag", "says"),
    [("tpu", "is unknown"), ("cuda:x", "is unknown"), ("cuda", "no CUDA"), ("cuda:7", "no CUDA")],
    ids=["tpu", "cuda-x", "cuda", "cuda-7"],
)
def test_refused_without_cuda(flag: str, says: str) -> None:
    with pytest.raises(DeviceError, match=f"^--device .*{says}"):
        resolve_device(flag)


@pytest.mark.usefixtures("one_gpu")
def test_refused_index_names_the_devices_there_are() -> None:
    with pytest.raises(DeviceError, match=r"^--device cuda:7 .* it has 1 \(cuda:0 to cuda:0\)"):
        resolve_device("cuda:7")


def test_default_forward() -> None:
    assert default_forward(torch.device("cpu")) == "eager"
    assert default_forward(torch.device("cuda", 0)) == "triton"


def test_serve_refuses_a_missing_device_before_loading() -> None:
    # No CUDA for the child even on a GPU machine; a model directory that does not exist
    # shows that nothing was loaded before the refusal.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "met", "gpu-service", "serve"]
    args = ["--device", "cuda", "--port", "0", "--model", "/nonexistent/model"]
    done = subprocess.run(cmd + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda" in lines[0], done.stderr


def test_capabilities_name_the_device(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, TINY_SERVICE, device="cpu")
    assert engine.device == torch.device("cpu")
    assert engine.state.k_cache.device == engine.device
    assert engine.capabilities().device == "cpu"


def test_imports_leave_the_interpreter_undecided() -> None:
    # The process entry points decide after these imports, so none of them may decide, nor
    # import triton (whose kernels read the variable as they are decorated).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import os, sys, kernels, gpu_service.rpc.server; "
        "print(os.environ.get('TRITON_INTERPRET'), 'triton' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.stdout.split() == ["None", "False"], done.stderr


@pytest.mark.parametrize(
    ("device_type", "user", "after"),
    [("cpu", None, "1"), ("cuda", None, None), ("cpu", "0", "0"), ("cuda", "1", "1")],
    ids=["cpu", "cuda", "cpu-user-0", "cuda-user-1"],
)
def test_configure_interpreter(
    monkeypatch: pytest.MonkeyPatch, device_type: str, user: str | None, after: str | None
) -> None:
    if user is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", user)
    configure_interpreter(device_type)
    assert os.environ.get("TRITON_INTERPRET") == after
