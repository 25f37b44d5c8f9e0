"""A DFlash drafter's tensors, by the published names: `layers.{i}.*` (Qwen3 decoder layers),
`fc.weight` [H, K * H], `hidden_norm.weight`, `norm.weight`, and `MASK_EMBEDDING` where the
config names no mask id. No embedding and no LM head: the drafter uses the target's."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_service.dflash.config import MASK_EMBEDDING, WEIGHTS_FILE, DFlashConfig, read_config
from gpu_service.model.config import ModelConfig


def expected_tensors(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inner = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_taps * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    if cfg.mask_token_id is None:
        shapes[MASK_EMBEDDING] = (h,)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.self_attn.q_norm.weight": (d,),
            f"{p}.self_attn.k_norm.weight": (d,),
            f"{p}.mlp.gate_proj.weight": (inner, h),
            f"{p}.mlp.up_proj.weight": (inner, h),
            f"{p}.mlp.down_proj.weight": (h, inner),
        }
    return shapes


def check_tensors(cfg: DFlashConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """`ValueError` naming every tensor that is unknown, missing or of another shape."""
    want = expected_tensors(cfg)
    unknown = sorted(set(shapes) - set(want))
    if MASK_EMBEDDING in unknown:
        raise ValueError(
            f"{where}: holds {MASK_EMBEDDING} and its config names mask_token_id "
            f"{cfg.mask_token_id}; the mask must come from one of them"
        )
    if unknown:
        raise ValueError(f"{where}: tensors a DFlash drafter does not have: {', '.join(unknown)}")
    missing = sorted(set(want) - set(shapes))
    if missing:
        raise ValueError(f"{where}: the drafter lacks {', '.join(missing)}")
    for name, shape in want.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(
                f"{where}: {name} has shape {list(shapes[name])}; the config gives {list(shape)}"
            )


def _checked_file(cfg: DFlashConfig, directory: Path) -> Path:
    """The drafter's weights file, its tensors' names and shapes checked from its header."""
    from safetensors import safe_open

    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"{directory} holds no {WEIGHTS_FILE}")
    with safe_open(str(path), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    check_tensors(cfg, shapes, str(path))
    return path


def check_drafter(directory: Path, target: ModelConfig) -> DFlashConfig:
    """The drafter's config and its tensors' names and shapes, checked without reading a
    weight (what a service refuses before it loads anything)."""
    cfg = read_config(directory, target)
    _checked_file(cfg, directory)
    return cfg


def load_tensors(
    cfg: DFlashConfig, directory: Path, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor of the drafter, checked before any is read."""
    from safetensors.torch import load_file

    tensors = load_file(str(_checked_file(cfg, directory)))
    return {k: t.to(device=device, dtype=dtype) for k, t in tensors.items()}


def save_tensors(weights: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in weights.items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
