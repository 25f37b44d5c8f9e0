"""The tensor-parallel section: the serving pair again, the GPU service over two ranks
(`--tensor-parallel-size 2`: cuda:0 and cuda:1); greedy `none` against `mtp` through it, the
circuit diff against it, and the tokens a second each method streams; then the same with the
routed experts placed on the ranks (`--expert-parallel`) on a small routed-MoE checkpoint written
for it (the bundled model has no experts). A machine with fewer than two CUDA devices, or a
`--cpu` run, skips it and says so: on CPU processes the same checks run in
tests/gpu_service/tp/test_tensor_parallel.py and test_expert_parallel.py."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from scripts.gpu_check.service import served_checks
from scripts.gpu_check.settings import Settings

TP_SIZE = 2
# The routed MoE the expert-parallel run serves: the tiny hybrid with 8 experts, 2 routed.
MOE_EXPERTS, MOE_ROUTED, MOE_WIDTH = 8, 2, 64


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def moe_checkpoint(directory: Path) -> Path:
    """Seeded weights and the byte-level tokenizer of the tiny model with routed experts and a
    shared expert, in `directory`."""
    from gpu_service.model.config import ModelConfig
    from training.checkpoint import init_model

    cfg = replace(
        ModelConfig.tiny(),
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_ROUTED,
        moe_intermediate_size=MOE_WIDTH,
        shared_expert_intermediate_size=MOE_WIDTH,
    )
    init_model(directory, cfg)
    return directory


def _ranks(sections: dict[str, dict], what: str) -> dict:
    service, diff = sections["service"], sections["circuit_diff"]
    size = service.get("tensor_parallel_size")
    return {
        "ok": service["ok"] and diff["ok"] and size == TP_SIZE,
        "summary": f"{what}: {service['summary']}; diff {diff['summary']}",
        "tensor_parallel_size": size,
        "tok_s": service.get("tok_s"),
        **sections,
    }


def check_tp(settings: Settings) -> dict:
    count = _cuda_devices() if settings.device == "cuda" else 0
    if count < TP_SIZE:
        return {
            "ok": True,
            "skipped": True,
            "summary": f"skipped: TP {TP_SIZE} needs {TP_SIZE} CUDA devices, this machine has "
            f"{count}" + ("" if settings.device == "cuda" else " in use (--cpu)"),
            "cuda_devices": count,
        }
    split = _ranks(served_checks(settings, "--tensor-parallel-size", str(TP_SIZE)), f"TP {TP_SIZE}")
    with tempfile.TemporaryDirectory(prefix="met-ep-") as tmp:
        moe = replace(settings, model=moe_checkpoint(Path(tmp)))
        flags = ("--tensor-parallel-size", str(TP_SIZE), "--expert-parallel")
        placed = _ranks(served_checks(moe, *flags), f"TP {TP_SIZE} + EP")
    return {
        **split,
        "ok": split["ok"] and placed["ok"],
        "summary": f"{split['summary']}; {placed['summary']}",
        "skipped": False,
        "expert_parallel": placed,
    }
