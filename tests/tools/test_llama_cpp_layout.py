"""The bundled model's checkpoint in the layout llama.cpp converts: the fused GDN input
projections split per key-head group (fused again, the same tensors), every other tensor as it
is, and a config whose rotary sections cover the rotary half."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from protos.defaults import DEFAULT_MODEL_DIR
from tools.llama_cpp_layout import qwen35_config, split_tensors, write

CFG = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())


def test_the_split_fuses_back_to_the_checkpoint(tmp_path) -> None:
    write(DEFAULT_MODEL_DIR, tmp_path)
    got, src = (
        load_file(tmp_path / "model.safetensors"),
        load_file(DEFAULT_MODEL_DIR / "model.safetensors"),
    )
    hk, hidden = CFG["linear_num_key_heads"], CFG["hidden_size"]
    dk = CFG["linear_key_head_dim"]
    fused = [k for k in src if k.endswith("in_proj_qkvz.weight")]
    assert fused, "the bundled model fuses its GDN projections"
    for name in fused:
        base = name.removesuffix("qkvz.weight")
        qkv, z = got[base + "qkv.weight"], got[base + "z.weight"]
        q, k, v = qkv.split([hk * dk, hk * dk, qkv.shape[0] - 2 * hk * dk])
        groups = [t.view(hk, -1, hidden) for t in (q, k, v, z)]
        assert torch.equal(torch.cat(groups, 1).reshape(-1, hidden), src[name])
        b, a = got[base + "b.weight"], got[base + "a.weight"]
        ba = torch.cat([b.view(hk, -1, hidden), a.view(hk, -1, hidden)], 1).reshape(-1, hidden)
        assert torch.equal(ba, src[base + "ba.weight"])
    rest = [k for k in src if "in_proj_" not in k]
    assert all(torch.equal(got[k], src[k]) for k in rest)
    assert (tmp_path / "tokenizer.json").read_bytes() == (
        DEFAULT_MODEL_DIR / "tokenizer.json"
    ).read_bytes()


def test_the_config_names_qwen35_with_sections_over_the_rotary_half() -> None:
    out = qwen35_config(CFG)
    assert out["architectures"] == ["Qwen3_5ForCausalLM"]
    assert out["full_attention_interval"] == 4 and out["mtp_num_hidden_layers"] == 1
    rope = out["rope_parameters"]
    half = int(CFG["head_dim"] * CFG["rope_parameters"]["partial_rotary_factor"]) // 2
    assert sum(rope["mrope_section"]) == half and rope["mrope_interleaved"]
    with pytest.raises(ValueError, match="routed-MoE"):
        qwen35_config({**CFG, "num_experts": 8})
    with pytest.raises(ValueError, match="not one full-attention layer every"):
        qwen35_config({**CFG, "layer_types": ["full_attention", "linear_attention"] * 6})


def test_split_tensors_leaves_other_tensors_alone() -> None:
    w = torch.arange(6.0).view(2, 3)
    assert split_tensors({"x.weight": w}, CFG)["x.weight"] is w
