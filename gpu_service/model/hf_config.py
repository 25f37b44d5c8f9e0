"""A `config.json` read as transformers 5 reads it, for the model types this engine serves.

- A field the file leaves out takes transformers' default for its model type (`DEFAULTS`, held
  against transformers' own config classes by tests/gpu_service/test_hf_config.py), never the
  bundled model's: `layer_types` from `full_attention_interval`, RoPE from `rope_parameters` or
  the old `rope_scaling` / `rope_theta` / `partial_rotary_factor`, and so on.
- Qwen3.5 / Qwen3.6 (`qwen3_5`, `qwen3_5_moe`) nest the text model under `text_config` beside a
  `vision_config`; their weights sit under `model.language_model.` and the top config decides
  whether the embedding is tied, as transformers' `...ForConditionalGeneration` does.
- A field the engine does not implement, set to a value that changes the output, is refused
  naming it; so is any field this module does not know (`INERT` lists those that change
  nothing a forward computes).
"""

from __future__ import annotations

from typing import Any

from gpu_service.model.vision_config import vision_fields

LINEAR = "linear_attention"
FULL = "full_attention"

# transformers' defaults of the fields the engine reads, by text model type. Qwen3.5's dense
# model has no experts; its MoE model has no dense MLP, routes every layer and always
# renormalises its top-k weights (transformers removes the fields that would say otherwise).
_HYBRID = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    attention_bias=False,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    max_position_embeddings=32768,
    num_attention_heads=16,
    rope_theta=10000.0,  # PreTrainedConfig.default_theta
    partial_rotary_factor=0.25,
    full_attention_interval=4,
    bos_token_id=None,
    eos_token_id=None,
    tie_word_embeddings=False,
    layer_types=None,
)
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(
        _HYBRID,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=48,
        num_key_value_heads=2,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "qwen3_5_text": dict(
        _HYBRID,
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_key_value_heads=4,
        num_experts=0,
        num_experts_per_tok=0,
        moe_intermediate_size=0,
        shared_expert_intermediate_size=0,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "qwen3_5_moe_text": dict(
        _HYBRID,
        vocab_size=248320,
        hidden_size=2048,
        intermediate_size=0,
        num_hidden_layers=40,
        num_key_value_heads=2,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
}
# A top config -> its text model's type; the text model's weights' prefix.
NESTED = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
NESTED_PREFIX = "model.language_model."
# Fields transformers' class for a type does not have (it drops them); set, they are refused
# unless they hold what the model does anyway.
_FIXED = {
    "qwen3_5_text": ("num_experts", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"),
    "qwen3_5_moe_text": (
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
    ),
}
# Text types whose every layer (and MTP layer) is sparse: a dense width there is read by none.
_NO_DENSE_MLP = ("qwen3_5_moe_text",)

# Fields no forward reads: training settings, cache switches, bookkeeping; and the top
# config's vision token ids and tower, which `vision_config.vision_fields` reads.
INERT = frozenset(
    {
        "architectures",
        "transformers_version",
        "initializer_range",
        "use_cache",
        "attention_dropout",
        "output_router_logits",
        "router_aux_loss_coef",
        "pad_token_id",
        "_name_or_path",
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "vision_config",
    }
)
# Fields that change nothing while they hold these values (the engine implements no other).
_ONLY = {
    "use_sliding_window": (False,),
    "sliding_window": (None,),
    "max_window_layers": None,  # read only with a sliding window
    "attn_output_gate": (True,),
    "mtp_use_dedicated_embeddings": (False,),
    # vLLM's dtype for the GDN state; the engine keeps it in fp32, as transformers does.
    "mamba_ssm_dtype": ("float32",),
}
# RoPE parameters the engine implements, by rope_type; for text the three M-RoPE position
# streams are one, so `mrope_section` and `mrope_interleaved` change nothing.
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_MROPE_KEYS = {"mrope_section", "mrope_interleaved"}
YARN_KEYS = {
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
}
_CONSUMED = {
    "full_attention_interval",
    "rope_scaling",
    "rope_parameters",
    "dtype",
    "torch_dtype",
    "quantization_config",
}


def text_fields(raw: dict) -> tuple[dict[str, Any], str]:
    """config.json's object -> (every field the engine reads, by transformers' name, with
    transformers' defaults filled in; the weights' prefix of the text model). Raises
    ValueError naming a field it does not serve."""
    if not isinstance(raw, dict):
        raise ValueError(f"config.json holds {type(raw).__name__}; expected an object")
    model_type = raw.get("model_type")
    if model_type in NESTED:
        return _nested(raw, model_type), NESTED_PREFIX
    if model_type not in DEFAULTS:
        served = ", ".join(sorted({*DEFAULTS, *NESTED}))
        raise ValueError(f"config.json's model_type is {model_type!r}; this engine serves {served}")
    return _text(raw, model_type, ""), "model."


def _nested(raw: dict, model_type: str) -> dict[str, Any]:
    text_type = NESTED[model_type]
    text = raw.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"text_config is {text!r}; expected an object")
    if text.get("model_type", text_type) != text_type:
        raise ValueError(
            f"text_config's model_type is {text['model_type']!r}; a {model_type} config nests "
            f"{text_type!r}"
        )
    top = {"text_config", "model_type", "tie_word_embeddings", "quantization_config", "dtype"}
    top.add("torch_dtype")
    _refuse_unknown({k: v for k, v in raw.items() if k not in top}, "")
    fields = _text({k: v for k, v in text.items() if k != "model_type"}, text_type, "text_config.")
    # transformers ties by the top config's field (Qwen3_5Config: false when absent).
    fields["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    fields["vision"] = vision_fields(raw.get("vision_config") or {}, raw, rope)
    fields["model_type"] = model_type
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    if dtype:
        fields["torch_dtype"] = dtype
    if raw.get("quantization_config") is not None:
        fields["quantization_config"] = raw["quantization_config"]
    return fields


def _text(raw: dict, model_type: str, where: str) -> dict[str, Any]:
    defaults = DEFAULTS[model_type]
    out = {k: raw.get(k, v) for k, v in defaults.items() if k != "full_attention_interval"}
    for key in _FIXED.get(model_type, ()):
        if key in raw and raw[key] != defaults[key]:
            raise ValueError(
                f"{where}{key} is {raw[key]!r}; transformers' {model_type} has no such field "
                f"and its model computes as if it were {defaults[key]!r}"
            )
    if raw.get("layer_types") is None:
        interval = raw.get("full_attention_interval", defaults["full_attention_interval"])
        out["layer_types"] = _interval_pattern(interval, out["num_hidden_layers"], where)
    out["mlp_only_layers"] = out["mlp_only_layers"] or []
    if model_type in _NO_DENSE_MLP:
        out["intermediate_size"] = 0  # read by no layer: every one routes
    out["model_type"] = model_type
    out["torch_dtype"] = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    out.update(_rope(raw, defaults, out["max_position_embeddings"], where, model_type))
    out["num_nextn_predict_layers"] = _mtp_layers(raw, model_type, where)
    if raw.get("quantization_config") is not None:
        out["quantization_config"] = raw["quantization_config"]
    read = {*defaults, *_CONSUMED, *_ROPE_KEYS, "layer_types", "model_type", _mtp_field(model_type)}
    _refuse_unknown({k: v for k, v in raw.items() if k not in read}, where)
    return out


def _interval_pattern(interval: Any, layers: int, where: str) -> list[str]:
    """transformers' `layer_types` from `full_attention_interval`: every interval-th layer is
    full attention, the rest Gated DeltaNet."""
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ValueError(f"{where}full_attention_interval is {interval!r}; expected an int >= 1")
    return [LINEAR if (i + 1) % interval else FULL for i in range(layers)]


def _rope(raw: dict, defaults: dict, max_positions: int, where: str, model_type: str) -> dict:
    """RoPE as transformers' `convert_rope_params_to_dict` standardises it: `rope_scaling`
    (the old name) or `rope_parameters`, with `rope_theta` and `partial_rotary_factor` from
    the top level where the dict leaves them out."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{where}rope_parameters is {params!r}; expected an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", raw.get("rope_theta", defaults["rope_theta"]))
    factor = params.get(
        "partial_rotary_factor",
        raw.get("partial_rotary_factor", defaults["partial_rotary_factor"]),
    )
    if raw.get("rope_type", rope_type) != rope_type:
        raise ValueError(
            f"{where}rope_type is {raw['rope_type']!r} beside rope_parameters' {rope_type!r}; "
            "transformers reads only the latter"
        )
    known = set(_ROPE_KEYS)
    if model_type != "qwen3_next":
        known |= _MROPE_KEYS
    if rope_type == "yarn":
        known |= YARN_KEYS
    elif rope_type != "default":
        raise ValueError(
            f"{where}rope_parameters.rope_type is {rope_type!r}; this engine computes "
            "'default' and 'yarn' RoPE only"
        )
    extra = sorted(set(params) - known)
    if extra:
        raise ValueError(
            f"{where}rope_parameters.{extra[0]} is set; this engine does not implement it for "
            f"rope_type {rope_type!r}"
        )
    out = {"rope_type": rope_type, "rope_theta": float(theta), "partial_rotary_factor": factor}
    if rope_type == "yarn":
        yarn = {k: params[k] for k in YARN_KEYS if k in params}
        # transformers' standardize_rope_params: the pretraining length defaults to the
        # config's own maximum.
        yarn.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", max_positions),
        )
        out["yarn"] = yarn
    return out


def _mtp_layers(raw: dict, model_type: str, where: str) -> int:
    """The MTP head's depth (1 when the config does not say, as vLLM reads it; a checkpoint
    without `mtp.*` tensors serves without one). The engine drafts with one layer."""
    key = _mtp_field(model_type)
    layers = raw.get(key, 1)
    if not isinstance(layers, int) or isinstance(layers, bool) or not 0 <= layers <= 1:
        raise ValueError(f"{where}{key} is {layers!r}; this engine serves an MTP head of 0 or 1")
    return layers


def _mtp_field(model_type: str) -> str:
    """The MTP head's depth field: Qwen3-Next's name, and Qwen3.5's."""
    return "num_nextn_predict_layers" if model_type == "qwen3_next" else "mtp_num_hidden_layers"


def _refuse_unknown(rest: dict, where: str) -> None:
    for key, value in rest.items():
        if key in INERT:
            continue
        if key in _ONLY:
            values = _ONLY[key]
            if values is None or value in values:
                continue
            raise ValueError(
                f"{where}{key} is {value!r}; this engine implements {values[0]!r} only"
            )
        raise ValueError(
            f"{where}{key} is set, and this engine does not read it; it refuses to serve a "
            "model whose config it would not follow whole"
        )
