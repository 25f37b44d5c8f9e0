"""Checkpoint directories: `config.json`, `model.safetensors`, `tokenizer.json` (with
`tokenizer_config.json` and `chat_template.jinja`)."""

from __future__ import annotations

from pathlib import Path

from control_plane.text.tokenizer import TOKENIZER_FILE, write_byte_level
from gpu_service.model.config import ModelConfig
from gpu_service.model.weights import WEIGHTS_FILE, init_weights, save_weights
from protos.defaults import DEFAULT_SEED


def init_model(directory: Path, cfg: ModelConfig | None = None, seed: int = DEFAULT_SEED) -> Path:
    """Write a checkpoint with seeded random weights (and a byte-level tokenizer with the
    default chat template when the directory has no tokenizer). An existing config.json is
    kept and used."""
    directory.mkdir(parents=True, exist_ok=True)
    if cfg is None:
        cfg = ModelConfig.load(directory) if (directory / "config.json").exists() else ModelConfig()
    (directory / "config.json").write_text(cfg.to_json())
    if not (directory / TOKENIZER_FILE).exists():
        write_byte_level(directory)
    save_weights(init_weights(cfg, seed), directory)
    return directory / WEIGHTS_FILE
