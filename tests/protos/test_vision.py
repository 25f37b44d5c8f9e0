"""The vision defaults both processes read are transformers' own, for every model type that
names them."""

from __future__ import annotations

from transformers import AutoConfig

from protos.vision import TOKEN_DEFAULTS, VISION_DEFAULTS, VISION_MODEL_TYPES


def test_the_defaults_are_transformers() -> None:
    for model_type in VISION_MODEL_TYPES:
        config = AutoConfig.for_model(model_type)
        assert {k: getattr(config, k) for k in TOKEN_DEFAULTS} == TOKEN_DEFAULTS, model_type
        vision = config.vision_config
        assert {k: getattr(vision, k) for k in VISION_DEFAULTS} == VISION_DEFAULTS, model_type
