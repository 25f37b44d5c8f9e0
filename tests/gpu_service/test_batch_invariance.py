"""A row's outputs do not depend on which rows share the call, nor on k: byte for byte."""

from __future__ import annotations

import pytest
import torch

from gpu_service.engine.facade import Engine
from gpu_service.model.ops import linear, pad_rows
from tests.conftest import random_tokens
from tests.steps import decode, logit_rows, verify


@pytest.mark.parametrize("width", [768, 4096], ids=lambda w: f"N{w}")
@pytest.mark.parametrize("rows", [1, 2, 5, 11, 16, 17, 40, 100], ids=lambda r: f"R{r}")
def test_tiled_linear_row_invariant(rows: int, width: int) -> None:
    """A projection and a vocabulary-wide LM head, at one torch thread as the engine runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(rows)
        weight_t = torch.randn(256, width, generator=gen)
        probe = torch.randn(1, 256, generator=gen)
        alone = linear(pad_rows(probe), weight_t)[0]
        for where in {0, rows // 2, rows - 1}:
            x = torch.randn(rows, 256, generator=gen)
            x[where] = probe[0]
            assert torch.equal(linear(pad_rows(x), weight_t)[where], alone)
    finally:
        torch.set_num_threads(threads)


def _batched_run(
    engine: Engine,
    prompts: list[list[int]],
    ks: list[int],
    forward: str,
    rng_seed: int,
    spare_at: int | None,
) -> tuple[list[bytes], list[list[bytes]]]:
    """Prefill, then three batched verify steps with drafts from a fixed generator."""
    engine.set_forward(forward)
    gen = torch.Generator().manual_seed(rng_seed)
    seqs, spare = [], None
    for i in range(len(prompts)):
        if i == spare_at:
            spare = engine.alloc_sequence()
        seqs.append(engine.alloc_sequence())
    last = engine.prefill(seqs, prompts).argmax
    prefill = logit_rows(engine)
    steps = []
    for step in range(3):
        rows = [[last[i], *random_tokens(gen, k - 1)] for i, k in enumerate(ks)]
        kept = [1 + (step + i) % k for i, k in enumerate(ks)]
        out, logits = verify(engine, seqs, rows, kept)
        offsets = [sum(ks[:i]) for i in range(len(ks))]
        last = [out[offsets[i] + kept[i] - 1] for i in range(len(ks))]
        steps.append(logits)
    for s in [*seqs, *([spare] if spare else [])]:
        engine.free_sequence(s)
    return prefill, steps


@pytest.mark.parametrize(
    ("ks", "spare_at"),
    [([4, 4], None), ([2, 2, 2], None), ([4, 4, 3, 2, 2, 2, 2], 3), ([1, 3, 2], 1)],
    ids=["uniform-k4", "uniform-k2", "ragged-fragmented", "ragged-k1"],
)
def test_batched_verify_equals_serial(
    engine: Engine, rng: torch.Generator, ks: list[int], spare_at: int | None
) -> None:
    prompts = [random_tokens(rng, 5 + 7 * i) for i in range(len(ks))]
    batched = _batched_run(engine, prompts, ks, "eager", 99, spare_at)
    serial = _batched_run(engine, prompts, ks, "eager-serial", 99, spare_at)
    assert batched[0] == serial[0], "prefill logits differ between batched and serial"
    for step, (b, s) in enumerate(zip(batched[1], serial[1], strict=True)):
        assert b == s, f"step {step}: batched and serial verify logits differ"


def test_row_logits_do_not_depend_on_k(engine: Engine, rng: torch.Generator) -> None:
    """Each row of a k = 4 verify equals the same row decoded alone (k = 1) after the same
    prefix, while other sequences share the batch."""
    prompt, other = random_tokens(rng, 63), random_tokens(rng, 9)
    a, b, c = engine.alloc_sequence(), engine.alloc_sequence(), engine.alloc_sequence()
    first = engine.prefill([a, b, c], [prompt, prompt, other]).argmax
    rows = [first[0], *random_tokens(rng, 3)]
    _, logits = verify(engine, [c, a], [[first[2], 1], rows], [2, 4])
    alone = [decode(engine, b, t)[1] for t in rows]
    assert logits[2:] == alone


@pytest.mark.parametrize("split", [[192, 8], [128, 72], [64, 64, 72]], ids=str)
def test_a_prefill_in_block_aligned_parts_is_one_prefill(split: list[int]) -> None:
    """A prompt prefilled in parts that end on key blocks (64 positions, the chunked GDN's
    chunk too) leaves the bytes of one prefill: the last row's logits, every layer's GDN state
    and conv window, the KV cache; and the next verify reads the same logits. What resuming a
    sequence from a prefix's state needs (issue 35)."""
    from gpu_service.model.config import ServiceConfig
    from protos.defaults import DEFAULT_MODEL_DIR

    svc = ServiceConfig(verify_tiers="4:3", max_context=256)
    prompt = [(7 * i + 3) % 4000 for i in range(200)]

    def run(parts: list[int]) -> list:
        engine = Engine(DEFAULT_MODEL_DIR, svc, "fp32")
        seq, start = engine.alloc_sequence(), 0
        for n in parts:
            first = engine.prefill([seq], [prompt[start : start + n]]).argmax
            start += n
        state = engine.state
        out = [
            logit_rows(engine)[-1],
            state.gdn[:, seq.slot].clone(),
            state.conv[:, seq.slot].clone(),
            state.k_cache[:, seq.slot, :200].clone(),
            state.v_cache[:, seq.slot, :200].clone(),
        ]
        engine.decode_verify_batched([first[0], 5, 6, 7], [4], [seq])
        return [*out, logit_rows(engine)]

    whole, parts = run([200]), run(split)
    assert parts[0] == whole[0] and parts[-1] == whole[-1]
    assert all(torch.equal(a, b) for a, b in zip(parts[1:-1], whole[1:-1], strict=True))
