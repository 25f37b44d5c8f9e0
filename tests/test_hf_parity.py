"""Our model against transformers' Qwen3NextForCausalLM (which nobody here wrote): random
small configurations saved with `save_pretrained` (sharded), loaded by our engine, compared on
prefill logits at every position and on decoding with verify widths 1..4. fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from gpu_service.config import ServiceConfig
from gpu_service.engine import Engine
from gpu_service.model.hybrid import PREFILL, Segment
from tests.steps import logit_rows

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_experts=0,
    partial_rotary_factor=0.25,
    max_position_embeddings=512,
)
CONFIGS = {
    "dense-untied": {},
    "moe-shared": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
    ),
    "moe-no-norm-topk": dict(
        num_experts=5,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=0,
        norm_topk_prob=False,
        decoder_sparse_step=2,
    ),
    "gqa4-rot50-tied": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        partial_rotary_factor=0.5,
        tie_word_embeddings=True,
        layer_types=["full_attention", "linear_attention"] * 2,
    ),
}
# fp32 through four layers: sums reassociated (row tiles, chunked GDN with another chunk size).
ATOL, RTOL = 2e-4, 1e-4


def _checkpoint(tmp: Path, overrides: dict) -> tuple[Path, Qwen3NextForCausalLM]:
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(**{**BASE, **overrides}, attn_implementation="eager")
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # every parameter away from its initial constant
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp, max_shard_size="100KB")
    return tmp, model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(tmp_path: Path, name: str) -> None:
    directory, reference = _checkpoint(tmp_path, CONFIGS[name])
    assert (directory / "model.safetensors.index.json").exists(), "sharded"
    engine = Engine(directory, ServiceConfig(verify_tiers="4:3", max_context=256))
    assert not engine.cfg.has_mtp, "transformers saves no MTP weights"
    tokens = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens[None]).logits[0].float()

    seq = engine.alloc_sequence()
    hidden = engine.model.forward(tokens, [Segment(seq.slot, 0, 30, 0)], engine.state, PREFILL)
    prefill = engine.model.logits(hidden[:30])
    torch.testing.assert_close(prefill, expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(prefill.argmax(-1), expected.argmax(-1))
    engine.free_sequence(seq)

    seq = engine.alloc_sequence()
    engine.prefill([seq], [tokens[:10].tolist()])
    pos = 10
    for k in (1, 2, 3, 4, 4, 4, 2):
        rows = tokens[pos : pos + k].tolist()
        engine.decode_verify_batched(rows, [k], [seq])
        got = torch.stack(
            [torch.frombuffer(bytearray(r), dtype=torch.float32) for r in logit_rows(engine)]
        )
        engine.gdn_fold_accepted([seq], [k])
        engine.commit_accepted_prefix([seq], [k], [k])
        torch.testing.assert_close(got, expected[pos : pos + k], atol=ATOL, rtol=RTOL)
        assert torch.equal(got.argmax(-1), expected[pos : pos + k].argmax(-1))
        pos += k
    assert pos == 30


def test_missing_and_reshaped_tensors_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory, _ = _checkpoint(tmp_path, CONFIGS["moe-shared"])
    shard = sorted(directory.glob("model-*.safetensors"))[0]
    tensors = load_file(str(shard))
    victim = sorted(tensors)[0]
    save_file(
        {k: v for k, v in tensors.items() if k != victim}, str(shard), metadata={"format": "pt"}
    )
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        Engine(directory, ServiceConfig(verify_tiers="4:3", max_context=256))
    tensors[victim] = torch.zeros(3, 3)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        Engine(directory, ServiceConfig(verify_tiers="4:3", max_context=256))
