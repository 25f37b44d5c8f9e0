"""config.json read as transformers reads it (gpu_service/model/hf_config.py): the committed
published configs, and configs with every optional field removed, against transformers' own config
objects; what the engine does not implement refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from gpu_service.model.config import ModelConfig

MODELS = Path(__file__).resolve().parents[2] / "gpu_service/models"
PUBLISHED = ["qwen3-next-80b-a3b", "qwen3-next-80b-a3b-fp8", "qwen3.5-27b", "qwen3.5-35b-a3b"]
PUBLISHED += ["qwen3.5-397b-a17b", "qwen3.5-122b-a10b"]
BARE = [{"model_type": t} for t in ("qwen3_next", "qwen3_5", "qwen3_5_moe")]
BARE += [{"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 6}}]
BARE += [{"model_type": "qwen3_next", "num_hidden_layers": 5, "full_attention_interval": 2}]


def _theirs(raw: dict):
    """transformers' config object, and its text model's."""
    body = {k: v for k, v in raw.items() if k not in ("model_type", "quantization_config")}
    top = AutoConfig.for_model(raw["model_type"], **json.loads(json.dumps(body)))
    return top, top.get_text_config()


def _moe_layers(text, n: int) -> list[bool]:
    experts = getattr(text, "num_experts", 0)
    if text.model_type == "qwen3_5_moe_text":
        return [True] * n  # Qwen3_5MoeDecoderLayer: a sparse block in every layer
    if not experts:
        return [False] * n
    return [
        i not in text.mlp_only_layers and (i + 1) % text.decoder_sparse_step == 0 for i in range(n)
    ]


@pytest.mark.parametrize(
    "raw",
    [json.loads((MODELS / m / "config.json").read_text()) for m in PUBLISHED] + BARE,
    ids=[*PUBLISHED, *(json.dumps(b) for b in BARE)],
)
def test_the_engine_reads_what_transformers_builds(raw: dict) -> None:
    ours = ModelConfig.from_dict(raw)
    top, text = _theirs(raw)
    n = text.num_hidden_layers
    assert ours.num_hidden_layers == n
    assert list(ours.layer_types) == list(text.layer_types)
    rope = text.rope_parameters
    assert (ours.rope_type, ours.rope_theta) == (rope["rope_type"], rope["rope_theta"])
    assert ours.partial_rotary_factor == rope["partial_rotary_factor"]
    assert [ours.is_moe_layer(i) for i in range(n)] == _moe_layers(text, n)
    for field in (
        "vocab_size",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "hidden_act",
        "attention_bias",
    ):
        assert getattr(ours, field) == getattr(text, field), field
    if any(_moe_layers(text, n)):
        assert ours.num_experts == text.num_experts
        assert ours.num_experts_per_tok == text.num_experts_per_tok
        assert ours.moe_intermediate_size == text.moe_intermediate_size
        assert ours.shared_expert_intermediate_size == text.shared_expert_intermediate_size
    if not all(_moe_layers(text, n)):
        assert ours.intermediate_size == text.intermediate_size
    assert ours.tie_word_embeddings == top.tie_word_embeddings
    eos = text.eos_token_id
    assert ours.all_eos == tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    nested = raw["model_type"] != "qwen3_next"
    assert ours.weight_prefix == ("model.language_model." if nested else "model.")
    assert ours.separate_gdn_projections == nested


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type is 'linear'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4, "low_freq_factor": 1}}, "low_freq"),
        ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers is 2"),
        ({"some_new_switch": 1}, "some_new_switch is set"),
        ({"layer_types": ["sliding_attention"] * 48}, r"layer_types\[0\]"),
    ],
)
def test_what_the_engine_does_not_implement_is_named(change: dict, named: str) -> None:
    raw = json.loads((MODELS / "qwen3-next-80b-a3b/config.json").read_text())
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_dict({**raw, **change})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"mtp_use_dedicated_embeddings": True}, "text_config.mtp_use_dedicated_embeddings"),
        ({"mtp_num_hidden_layers": 3}, "text_config.mtp_num_hidden_layers is 3"),
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"mamba_ssm_dtype": "bfloat16"}, "mamba_ssm_dtype"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"model_type": "qwen3_next"}, "nests 'qwen3_5_moe_text'"),
    ],
)
def test_a_nested_field_is_named_with_its_place(change: dict, named: str) -> None:
    raw = json.loads((MODELS / "qwen3.5-35b-a3b/config.json").read_text())
    raw["text_config"] |= change
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_dict(raw)


def test_an_unknown_model_type_names_the_served_ones() -> None:
    with pytest.raises(ValueError, match="'llama'; this engine serves qwen3_5, qwen3_5_moe"):
        ModelConfig.from_dict({"model_type": "llama"})


def test_yarn_takes_transformers_defaults() -> None:
    raw = {
        "model_type": "qwen3_5",
        "text_config": {
            "max_position_embeddings": 1000,
            "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7},
        },
    }
    cfg = ModelConfig.from_dict(raw)
    assert cfg.yarn is not None and cfg.yarn.original_max_position_embeddings == 1000
    _, text = _theirs(raw)
    assert text.rope_parameters["original_max_position_embeddings"] == 1000
    assert cfg.yarn.scale == pytest.approx(0.1 * __import__("math").log(4.0) + 1.0)


@pytest.mark.parametrize("text", ["{", "[1, 2]", "\xff"], ids=["broken", "a-list", "not-utf8"])
def test_a_config_that_is_not_a_json_object_is_named(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'} (is not JSON|holds list)"):
        ModelConfig.load(tmp_path)
