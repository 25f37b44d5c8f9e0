"""`met quantize --fp8-block 128 SRC DST`: a bf16/fp32 checkpoint rewritten in the block-FP8
layout Qwen publishes (gpu_service/model/quantization.py), one shard at a time.

Every linear weight except those Qwen keeps in bf16 (`PUBLISHED_NOT_CONVERTED`) becomes
float8_e4m3fn with its `weight_scale_inv` beside it; every other tensor is written as read.
config.json gains the `quantization_config`, the other files (tokenizer, generation config)
are copied, and a sharded source keeps its shards and gets an index naming the scales too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gpu_service.model.config import ModelConfig, read_json
from gpu_service.model.quantization import PUBLISHED_NOT_CONVERTED, Fp8Blocks, fp8_names, scale_name
from gpu_service.model.weights import (
    _read_tensors,
    checkpoint_index,
    expected_tensors,
    served_config,
    shard_paths,
    vision_tensors,
)
from kernels.fp8.naive import BLOCK, quantize_blocks

INDEX_FILE = "model.safetensors.index.json"


def quantize_checkpoint(src: Path, dst: Path, block: int = BLOCK) -> list[str]:
    """Write the FP8 form of checkpoint `src` into the new directory `dst`. -> the weights
    quantized, by name."""
    from safetensors.torch import save_file

    if block != BLOCK:
        raise ValueError(f"--fp8-block {block} is not served; the published block is {BLOCK}")
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} is not empty; give a new directory")
    raw = read_json(src / "config.json")
    if raw.get("quantization_config"):
        raise ValueError(f"{src} is quantized already (config.json has a quantization_config)")
    index = checkpoint_index(src)
    cfg = served_config(ModelConfig.from_dict(raw), index)
    expected, _ = expected_tensors(cfg, index)
    tower = set(vision_tensors(cfg, index))  # written as read
    carried = set(expected) | tower
    quant = Fp8Blocks(PUBLISHED_NOT_CONVERTED)
    targets = fp8_names(quant, {n: s for n, s in expected.items() if n not in tower})
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for shard in shard_paths(src):
        tensors = {}
        for name, t in _read_tensors(shard, carried):
            if name in targets:
                tensors[name], tensors[scale_name(name)] = quantize_blocks(t)
            else:
                tensors[name] = t
        save_file(tensors, str(dst / shard.name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard.name)
    if (src / INDEX_FILE).exists():
        body = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX_FILE).write_text(json.dumps(body, indent=2) + "\n")
    for path in src.iterdir():
        copied = path.is_file() and path.suffix != ".safetensors"
        if copied and path.name not in ("config.json", INDEX_FILE):
            shutil.copy2(path, dst / path.name)
    raw["quantization_config"] = quant.to_dict()
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return sorted(targets)
