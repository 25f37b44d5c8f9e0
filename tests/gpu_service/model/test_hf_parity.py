"""Our model against transformers' Qwen3NextForCausalLM (which nobody here wrote): random
small configurations saved with `save_pretrained` (sharded), loaded by our engine, compared on
prefill logits at every position and on decoding with verify widths 1..4. fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from gpu_service.model.hybrid import PREFILL, Segment
from tests.hf_checkpoint import BASE
from tests.steps import logit_rows

# Slow: builds transformers' reference model for every comparison.
pytestmark = pytest.mark.slow

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
# fp32 through four layers: sums reassociated (row tiles, chunked GDN with another chunk size),
# and ATen's vector kernels round unlike its scalar ones. On an AVX-512 CPU (AMD EPYC) our
# logits of a seeded tiny checkpoint sat 2.7e-4 from transformers' in float64 (theirs in fp32:
# 5.9e-5), on a logit scale of 3.4; with `ATEN_CPU_CAPABILITY=default` (scalar kernels), ours
# and theirs in fp32 agreed to 3.5e-5, so the gap is rounding, not the math.
ATOL, RTOL = 4e-4, 1e-4


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


def test_no_mtp_checkpoint_serves_with_speculation_off(tmp_path: Path) -> None:
    from control_plane.scheduler.env import Env
    from control_plane.scheduler.scheduler import Scheduler
    from control_plane.scheduler.seq import GenRequest
    from control_plane.text.tokenizer import ByteTokenizer
    from protos.params import MTP, NONE
    from tests.collect import run_all

    directory, _ = _checkpoint(tmp_path, {})
    engine = Engine(directory, ServiceConfig(verify_tiers="4:3", max_context=256), "fp32")
    assert not engine.capabilities().has_mtp
    s = Scheduler(lambda: engine, ByteTokenizer.default(), env=Env())
    s.start()
    try:
        reqs = [GenRequest(m, (5, 6, 7), 6, method=m) for m in (MTP, NONE)]
        mtp, none = run_all(s, reqs)
    finally:
        s.stop()
    assert mtp.tokens == none.tokens and mtp.finish.stats.drafted == 0


def test_mtp_head_matches_its_formula(tiny_dir: Path) -> None:
    """The first draft's logits against the Qwen3-Next MTP formula written out in torch:
    fc(cat(norm_e(embed(t)), norm_h(h))), one attention layer over the lone entry (its value
    through the output gate), the MLP, the final norm, the shared lm_head."""
    import torch.nn.functional as F

    from gpu_service.model.weights import load_weights

    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256))
    w, eps = load_weights(engine.cfg, tiny_dir, torch.float32)[0], engine.cfg.rms_norm_eps

    def norm(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w[name])

    seq = engine.alloc_sequence()
    first = engine.prefill([seq], [[42]]).argmax[0]  # one token: nothing primes the drafter
    bonus = engine.decode_verify_batched([first], [1], [seq]).argmax[0]
    engine.stash_verify_hidden_rows([0])
    h = engine.state.stash[0]
    engine.gdn_fold_accepted([seq], [1])
    engine.commit_accepted_prefix([seq], [1], [1])
    engine.run_mtp_propose_batched([bonus], [0], 1, [seq])
    got = torch.frombuffer(bytearray(logit_rows(engine)[0]), dtype=torch.float32)

    e = norm(w["model.embed_tokens.weight"][bonus], "mtp.pre_fc_norm_embedding.weight")
    x = F.linear(torch.cat([e, norm(h, "mtp.pre_fc_norm_hidden.weight")]), w["mtp.fc.weight"])
    p = "mtp.layers.0"
    a = norm(x, f"{p}.input_layernorm.weight")
    heads, d = engine.cfg.num_attention_heads, engine.cfg.head_dim
    gate = F.linear(a, w[f"{p}.self_attn.q_proj.weight"]).view(heads, 2 * d)[:, d:]
    v = F.linear(a, w[f"{p}.self_attn.v_proj.weight"]).view(-1, d)
    v = v.repeat_interleave(heads // v.shape[0], 0)  # one key: softmax weight 1
    x = x + F.linear((v * torch.sigmoid(gate)).reshape(-1), w[f"{p}.self_attn.o_proj.weight"])
    m = norm(x, f"{p}.post_attention_layernorm.weight")
    up = F.silu(F.linear(m, w[f"{p}.mlp.gate_proj.weight"])) * F.linear(
        m, w[f"{p}.mlp.up_proj.weight"]
    )
    x = x + F.linear(up, w[f"{p}.mlp.down_proj.weight"])
    lm_head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    expected = F.linear(norm(x, "mtp.norm.weight"), lm_head)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_transformers_loads_our_checkpoints(tmp_path: Path) -> None:
    """One format: what `met init-model` writes, transformers loads and runs to our logits."""
    from tests.conftest import TINY
    from training.checkpoint import init_model

    init_model(tmp_path, TINY, seed=3)
    theirs = Qwen3NextForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    engine = Engine(tmp_path, ServiceConfig(verify_tiers="4:3", max_context=256))
    tokens = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = theirs(tokens[None]).logits[0].float()
    seq = engine.alloc_sequence()
    hidden = engine.model.forward(tokens, [Segment(seq.slot, 0, 20, 0)], engine.state, PREFILL)
    torch.testing.assert_close(engine.model.logits(hidden[:20]), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("field", "value"),
    [("attention_bias", True), ("hidden_act", "gelu"), ("layer_types", ["sliding_attention"] * 4)],
)
def test_unsupported_config_fields_are_named(tmp_path: Path, field: str, value) -> None:
    import json

    directory, _ = _checkpoint(tmp_path, {})
    cfg = json.loads((directory / "config.json").read_text())
    cfg[field] = value
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        Engine(directory, ServiceConfig(verify_tiers="4:3", max_context=256))


def test_serve_an_hf_directory(tmp_path: Path) -> None:
    from control_plane.cli.launch import start_gpu_service, stop
    from control_plane.replicas.client import GrpcModel

    directory, reference = _checkpoint(tmp_path, CONFIGS["moe-shared"])
    proc, target = start_gpu_service(
        directory, "--verify-tiers", "4:3", "--max-context", "256", "--dtype", "fp32"
    )
    try:
        model = GrpcModel(target)
        caps = model.capabilities()
        assert caps.vocab_size == 300 and not caps.has_mtp and caps.dtype == "float32"
        seq = model.alloc_sequence()
        prompt = [5, 17, 99, 3]
        with torch.no_grad():
            expected = int(reference(torch.tensor([prompt])).logits[0, -1].argmax())
        assert model.prefill([seq], [prompt]).argmax == [expected]
        model.close()
    finally:
        assert stop(proc) == 0
