"""The memory plan of a model with a vision tower (gpu_service/sizing/plan_vision.py): the
tower's weights as transformers counts its parameters, in the serving dtype, on every rank;
its activations at the image bound the flags set, which grow with the image, the slots, the
prefix snapshots and the batch; none for a model without a tower."""

from __future__ import annotations

import json

import torch
from transformers import Qwen3_5MoeConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

from gpu_service.model.config import ModelConfig
from gpu_service.sizing import plan
from gpu_service.sizing.plan_vision import tower_activation_bytes
from met.main import build_parser
from tests.gpu_service.test_hf_config import MODELS

CPU = torch.device("cpu")
FLAGS = ("--dtype", "bf16", "--max-context", "65536", "--num-slots", "8", "--max-batch", "8")


def _plan(name: str, *flags: str) -> plan.MemoryPlan:
    args = build_parser().parse_args(["gpu-service", "plan", str(MODELS / name), *flags])
    return plan.from_args(args, CPU, False)


def test_the_tower_and_one_image_at_the_bound_are_planned() -> None:
    raw = json.loads((MODELS / "qwen3.5-35b-a3b" / "config.json").read_text())
    hf = Qwen3_5MoeConfig(**{k: x for k, x in raw.items() if k != "model_type"})
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen3_5MoeVisionModel(hf.vision_config).parameters())
    big = _plan("qwen3.5-35b-a3b", *FLAGS)
    assert big.parts["vision_weights_bytes"] == 2 * params  # 893 MB in bf16
    at_tp_2 = _plan("qwen3.5-35b-a3b", *FLAGS, "--tensor-parallel-size", "2")
    assert at_tp_2.parts["vision_weights_bytes"] == 2 * params  # whole on every rank
    v = ModelConfig.from_dict(raw).vision
    assert v is not None
    # One 4096 x 4096 image: 65536 patches, 16384 image tokens of 2048 values.
    held = ((8 + 8) * 16384 + 4096) * 2048 * 2
    assert big.parts["vision_bytes"] == tower_activation_bytes(v, 65536, 2) + held
    small = _plan("qwen3.5-35b-a3b", *FLAGS, "--max-image-pixels", str(1024 * 1024))
    assert small.parts["vision_bytes"] < big.parts["vision_bytes"] / 10
    wider = _plan("qwen3.5-35b-a3b", *FLAGS[:-2], "--max-batch", "16")
    assert wider.parts["vision_bytes"] - big.parts["vision_bytes"] == 8 * 16384 * 2048 * 2
    # A prefix snapshot taken inside an image keeps its embeddings.
    cached = _plan("qwen3.5-35b-a3b", *FLAGS, "--prefix-snapshots", "4")
    assert cached.parts["vision_bytes"] - big.parts["vision_bytes"] == 4 * 16384 * 2048 * 2
    assert big.total - small.total == big.parts["vision_bytes"] - small.parts["vision_bytes"]


def test_a_model_without_a_tower_plans_none() -> None:
    text = _plan("qwen3-next-80b-a3b", *FLAGS)
    assert text.parts["vision_weights_bytes"] == text.parts["vision_bytes"] == 0
