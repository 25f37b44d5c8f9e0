"""Checkpoint directories: the shipped default, seeded weights, and load-time checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from control_plane.text.grammar import GrammarCompiler
from control_plane.text.tokenizer import ByteTokenizer, load_tokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ModelConfig, ServiceConfig, parse_tiers
from gpu_service.model.weights import init_weights, load_weights, weight_shapes
from met.main import main
from protos.defaults import DEFAULT_MODEL_DIR
from tests.conftest import TINY
from training.checkpoint import init_model


def test_default_config_is_the_documented_hybrid() -> None:
    cfg = ModelConfig.load(DEFAULT_MODEL_DIR)
    assert cfg == ModelConfig()
    # Every field written out, so transformers reads the same model (its defaults differ).
    assert (DEFAULT_MODEL_DIR / "config.json").read_text() == ModelConfig().to_json()
    assert cfg.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 3
    params = sum(math.prod(s) for s in weight_shapes(cfg).values())
    assert 3e6 < params < 4e6, f"{params} parameters"
    assert "mtp.fc.weight" in weight_shapes(cfg)


def test_init_model_cli_is_seeded(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(TINY.to_json())
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(TINY.to_json())
    main(["init-model", str(tmp_path / "a"), "--seed", "3"])
    main(["init-model", str(tmp_path / "b"), "--seed", "3"])
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tok = load_tokenizer(tmp_path / "a")
    assert tok.encode("héllo") == ByteTokenizer.default().encode("héllo"), "byte b is id b"
    assert tok.decode(tok.encode("héllo") + [257]) == "héllo", "specials are dropped"


def test_hf_names(tmp_path: Path) -> None:
    names = weight_shapes(TINY)
    assert names["model.layers.0.linear_attn.in_proj_qkvz.weight"] == (2 * 32 + 2 * 64, 64)
    assert names["model.layers.3.self_attn.q_proj.weight"] == (4 * 16 * 2, 64)
    assert "lm_head.weight" in names
    assert "lm_head.weight" not in weight_shapes(ModelConfig(tie_word_embeddings=True))


def test_missing_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    init_model(tmp_path, TINY, seed=1)
    weights = init_weights(TINY, 1)
    del weights["model.layers.2.linear_attn.A_log"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="A_log"):
        load_weights(TINY, tmp_path, torch.float32)
    weights = init_weights(TINY, 1)
    weights["model.norm.weight"] = torch.zeros(3)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_weights(TINY, tmp_path, torch.float32)


def test_bad_config_fields_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="layer_types\\[1\\]"):
        ModelConfig(num_hidden_layers=2, layer_types=("linear_attention", "sliding"))
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig(hidden_act="gelu")
    d = json.loads(TINY.to_json())
    d["num_hidden_layers"] = 5
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.load(tmp_path)


def test_tiers_and_bf16_serving(tiny_dir: Path) -> None:
    assert parse_tiers("8:3,8:2,16:1") == (3,) * 8 + (2,) * 8 + (1,) * 16
    with pytest.raises(ValueError, match="SLOTS:DRAFTS"):
        parse_tiers("8-3")
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="1:3", max_context=128), "bfloat16")
    seq = engine.alloc_sequence()
    engine.prefill([seq], [[1, 2, 3]])
    logits = engine.read_logits()
    assert logits.dtype == "bfloat16" and len(logits.data) == 2 * 320


def test_every_eos_id_of_the_checkpoint_ends_a_sequence(tmp_path: Path) -> None:
    """config.json's EOS list and generation_config.json's (a list in Qwen checkpoints) both
    reach `Capabilities.eos_token_ids`, the first id first, each once; the scheduler ends a
    sequence on any of them. A round trip through config.json keeps the list."""
    init_model(tmp_path, TINY, seed=2)
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = [257, 9]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 11, 257]}))
    cfg = ModelConfig.load(tmp_path)
    assert (cfg.eos_token_id, cfg.all_eos) == (257, (257, 9, 11))
    assert ModelConfig.from_dict(json.loads(cfg.to_json())).all_eos == (257, 9, 11)
    engine = Engine(tmp_path, ServiceConfig(verify_tiers="2:1", max_context=256))
    assert engine.capabilities().eos_token_ids == (257, 9, 11)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 257}))
    assert ModelConfig.load(tmp_path).all_eos == (257, 9)


def test_a_config_without_eos_takes_the_tokenizers(tmp_path: Path) -> None:
    """A config.json that names no `eos_token_id` (a Qwen3.6 checkpoint's, whose
    tokenizer_config.json names `eos_token`) ends sequences at the tokenizer's EOS, as vLLM
    takes it, beside generation_config.json's ids."""
    init_model(tmp_path, TINY, seed=2)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["eos_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|eos|>"
    assert ModelConfig.load(tmp_path).all_eos == (257,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9]}))
    assert ModelConfig.load(tmp_path).all_eos == (9, 257)
    engine = Engine(tmp_path, ServiceConfig(verify_tiers="2:1", max_context=256))
    caps = engine.capabilities()
    assert caps.eos_token_ids == (9, 257)
    # A grammar on it ends at that EOS (llguidance refuses a tokenizer with none).
    compiler = GrammarCompiler(load_tokenizer(tmp_path), caps.vocab_size, caps.eos_token_ids)
    assert compiler.compile("regex", "ab").valid_prefix([ord("a"), ord("b"), 257]) == 3
    tokenizer_config["eos_token"] = {"content": "<|eos|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (tmp_path / "generation_config.json").unlink()
    assert ModelConfig.load(tmp_path).all_eos == (257,)
