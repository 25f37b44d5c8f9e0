"""Where the engine runs: `--device auto|cpu|cuda|cuda:N` resolved to a `torch.device`, its
name for `Capabilities.device`, and the forward a service starts with on it."""

from __future__ import annotations

import re

import torch

from kernels import configure_interpreter

_CUDA = re.compile(r"cuda(?::(\d+))?")


class DeviceError(ValueError):
    """A `--device` value this machine cannot serve on."""


def _cuda(flag: str, index: int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {flag} needs CUDA, and torch sees no CUDA device here")
    count = torch.cuda.device_count()
    if index is None:
        index = torch.cuda.current_device()
    if index >= count:
        raise DeviceError(
            f"--device {flag} names a CUDA device this machine lacks; it has {count} "
            f"(cuda:0 to cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def resolve_device(flag: str | torch.device = "auto") -> torch.device:
    """The device `flag` names; `auto` is CUDA when torch sees it, else the CPU. A CUDA device
    always comes back with its index, so it names one GPU."""
    flag = str(flag)
    if flag == "auto":
        return _cuda("cuda", None) if torch.cuda.is_available() else torch.device("cpu")
    if flag == "cpu":
        return torch.device("cpu")
    cuda = _CUDA.fullmatch(flag)
    if cuda is None:
        raise DeviceError(f"--device {flag!r} is unknown; use auto, cpu, cuda or cuda:N")
    return _cuda(flag, None if cuda[1] is None else int(cuda[1]))


def choose_device(flag: str = "auto") -> torch.device:
    """`resolve_device`, with the process's Triton interpreter decision made to match: what a
    process entry point calls once, before anything imports a Triton kernel."""
    device = resolve_device(flag)
    configure_interpreter(device.type)
    return device


def describe_device(device: torch.device) -> str:
    """`cpu`, or a GPU by index and name: `cuda:0 (NVIDIA H200)`."""
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"


def default_forward(device: torch.device) -> str:
    """The forward a service starts with: the Triton kernels on CUDA; on the CPU they would
    run interpreted, so the torch references."""
    return "triton" if device.type == "cuda" else "eager"
