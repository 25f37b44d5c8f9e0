"""Weight names and shapes (HF Qwen3-Next layout), seeded initialisation, safetensors I/O."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from gpu_service.config import FULL, ModelConfig

WEIGHTS_FILE = "model.safetensors"


def _attention_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {
        f"{prefix}.self_attn.q_proj.weight": (cfg.num_attention_heads * d * 2, h),
        f"{prefix}.self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{prefix}.self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{prefix}.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
        f"{prefix}.self_attn.q_norm.weight": (d,),
        f"{prefix}.self_attn.k_norm.weight": (d,),
    }


def _gdn_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    p = f"{prefix}.linear_attn"
    return {
        f"{p}.in_proj_qkvz.weight": (2 * cfg.key_dim + 2 * cfg.value_dim, h),
        f"{p}.in_proj_ba.weight": (2 * hv, h),
        f"{p}.conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
        f"{p}.A_log": (hv,),
        f"{p}.dt_bias": (hv,),
        f"{p}.norm.weight": (cfg.linear_value_head_dim,),
        f"{p}.out_proj.weight": (h, cfg.value_dim),
    }


def _layer_shapes(cfg: ModelConfig, prefix: str, kind: str) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    mixer = _attention_shapes(cfg, prefix) if kind == FULL else _gdn_shapes(cfg, prefix)
    return {
        f"{prefix}.input_layernorm.weight": (h,),
        f"{prefix}.post_attention_layernorm.weight": (h,),
        **mixer,
        f"{prefix}.mlp.gate_proj.weight": (i, h),
        f"{prefix}.mlp.up_proj.weight": (i, h),
        f"{prefix}.mlp.down_proj.weight": (h, i),
    }


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint of `cfg` holds, by HF name."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n, kind in enumerate(cfg.layer_types):
        shapes.update(_layer_shapes(cfg, f"model.layers.{n}", kind))
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_nextn_predict_layers):
        shapes.update(_layer_shapes(cfg, f"mtp.layers.{n}", FULL))
    if cfg.has_mtp:
        shapes.update(
            {
                "mtp.fc.weight": (h, 2 * h),
                "mtp.pre_fc_norm_embedding.weight": (h,),
                "mtp.pre_fc_norm_hidden.weight": (h,),
                "mtp.norm.weight": (h,),
            }
        )
    return shapes


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)
    if len(shape) == 1:  # zero-centred RMSNorm: (1 + w)
        return torch.zeros(shape)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def init_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights for `cfg`, in the config's dtype."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.torch_dtype)
    return {n: _init(n, s, gen).to(dtype) for n, s in weight_shapes(cfg).items()}


def save_weights(weights: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        str(directory / WEIGHTS_FILE),
        metadata={"format": "pt"},
    )


def load_weights(cfg: ModelConfig, directory: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, checked name by name and shape by shape against `cfg`."""
    path = directory / WEIGHTS_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist; write seeded weights with `met init-model {directory}`"
        )
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    expected = weight_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} tensors, first {missing[0]!r}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(tensors[name].shape)}; the config says {shape}"
            )
    return {n: tensors[n].to(dtype) for n in expected}
