"""`met train dflash`'s forward and loop: a training block is the served block at its anchor,
the loss falls, and a stopped run resumes to the same weights."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from gpu_service.dflash.naive import NaiveDFlash
from gpu_service.model.config import ModelConfig
from training.dflash_options import DFlashTrainConfig
from training.dflash_train import block_mask, drafter_config, init_drafter, sequence_loss, train

TC = DFlashTrainConfig(prompt_len=8, gen_len=24, layers=2, taps=(1, 3, 5), anchors=4, batch=2)


def _setup(seed: int = 0):
    target = replace(
        ModelConfig(),
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        num_hidden_layers=12,
    )
    cfg = drafter_config(target, TC)
    gen = torch.Generator().manual_seed(seed)
    params = init_drafter(cfg, seed)
    with torch.no_grad():  # norms away from one, so a wrong norm shows
        for k, v in params.items():
            if k.endswith("norm.weight") or k == "mask_embedding":
                v.copy_(1 + 0.3 * torch.randn(v.shape, generator=gen))
            else:
                v.mul_(10)
    embed = torch.randn(64, 32, generator=gen)
    taps = torch.randn(TC.seq_len, 3 * 32, generator=gen)
    tokens = torch.randint(0, 64, (TC.seq_len,), generator=gen)
    return cfg, params, embed, taps, tokens


def test_block_mask_sees_the_context_before_its_anchor_and_its_own_block():
    mask = block_mask(torch.tensor([2, 5]), 6, 3)
    assert mask.shape == (6, 12)
    assert mask[:3, :6].tolist() == [[True, True, False, False, False, False]] * 3
    assert mask[3:, :6].tolist() == [[True] * 5 + [False]] * 3
    assert mask[0, 6:].tolist() == [True] * 3 + [False] * 3
    assert mask[4, 6:].tolist() == [False] * 3 + [True] * 3


def test_a_training_block_is_the_served_block_at_its_anchor():
    """Each anchor's rows, trained several at once under the block mask, equal the reference
    drafter's block after the context up to that anchor: the same cross-entropies."""
    cfg, p, embed, taps, tokens = _setup()
    anchors = torch.tensor([8, 13, 20])
    with torch.no_grad():
        total, weight = sequence_loss(p, cfg, embed, embed, taps, tokens, anchors, 7.0)
        expect = torch.zeros(())
        for a in anchors.tolist():
            ref = NaiveDFlash(p, cfg, embed, embed)
            ref.extend(taps[:a])
            logits = ref.logits(int(tokens[a]))
            rows = [k for k in range(1, cfg.block_size) if a + k < TC.seq_len]
            ce = F.cross_entropy(
                logits[[k - 1 for k in rows]], tokens[[a + k for k in rows]], reduction="none"
            )
            w = torch.exp(-(torch.tensor(rows, dtype=torch.float32) - 1) / 7.0)
            expect = expect + (ce * w).sum()
    torch.testing.assert_close(total, expect, rtol=1e-4, atol=1e-4)
    assert weight > 0


def _data(n: int = 6):
    gen = torch.Generator().manual_seed(1)
    return {
        "tokens": torch.randint(0, 64, (n, TC.seq_len), generator=gen),
        "taps": torch.randn(n, TC.seq_len, 3 * 32, generator=gen).bfloat16(),
    }


def test_the_loss_falls_and_a_stopped_run_resumes_to_the_same_weights(tmp_path):
    cfg, _, embed, _, _ = _setup()
    target = {"model.embed_tokens.weight": embed}
    tc = replace(TC, steps=8, save_every=4, warmup=2, lr=3e-3)
    whole, log, _ = train(_data(), target, cfg, tmp_path / "a", tc)
    assert log[-1]["loss"] < log[0]["loss"]
    train(_data(), target, cfg, tmp_path / "b", tc, stop_at=4)
    resumed, log_b, _ = train(_data(), target, cfg, tmp_path / "b", tc)
    assert [e["loss"] for e in log_b] == [e["loss"] for e in log]
    for k, v in whole.items():
        assert torch.equal(v, resumed[k]), k


def test_a_run_starts_from_an_exported_drafter(tmp_path):
    from gpu_service.dflash.weights import save_tensors

    cfg, p, embed, _, _ = _setup(seed=3)
    save_tensors({k: v.detach() for k, v in p.items()}, tmp_path / "init")
    tc = replace(TC, steps=1, save_every=1, lr=0.0, warmup=1, init_from=str(tmp_path / "init"))
    weights, _, _ = train(_data(), {"model.embed_tokens.weight": embed}, cfg, tmp_path / "w", tc)
    for k, v in p.items():
        assert torch.equal(weights[k], v.detach()), k
