"""The model this project exists for, Qwen3-Next-80B-A3B: its config.json values, and a
miniature with its structure at a small width (its layer pattern, many experts with ten routed,
a shared expert, attention's 8:1 grouped KV heads, GDN's two value heads a key head, the MTP
layer), small enough for the whole pair on a CPU."""

from __future__ import annotations

import json
from pathlib import Path

from gpu_service.model.config import LAYER_PATTERN, ModelConfig

# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json, the fields a plan or a loader reads; the
# committed copy is what `met gpu-service plan` and `python -m tools.kernel_report` read too.
FLAGSHIP_CONFIG = (
    Path(__file__).resolve().parents[1] / "gpu_service/models/qwen3-next-80b-a3b/config.json"
)
QWEN3_NEXT_80B = json.loads(FLAGSHIP_CONFIG.read_text())
# A 5-layer DFlash drafter shaped for it (z-lab's layout, hidden 2048, taps 1, 12, 23, 34, 45).
FLAGSHIP_DRAFTER = FLAGSHIP_CONFIG.parent / "dflash"

MINI_FLAGSHIP = ModelConfig(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    layer_types=LAYER_PATTERN * 2,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=16,
    partial_rotary_factor=0.25,
    rope_theta=10000000.0,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=128,
    num_experts_per_tok=10,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    tie_word_embeddings=False,
    max_position_embeddings=512,
    bos_token_id=256,
    eos_token_id=257,
)
