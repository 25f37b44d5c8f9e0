"""transformers' defaults of the vision models this server serves (`qwen3_5`, `qwen3_5_moe`),
for what a checkpoint's config.json leaves out: both processes read the same file, the GPU
service to build the tower and place its tokens, the control plane to preprocess images and
expand their placeholders."""

from __future__ import annotations

from typing import Any

# The model types whose config.json may hold a `vision_config` this server serves.
VISION_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# Qwen3_5VisionConfig's defaults (Qwen3_5MoeVisionConfig's are the same).
VISION_DEFAULTS: dict[str, Any] = dict(
    depth=27,
    hidden_size=1152,
    hidden_act="gelu_pytorch_tanh",
    intermediate_size=4304,
    num_heads=16,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=3584,
    num_position_embeddings=2304,
)
# Qwen3_5Config's (and Qwen3_5MoeConfig's) defaults of the vision token ids.
TOKEN_DEFAULTS = dict(
    image_token_id=248056,
    video_token_id=248057,
    vision_start_token_id=248053,
    vision_end_token_id=248054,
)
