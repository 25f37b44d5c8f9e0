"""A DFlash drafter's `config.json`, as z-lab publishes it (a Qwen3 config plus `block_size`,
`num_target_layers` and `dflash_config`), checked against the target it drafts for.

A key that changes what the drafter computes is read (`READ`) or, set to anything but the
value the engine implements, refused naming it (`FIXED`); keys that change nothing a forward
computes are `INERT`; any other key is refused. The bundled model's vocabulary has no spare id
for the mask, so a drafter may instead store the mask's embedding (`MASK_EMBEDDING`, as vLLM's
MiMo drafters do): exactly one of the two names the mask."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_service.model.config import ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MASK_EMBEDDING = "mask_embedding"  # [H]: the mask row's input, when no vocabulary id is it
# Every published drafter's block.
DEFAULT_BLOCK = 16

# transformers' `Qwen3Config` defaults of the keys the drafter reads; `num_target_layers` has
# none (the taps' default rule needs it) and the DFlash keys take the `dflash` package's.
QWEN3_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "block_size": DEFAULT_BLOCK,
}
READ = (*QWEN3_DEFAULTS, "num_target_layers", "dflash_config", "rope_parameters")
# Keys whose only value the engine implements; absent, they take it.
FIXED: dict[str, Any] = {
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rope_scaling": None,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
}
INERT = (
    "architectures",
    "auto_map",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    "initializer_range",
    "max_window_layers",
    "transformers_version",
    "use_cache",
    "layer_types",  # checked: every drafter layer attends fully
)
DFLASH_KEYS = ("target_layer_ids", "mask_token_id")


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    block_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int | None  # None: the checkpoint stores `MASK_EMBEDDING`
    max_position_embeddings: int = 32768

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def max_drafts(self) -> int:
        """Drafts one block gives: every row but the first."""
        return self.block_size - 1

    def to_dict(self) -> dict[str, Any]:
        """The published layout, as `read_config` reads it."""
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            **FIXED,
            **{k: getattr(self, k) for k in (*QWEN3_DEFAULTS, "num_target_layers")},
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids)},
        }
        if self.mask_token_id is not None:
            out["dflash_config"]["mask_token_id"] = self.mask_token_id
        return out


def default_taps(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The published rule: one tap per drafter layer, spread evenly over target layers 1 to
    L - 3 (the middle layer for a single drafter layer)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(
        int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)
    )


def read_config(directory: Path, target: ModelConfig) -> DFlashConfig:
    """`directory/config.json` -> the drafter's config; `ValueError` naming the key that the
    engine cannot serve or that does not fit `target`."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{directory} holds no {CONFIG_FILE}; it is not a DFlash drafter")
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return parse_config(raw, target, str(path))


def parse_config(raw: dict[str, Any], target: ModelConfig, where: str) -> DFlashConfig:
    unknown = sorted(set(raw) - set(READ) - set(FIXED) - set(INERT))
    if unknown:
        raise ValueError(
            f"{where}: the DFlash drafter's config has keys the engine does not "
            f"implement: {', '.join(unknown)}"
        )
    for key, value in FIXED.items():
        if key in raw and raw[key] != value:
            raise ValueError(
                f"{where}: {key} is {raw[key]!r}; the engine implements only "
                f"{value!r} for a DFlash drafter"
            )
    layers = raw.get("layer_types")
    if layers is not None and any(t != "full_attention" for t in layers):
        raise ValueError(f"{where}: layer_types {layers!r}; every DFlash layer attends fully")
    dflash = raw.get("dflash_config")
    if dflash is None:
        dflash = {}
    if not isinstance(dflash, dict):
        raise ValueError(f"{where}: dflash_config is {dflash!r}; it must be an object")
    extra = sorted(set(dflash) - set(DFLASH_KEYS))
    if extra:
        raise ValueError(
            f"{where}: dflash_config has keys the engine does not implement: {', '.join(extra)}"
        )
    if "num_target_layers" not in raw:
        raise ValueError(f"{where}: the DFlash drafter's config lacks num_target_layers")
    values = {k: raw.get(k, v) for k, v in QWEN3_DEFAULTS.items()}
    values["rope_theta"] = _rope_theta(raw, where)
    taps = dflash.get("target_layer_ids")
    if taps is None:
        taps = default_taps(raw["num_target_layers"], values["num_hidden_layers"])
    cfg = DFlashConfig(
        **values,
        num_target_layers=raw["num_target_layers"],
        target_layer_ids=tuple(taps),
        mask_token_id=dflash.get("mask_token_id"),
    )
    check_against(cfg, target, where)
    return cfg


def _rope_theta(raw: dict[str, Any], where: str) -> float:
    """RoPE's base from `rope_theta` (transformers 4) or `rope_parameters` (transformers 5);
    only the default rotation is implemented."""
    rope = raw.get("rope_parameters")
    if rope is None:
        return float(raw.get("rope_theta", QWEN3_DEFAULTS["rope_theta"]))
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"{where}: rope_parameters {rope!r}; the engine implements only the "
            f"default rope_type for a DFlash drafter"
        )
    extra = sorted(set(rope) - {"rope_type", "rope_theta"})
    if extra:
        raise ValueError(
            f"{where}: rope_parameters has keys the engine does not implement: {', '.join(extra)}"
        )
    theta = rope.get("rope_theta", raw.get("rope_theta", QWEN3_DEFAULTS["rope_theta"]))
    return float(theta)


def check_against(cfg: DFlashConfig, target: ModelConfig, where: str) -> None:
    """The drafter reads the target's embedding, LM head and layer outputs: its width, its
    vocabulary and its taps must be the target's."""
    if cfg.hidden_size != target.hidden_size:
        raise ValueError(
            f"{where}: hidden_size is {cfg.hidden_size}; the target's is "
            f"{target.hidden_size}, which the drafter must share"
        )
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"{where}: vocab_size is {cfg.vocab_size}; the target's is {target.vocab_size}"
        )
    if cfg.num_target_layers != target.num_hidden_layers:
        raise ValueError(
            f"{where}: num_target_layers is {cfg.num_target_layers}; the target "
            f"has {target.num_hidden_layers} layers"
        )
    taps = cfg.target_layer_ids
    if not taps or any(not 0 <= t < target.num_hidden_layers for t in taps):
        raise ValueError(
            f"{where}: target_layer_ids {list(taps)} must name target layers "
            f"0 to {target.num_hidden_layers - 1}"
        )
    if len(set(taps)) != len(taps):
        raise ValueError(f"{where}: target_layer_ids {list(taps)} names a layer twice")
    if cfg.block_size < 2:
        raise ValueError(f"{where}: block_size is {cfg.block_size}; a block needs 2 rows or more")
    if cfg.mask_token_id is not None and not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ValueError(
            f"{where}: mask_token_id {cfg.mask_token_id} is outside the "
            f"vocabulary of {target.vocab_size}"
        )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"{where}: {cfg.num_attention_heads} attention heads do not group "
            f"over {cfg.num_key_value_heads} key/value heads"
        )
