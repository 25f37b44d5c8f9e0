"""The paged attention KV: blocks taken as a sequence grows and given back as it is freed or a
commit rejects its verify's rows, the blocks in use following the tokens held; a sequence the
pool cannot back refused alone, with nothing taken; and the same bytes whichever blocks back a
sequence."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpu_service.engine.facade import Engine
from gpu_service.memory.kv_blocks import blocks_for
from protos.defaults import DEFAULT_MODEL_DIR
from protos.model import ResourceExhausted, SequenceHandle
from tests.conftest import TINY_SERVICE


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * seed) % 200 + 1 for i in range(n)]


def _held_ends(engine: Engine) -> dict[int, int]:
    """Each live sequence's slot -> the positions it keeps: its tokens and its own drafts."""
    seqs = engine.slots._seqs.values()
    return {s.slot: max(s.seq_len, s.own_drafts[-1] + 1 if s.own_drafts else 0) for s in seqs}


def _check_blocks_follow_tokens(engine: Engine) -> None:
    blocks, state = engine.slots.blocks, engine.state
    ends = _held_ends(engine)
    assert blocks.num_used == sum(blocks_for(e) for e in ends.values())
    for slot, end in ends.items():
        held = blocks.held(slot)
        assert len(held) == blocks_for(end)
        table = state.block_table[slot].tolist()
        assert table[: len(held)] == held
        assert set(table[len(held) :]) <= {state.pad_block}
    every = [b for slot in ends for b in blocks.held(slot)]
    assert len(every) == len(set(every)), "a block is held twice"


def _greedy_steps(engine: Engine, seqs: list[SequenceHandle], first: list[int], steps: int) -> list:
    """`steps` decode steps of k = 3 with the engine's own drafts; checks the blocks after each."""
    out = engine.decode_step(first, [1] * len(seqs), seqs, [True] * len(seqs), 2)
    results = [out]
    for _ in range(steps):
        rows, off = [], 0
        for i in range(len(seqs)):
            k = 1 if len(results) == 1 else 3
            rows += [out.argmax[off + out.accepted[i]], *out.proposal.drafts[i]]
            off += k
        out = engine.decode_step(rows, [3] * len(seqs), seqs, [True] * len(seqs), 2)
        results.append(out)
        _check_blocks_follow_tokens(engine)
    return results


def test_the_default_model_at_a_long_context_holds_blocks_for_its_tokens() -> None:
    """32 slots of 32,768 positions start with a pool of 64 blocks (4,096 positions); the
    blocks in use follow the live sequences' tokens through prefills, steps and frees."""
    svc = replace(TINY_SERVICE, max_context=32768, num_slots_override=32, kv_blocks=64)
    engine = Engine(DEFAULT_MODEL_DIR, svc)
    state = engine.state
    assert state.k_cache.shape[1] == 65 and state.block_table.shape == (33, 512)
    seqs = [engine.alloc_sequence() for _ in range(3)]
    first = engine.prefill(seqs, [_prompt(n, i) for i, n in enumerate((130, 64, 7))]).argmax
    _check_blocks_follow_tokens(engine)
    assert engine.slots.blocks.num_used == 3 + 1 + 1
    _greedy_steps(engine, seqs, first, 4)
    engine.free_sequence(seqs[0])
    _check_blocks_follow_tokens(engine)
    for s in seqs[1:]:
        engine.free_sequence(s)
    assert engine.slots.blocks.num_used == 0
    assert bool((state.block_table == state.pad_block).all())


def test_a_verify_past_a_block_boundary_gives_its_block_back_when_rejected(
    tiny_dir: Path,
) -> None:
    engine = Engine(tiny_dir, TINY_SERVICE)
    seq = engine.alloc_sequence()
    engine.prefill([seq], [_prompt(63)])
    blocks = engine.slots.blocks
    assert blocks.held(seq.slot) == [0]
    engine.decode_verify_batched([5, 6, 7], [3], [seq])  # positions 63 to 65
    assert len(blocks.held(seq.slot)) == 2
    engine.gdn_fold_accepted([seq], [1])
    engine.commit_accepted_prefix([seq], [1], [3])  # keeps position 63 only
    assert blocks.held(seq.slot) == [0] and blocks.num_used == 1
    engine.decode_verify_batched([5, 6, 7], [3], [seq])  # positions 64 to 66
    engine.gdn_fold_accepted([seq], [2])
    engine.commit_accepted_prefix([seq], [2], [3])
    assert len(blocks.held(seq.slot)) == 2
    _check_blocks_follow_tokens(engine)


def test_a_sequence_the_pool_cannot_back_is_refused_alone(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, replace(TINY_SERVICE, kv_blocks=3))
    a, b = engine.alloc_sequence(), engine.alloc_sequence()
    engine.prefill([a], [_prompt(100)])  # two blocks
    with pytest.raises(ResourceExhausted, match="1 free blocks of 64 positions; this call needs 2"):
        engine.prefill([b], [_prompt(65, 1)])
    assert b.seq_len == 0 and engine.slots.blocks.held(b.slot) == []
    engine.prefill([b], [_prompt(63, 1)])  # one block fits
    assert engine.slots.blocks.num_free == 0
    # The steps of both still run: their verify rows stay within their last blocks.
    logits = engine.decode_verify_batched([1, 2], [1, 1], [a, b]).argmax
    assert len(logits) == 2


def test_scattered_blocks_give_the_same_bytes(tiny_dir: Path) -> None:
    """A sequence backed by blocks out of order, after another's, equals one backed by the
    first blocks in order: prefill, steps with drafts, and the last logits. (The Triton
    kernel reads scattered tables in tests/control_plane/circuit/test_verify_batch.py's
    snapshot case: a restored sequence's.)"""
    forward = "eager"

    def run(scatter: bool) -> tuple[list, torch.Tensor]:
        engine = Engine(tiny_dir, TINY_SERVICE)
        engine.set_forward(forward)
        if scatter:
            x, y = engine.alloc_sequence(), engine.alloc_sequence()
            engine.prefill([x], [_prompt(70, 3)])  # blocks 0 and 1
            engine.prefill([y], [_prompt(10, 4)])  # block 2
            engine.free_sequence(x)
        seq = engine.alloc_sequence()
        first = engine.prefill([seq], [_prompt(140, 5)]).argmax  # blocks 0, 1 then 3
        if scatter:
            assert engine.slots.blocks.held(seq.slot) == [0, 1, 3]
        steps = _greedy_steps(engine, [seq], first, 3)
        return [first, *steps], engine.state.logits.clone()

    (plain, plain_logits), (scattered, scattered_logits) = run(False), run(True)
    assert plain == scattered
    assert torch.equal(plain_logits, scattered_logits)
