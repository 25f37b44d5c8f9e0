"""The DFlash drafter in the engine against the published algorithm (`naive.py`, itself held to
z-lab's package): after a prefill and verifies with rejected rows, a batched block proposes what
the reference proposes from the committed tokens alone, eager and triton (interpreted)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_service.dflash.config import read_config
from gpu_service.dflash.naive import NaiveDFlash
from gpu_service.dflash.weights import load_tensors
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.weights import load_weights
from protos.defaults import DEFAULT_MODEL_DIR
from protos.model import DFLASH, FailedPrecondition, InvalidArgument, greedy_accepted
from tests.gpu_service.dflash.drafter import write_drafter
from training.forward import TrainForward

TARGET = ModelConfig.load(DEFAULT_MODEL_DIR)
SVC = ServiceConfig(verify_tiers="4:15", max_context=256)
# fp32 throughout; the block's logits against the reference's (different op order).
TOL = 2e-4


@pytest.fixture(scope="module")
def drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_drafter(tmp_path_factory.mktemp("dflash"), TARGET, taps=(1, 6, 11), scale=0.2)


def _reference(model_dir: Path, drafter: Path) -> tuple[TrainForward, NaiveDFlash]:
    params, cfg = load_weights(ModelConfig.load(model_dir), model_dir, torch.float32)
    target = TrainForward(cfg, params, 512)
    dcfg = read_config(drafter, cfg)
    weights = load_tensors(dcfg, drafter, torch.float32)
    embed = params["model.embed_tokens.weight"]
    return target, NaiveDFlash(weights, dcfg, embed, target.lm_head)


def _expected(reference, committed: list[int], last: int) -> torch.Tensor:
    target, ref = reference
    ref.crop(0)
    with torch.no_grad():
        ref.extend(target.taps(torch.tensor([committed]), ref.cfg.target_layer_ids)[0])
        return ref.logits(last)


@pytest.mark.parametrize("forward", ["eager", "triton"])
def test_a_batched_block_is_the_reference_block(
    drafter: Path, tiny_dir: Path, tmp_path: Path, forward: str
) -> None:
    """Eager on the bundled model, three verifies deep; Triton, interpreted, on the tiny one,
    after the prefill and one verify."""
    if forward == "eager":
        model_dir, steps, lengths, vocab = DEFAULT_MODEL_DIR, 3, (37, 70), TARGET.vocab_size
    else:
        tiny = ModelConfig.load(tiny_dir)
        drafter = write_drafter(tmp_path / "d", tiny, taps=(0, 3), scale=0.2)
        model_dir, steps, lengths, vocab = tiny_dir, 2, (21, 40), tiny.vocab_size
    reference = _reference(model_dir, drafter)
    engine = Engine(model_dir, SVC, "fp32", drafter=drafter)
    engine.set_forward(forward)
    assert engine.capabilities().dflash_block == 16
    seqs = [engine.alloc_sequence(drafter=DFLASH) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]
    pre = engine.prefill(seqs, prompts)
    committed = [list(p) for p in prompts]
    last = list(pre.argmax)
    drafts: list[list[int]] = [[] for _ in seqs]
    for step in range(steps):
        rows = [[t, *d] for t, d in zip(last, drafts, strict=True)]
        ks = [len(r) for r in rows]
        v = engine.decode_verify_batched([t for r in rows for t in r], ks, seqs)
        kept, nxt, at = [], [], 0
        for r, k in zip(rows, ks, strict=True):
            n = greedy_accepted(r, v.argmax[at : at + k])
            kept.append(n + 1)
            nxt.append(v.argmax[at + n])
            at += k
        for i, r in enumerate(rows):
            committed[i] += r[: kept[i]]
        prop = engine.settle_verdict(seqs, kept, ks, [0, 1], nxt, 15 if step < 2 else 3)
        logits = engine.read_logits()
        last, drafts = nxt, [d[:3] for d in prop.drafts]
        got = torch.frombuffer(bytearray(logits.data), dtype=torch.float32).view(logits.shape)
        for i in range(2):
            want = _expected(reference, committed[i], last[i])
            n = len(prop.drafts[i])
            assert prop.drafts[i] == want[:n].argmax(-1).tolist()
            torch.testing.assert_close(got[i], want[n - 1], atol=TOL, rtol=TOL)


def test_dflash_needs_a_drafter_and_its_block(drafter: Path):
    plain = Engine(DEFAULT_MODEL_DIR, SVC)
    with pytest.raises(FailedPrecondition, match="no DFlash drafter"):
        plain.alloc_sequence(drafter=DFLASH)
    engine = Engine(
        DEFAULT_MODEL_DIR, ServiceConfig(verify_tiers="2:15,2:16", max_context=128), drafter=drafter
    )
    with pytest.raises(InvalidArgument, match="unknown"):
        engine.alloc_sequence(drafter="eagle")
    seq = engine.alloc_sequence(drafter=DFLASH)
    pre = engine.prefill([seq], [list(range(2, 120))])
    engine.decode_verify_batched([pre.argmax[0]], [1], [seq])
    with pytest.raises(InvalidArgument, match="exceeds the context of 128"):
        engine.settle_verdict([seq], [1], [1], [0], [5], 3)
    seq2 = engine.alloc_sequence(drafter=DFLASH)
    pre = engine.prefill([seq2], [list(range(2, 20))])
    engine.decode_verify_batched([pre.argmax[0]], [1], [seq2])
    with pytest.raises(InvalidArgument, match="at most 15"):
        engine.settle_verdict([seq2], [1], [1], [0], [5], 16)
    engine.settle_verdict([seq2], [1], [1], [], [], 3)
    with pytest.raises(InvalidArgument, match="at most 15"):
        engine.decode_step([pre.argmax[0]], [1], [seq2], [True], 16)
    assert engine.decode_step([pre.argmax[0]], [1], [seq2], [True], 3).proposers == [0]
