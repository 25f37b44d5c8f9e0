"""The vision tower's configuration (Qwen3.5 / Qwen3.6's `vision_config`, read as transformers'
`Qwen3_5VisionConfig` reads it) and how the text model places an image's tokens: the config's
vision token ids and the text RoPE's `mrope_section`.

A field the file leaves out takes transformers' default; a field the tower does not implement
(a non-empty `deepstack_visual_indexes`, another activation or RoPE type) is refused naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protos.vision import TOKEN_DEFAULTS, VISION_DEFAULTS

# Qwen3_5TextRotaryEmbedding's `mrope_section` where rope_parameters gives none.
MROPE_SECTION = (11, 11, 10)
# The MLP activations the tower computes (transformers' ACT2FN names).
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
# Fields no tower forward reads.
_INERT = {"initializer_range", "model_type", "transformers_version", "architectures", "dtype"}
# What transformers' save_pretrained writes into a nested config beside its own fields.
_WRITTEN = {
    "output_hidden_states",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "_name_or_path",
    "output_attentions",
    "torch_dtype",
}


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    hidden_act: str
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float = 10000.0  # the 2D rotary's (`rope_parameters`, rope_type axial)
    # The top config's token ids: an image's rows are `image_token_id`s, between a start and
    # an end token (text to the model).
    image_token_id: int = TOKEN_DEFAULTS["image_token_id"]
    video_token_id: int = TOKEN_DEFAULTS["video_token_id"]
    vision_start_token_id: int = TOKEN_DEFAULTS["vision_start_token_id"]
    vision_end_token_id: int = TOKEN_DEFAULTS["vision_end_token_id"]
    # The text RoPE's frequencies per position stream (time, height, width), interleaved as
    # transformers' Qwen3.5 interleaves them whatever `mrope_interleaved` says; the engine
    # refuses images where it says false (vLLM then lays the sections end to end).
    mrope_section: tuple[int, int, int] = MROPE_SECTION
    mrope_interleaved: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one patch row: in_channels * temporal_patch_size * patch_size ** 2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per image token: spatial_merge_size ** 2."""
        return self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        """Side of the learned square position grid."""
        return int(self.num_position_embeddings**0.5)

    @property
    def params(self) -> int:
        """Parameters of transformers' Qwen3_5VisionModel of this config."""
        h, i, out = self.hidden_size, self.intermediate_size, self.out_hidden_size
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (i * h + i) + (h * i + h)
        merged = self.merge_unit * h
        merger = 2 * h + merged * merged + merged + out * merged + out
        patch = h * self.patch_dim + h
        return self.depth * block + merger + patch + self.num_position_embeddings * h


def vision_fields(raw: dict, top: dict, rope: dict) -> dict[str, Any]:
    """`vision_config`'s object, the top config (its token ids) and the text model's
    rope_parameters -> VisionConfig's fields. ValueError naming a field it does not serve."""
    if not isinstance(raw, dict):
        raise ValueError(f"vision_config is {raw!r}; expected an object")
    out = {k: raw.get(k, v) for k, v in VISION_DEFAULTS.items()}
    for key in ("patch_size", "temporal_patch_size"):
        if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] < 1:
            raise ValueError(f"vision_config.{key} is {out[key]!r}; this engine takes an int >= 1")
    if out["hidden_act"] not in ACTIVATIONS:
        raise ValueError(
            f"vision_config.hidden_act is {out['hidden_act']!r}; the tower computes "
            f"{' and '.join(ACTIVATIONS)}"
        )
    if raw.get("deepstack_visual_indexes"):
        raise ValueError(
            f"vision_config.deepstack_visual_indexes is {raw['deepstack_visual_indexes']!r}; "
            "this engine's tower has no deepstack mergers (Qwen3.5 lists none)"
        )
    out["rope_theta"] = _vision_theta(raw.get("rope_parameters"))
    read = {*VISION_DEFAULTS, "rope_parameters", "deepstack_visual_indexes"}
    for key in raw:
        if key not in read and key not in _INERT and key not in _WRITTEN:
            raise ValueError(
                f"vision_config.{key} is set, and this engine does not read it; it refuses to "
                "serve a tower whose config it would not follow whole"
            )
    out |= {k: int(top.get(k, v)) for k, v in TOKEN_DEFAULTS.items()}
    section = rope.get("mrope_section", MROPE_SECTION)
    if not (isinstance(section, (list, tuple)) and len(section) == 3):
        raise ValueError(f"rope_parameters.mrope_section is {section!r}; expected three ints")
    out["mrope_section"] = tuple(int(s) for s in section)
    out["mrope_interleaved"] = bool(rope.get("mrope_interleaved", True))
    return out


def _vision_theta(params: Any) -> float:
    params = params or {}
    if not isinstance(params, dict):
        raise ValueError(f"vision_config.rope_parameters is {params!r}; expected an object")
    kind = params.get("rope_type", "axial")
    if kind != "axial" or set(params) - {"rope_type", "rope_theta"}:
        raise ValueError(
            f"vision_config.rope_parameters is {params!r}; the tower computes axial RoPE "
            "with a rope_theta only"
        )
    return float(params.get("rope_theta", 10000.0))
