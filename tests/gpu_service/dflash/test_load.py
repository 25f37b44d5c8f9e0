"""A drafter directory in the published layout loads; what the engine does not implement, or
what does not fit the target, is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_service.dflash.config import default_taps, read_config
from gpu_service.dflash.weights import load_tensors
from gpu_service.model.config import ModelConfig
from protos.defaults import DEFAULT_MODEL_DIR
from tests.gpu_service.dflash.drafter import write_drafter

TARGET = ModelConfig.load(DEFAULT_MODEL_DIR)


def test_the_published_rule_spreads_taps_over_layers_1_to_l_minus_3():
    assert default_taps(36, 5) == (1, 9, 17, 25, 33)  # z-lab's Qwen3-8B drafter
    assert default_taps(48, 5) == (1, 12, 23, 34, 45)  # Qwen3-Next-80B-A3B
    assert default_taps(40, 5) == (1, 10, 19, 28, 37)  # Qwen3.5-35B-A3B
    assert default_taps(12, 1) == (6,)


def test_a_published_directory_loads(tmp_path: Path):
    d = write_drafter(tmp_path / "d", TARGET, mask=5)
    cfg = read_config(d, TARGET)
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (16, (1, 3, 5), 5)
    assert cfg.rope_theta == 1e6 and cfg.head_dim == 32 and cfg.num_hidden_layers == 2
    weights = load_tensors(cfg, d, torch.float32)
    assert len(weights) == 3 + 11 * 2


def _edit(d: Path, **changes) -> None:
    raw = json.loads((d / "config.json").read_text())
    raw.update(changes)
    (d / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_size": 256}, "hidden_size"),
        ({"vocab_size": 1000}, "vocab_size"),
        ({"num_target_layers": 48}, "num_target_layers"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"quantization_config": {}}, "quantization_config"),
        ({"dflash_config": {"target_layer_ids": [1, 3, 12]}}, "target_layer_ids"),
        (
            {"dflash_config": {"target_layer_ids": [1, 3, 5], "input_embedding_scale": 2.0}},
            "input_embedding_scale",
        ),
    ],
)
def test_what_the_engine_cannot_serve_is_refused_naming_it(tmp_path: Path, changes, named):
    d = write_drafter(tmp_path / "d", TARGET, mask=5)
    _edit(d, **changes)
    with pytest.raises(ValueError, match=named):
        read_config(d, TARGET)


def test_unknown_missing_or_misshapen_tensors_are_refused(tmp_path: Path):
    d = write_drafter(tmp_path / "d", TARGET, mask=5)
    cfg = read_config(d, TARGET)
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    save_file({**tensors, "lm_head.weight": tensors["fc.weight"].clone()}, str(path))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_tensors(cfg, d, tensors["fc.weight"].dtype)
    del tensors["norm.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="lacks norm.weight"):
        load_tensors(cfg, d, tensors["fc.weight"].dtype)


def test_the_mask_comes_from_one_place(tmp_path: Path):
    """No mask id: the stored embedding is the mask; both at once is refused."""
    d = write_drafter(tmp_path / "d", TARGET, mask=None)
    cfg = read_config(d, TARGET)
    assert cfg.mask_token_id is None
    assert "mask_embedding" in load_tensors(cfg, d, torch.float32)
    _edit(d, dflash_config={"target_layer_ids": [1, 3, 5], "mask_token_id": 5})
    cfg = read_config(d, TARGET)
    with pytest.raises(ValueError, match="mask_embedding"):
        load_tensors(cfg, d, torch.float32)
