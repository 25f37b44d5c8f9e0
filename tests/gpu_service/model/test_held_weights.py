"""The engine holds each weight once, in the layout it computes with: after load its weight
tensors take at most 1.02x the checkpoint's bytes (in the serving dtype), and while loading the
process's resident memory never grows past that plus the largest kept tensor."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_service.engine.facade import Engine
from gpu_service.model.config import ModelConfig
from gpu_service.model.hybrid import held_bytes
from gpu_service.model.weights import weight_shapes
from protos.defaults import DEFAULT_MODEL_DIR
from tests.conftest import TINY_SERVICE

HELD_RATIO = 1.02
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def checkpoint_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(s) * size for s in weight_shapes(cfg).values())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("model", ["default", "mini-flagship"])
def test_weights_are_held_once(mini_dir: Path, model: str, dtype: str) -> None:
    directory = DEFAULT_MODEL_DIR if model == "default" else mini_dir
    engine = Engine(directory, TINY_SERVICE, dtype)
    held = held_bytes(engine.model.held_tensors())
    source = checkpoint_bytes(engine.cfg, DTYPES[dtype])
    assert held <= HELD_RATIO * source, f"{held / source:.3f}x the checkpoint's bytes"
    assert held >= source, "every weight is held"


# Builds the model from the stream once to page in the code it runs, then again with the peak
# resident set reset: what the second load adds is its own tensors. glibc maps every allocation
# of 64 KiB and up on its own (MALLOC_MMAP_THRESHOLD_), so memory freed is memory returned.
_PEAK = """
import json, sys
from pathlib import Path
import torch
from gpu_service.model.config import ModelConfig
from gpu_service.model.hybrid import HybridModel, held_bytes
from gpu_service.model.weights import load_weights, stream_weights

def rss(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

directory, dtype, whole = Path(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3] == "whole"
cfg = ModelConfig.load(directory)
HybridModel(cfg, stream_weights(cfg, directory, dtype)[0], 64)
stream, cfg = stream_weights(cfg, directory, dtype)
before = rss("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
model = HybridModel(cfg, load_weights(cfg, directory, dtype)[0] if whole else stream, 64)
held = model.held_tensors()
print(json.dumps({
    "peak": rss("VmHWM") - before,
    "held": held_bytes(held),
    "largest": max(t.untyped_storage().nbytes() for t in held),
}))
"""


def _peak(directory: Path, dtype: torch.dtype, whole: bool = False) -> dict[str, int]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
    args = [str(directory), str(dtype).removeprefix("torch."), "whole" if whole else "stream"]
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# Slow: loads each checkpoint four times in processes of their own.
@pytest.mark.slow
@pytest.mark.parametrize("model", ["default", "mini-flagship"])
def test_peak_while_loading(mini_dir: Path, model: str) -> None:
    directory = DEFAULT_MODEL_DIR if model == "default" else mini_dir
    cfg = ModelConfig.load(directory)
    bound = lambda m: HELD_RATIO * checkpoint_bytes(cfg, torch.float32) + m["largest"]  # noqa: E731
    streamed = _peak(directory, torch.float32)
    assert streamed["peak"] <= bound(streamed), streamed
    # The control: every source tensor loaded before packing holds about twice as much.
    whole = _peak(directory, torch.float32, whole=True)
    assert whole["peak"] > bound(whole), whole
