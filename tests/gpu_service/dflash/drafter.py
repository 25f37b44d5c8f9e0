"""A DFlash drafter directory written by hand in z-lab's published layout (the keys of
`z-lab/Qwen3-8B-DFlash-b16`'s config.json, shaped for the bundled target), random weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpu_service.model.config import ModelConfig


def published_config(target: ModelConfig, layers: int, taps: list[int], mask: int | None) -> dict:
    dflash: dict = {"target_layer_ids": taps}
    if mask is not None:
        dflash["mask_token_id"] = mask
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16,
        "bos_token_id": target.bos_token_id,
        "dflash_config": dflash,
        "dtype": "bfloat16",
        "eos_token_id": target.eos_token_id,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": target.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": layers,
        "num_key_value_heads": 2,
        "num_target_layers": target.num_hidden_layers,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": target.vocab_size,
    }


def published_tensors(cfg: dict, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Random weights by the published names; norms away from one, so a wrong norm shows."""
    gen = torch.Generator().manual_seed(seed)
    h, d, inner = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    taps = len(cfg["dflash_config"]["target_layer_ids"])

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.2 * torch.randn(n, generator=gen)

    out = {"fc.weight": w(h, taps * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    if "mask_token_id" not in cfg["dflash_config"]:
        out["mask_embedding"] = torch.randn(h, generator=gen)
    for i in range(cfg["num_hidden_layers"]):
        p, a, m = f"layers.{i}", f"layers.{i}.self_attn", f"layers.{i}.mlp"
        out |= {
            f"{p}.input_layernorm.weight": norm(h),
            f"{p}.post_attention_layernorm.weight": norm(h),
            f"{a}.q_proj.weight": w(q, h),
            f"{a}.k_proj.weight": w(kv, h),
            f"{a}.v_proj.weight": w(kv, h),
            f"{a}.o_proj.weight": w(h, q),
            f"{a}.q_norm.weight": norm(d),
            f"{a}.k_norm.weight": norm(d),
            f"{m}.gate_proj.weight": w(inner, h),
            f"{m}.up_proj.weight": w(inner, h),
            f"{m}.down_proj.weight": w(h, inner),
        }
    return out


def write_drafter(
    directory: Path,
    target: ModelConfig,
    layers: int = 2,
    taps: tuple[int, ...] = (1, 3, 5),
    mask: int | None = None,
    seed: int = 0,
    scale: float = 0.05,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    cfg = published_config(target, layers, list(taps), mask)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(published_tensors(cfg, seed, scale), str(directory / "model.safetensors"))
    return directory
