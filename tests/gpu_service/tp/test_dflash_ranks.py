"""A DFlash drafter under tensor parallelism (gloo on the CPU): every rank holds the whole
drafter and runs the same block forwards on the taps of the split target, so TP 2 proposes one
device's drafts, their logits within the rounding of the split sums, through the fused step, a
switch to the MTP head and back, and `settle_verdict`."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_service.engine.facade import Engine
from gpu_service.engine.ranks import Launch, launch
from gpu_service.model.config import ModelConfig, ServiceConfig
from protos.defaults import DEFAULT_MODEL_DIR
from protos.model import DFLASH, MTP_HEAD, greedy_accepted
from tests.gpu_service.dflash.drafter import write_drafter
from tests.steps import logit_rows

SERVICE = ServiceConfig(verify_tiers="4:3", max_context=256)
ATOL, RTOL = 4e-4, 1e-4  # as test_tensor_parallel.py's: a row-parallel sum is reassociated
PROMPTS = [[(7 * i + 3 + 13 * s) % 250 for i in range(n)] for s, n in enumerate((29, 12))]
ND = 3


def _rows(engine: Engine) -> torch.Tensor:
    return torch.stack(
        [torch.frombuffer(bytearray(r), dtype=torch.float32) for r in logit_rows(engine)]
    )


def _drive(engine: Engine) -> tuple[list, list[torch.Tensor]]:
    """Three fused steps (the allocated drafters, then each sequence on the other's, then
    back), then a verify and a `settle_verdict` naming DFlash for both."""
    seqs = [engine.alloc_sequence(drafter=DFLASH), engine.alloc_sequence()]
    tokens, logits = [], []
    try:
        rows = [[t] for t in engine.prefill(seqs, PROMPTS).argmax]
        for names in ([], [MTP_HEAD, DFLASH], []):
            ks = [len(r) for r in rows]
            res = engine.decode_step([t for r in rows for t in r], ks, seqs, [True] * 2, ND, names)
            tokens.append((res.argmax, res.accepted, res.proposers, res.proposal.drafts))
            logits.append(_rows(engine))
            off, rows = 0, []
            for i, k in enumerate(ks):
                rows.append([res.argmax[off + res.accepted[i]], *res.proposal.drafts[i]])
                off += k
        ks = [len(r) for r in rows]
        v = engine.decode_verify_batched([t for r in rows for t in r], ks, seqs)
        kept = [greedy_accepted(rows[0], v.argmax[: ks[0]]) + 1]
        kept.append(greedy_accepted(rows[1], v.argmax[ks[0] :]) + 1)
        last = [v.argmax[kept[0] - 1], v.argmax[ks[0] + kept[1] - 1]]
        prop = engine.settle_verdict(seqs, kept, ks, [0, 1], last, ND, drafters=[DFLASH] * 2)
        tokens.append((v.argmax, kept, prop.drafts, [s.seq_len for s in seqs]))
        logits.append(_rows(engine))
        return tokens, logits
    finally:
        for s in seqs:
            engine.free_sequence(s)


def test_tp_2_drafts_as_one_device(tmp_path: Path) -> None:
    target = ModelConfig.load(DEFAULT_MODEL_DIR)
    drafter = write_drafter(tmp_path / "dflash", target, scale=0.2)
    one = Engine(DEFAULT_MODEL_DIR, SERVICE, "fp32", drafter=drafter)
    faults: list[str] = []
    split = launch(
        Launch(DEFAULT_MODEL_DIR, SERVICE, "fp32", "cpu", 2, drafter=drafter),
        on_fault=faults.append,
    )
    try:
        split.set_forward("eager")
        assert split.capabilities().dflash_block == one.capabilities().dflash_block
        (one_tokens, one_logits), (tp_tokens, tp_logits) = _drive(one), _drive(split)
    finally:
        split.close()
    assert tp_tokens == one_tokens and not faults
    assert all(t[2] == [0, 1] for t in one_tokens[:3]), "both sequences drafted every step"
    for a, b in zip(one_logits, tp_logits, strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL)
