"""Prefix snapshots on the engine: a sequence made from one, given the rest of its prompt,
equals one that prefilled the whole prompt, byte for byte, with the drafter going on from its
first step; the snapshot's blocks are shared and never written again, whatever the sequence it
came from does next (drafts rejected at every position included); refusals leave nothing
behind, and every block goes back to the pool at the end."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from control_plane.cli.launch import start_gpu_service, stop
from control_plane.replicas.client import GrpcModel
from gpu_service.engine.facade import Engine
from protos.model import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SequenceHandle,
)
from tests.conftest import SERVE_ARGS, TINY_SERVICE
from tests.servers import capability_within

SHARED = [(5 * i + 3) % 200 + 1 for i in range(128)]  # two blocks
SVC = replace(TINY_SERVICE, prefix_snapshots=2)


def _suffix(seed: int, n: int = 40) -> list[int]:
    return [(11 * i + 7 * seed) % 200 + 1 for i in range(n)]


def _steps(engine: Engine, seq: SequenceHandle, first: int, n: int, wrong: bool = False) -> list:
    """`n` greedy decode steps of k = 3 with the engine's own drafts (or, with `wrong`,
    drafts that differ from them, so that every one is rejected) -> each step's result."""
    out = engine.decode_step([first], [1], [seq], [True], 2)
    results = [out]
    for _ in range(n):
        drafts = out.proposal.drafts[0]
        if wrong:
            drafts = [(d + 1) % 200 for d in drafts]
        rows = [out.argmax[out.accepted[0]], *drafts]
        out = engine.decode_step(rows, [3], [seq], [True], 2)
        results.append(out)
    return results


def _fresh(engine: Engine, prompt: list[int], steps: int) -> tuple[list, torch.Tensor]:
    """The prompt prefilled whole on a fresh sequence, then decoded; the sequence freed."""
    seq = engine.alloc_sequence()
    (first,) = engine.prefill([seq], [prompt]).argmax
    out = _steps(engine, seq, first, steps)
    logits = engine.state.logits.clone()
    engine.free_sequence(seq)
    return out, logits


def test_a_restored_prefix_goes_on_as_a_whole_prefill(tiny_dir: Path) -> None:
    """On the eager forward; the triton forward's restored runs are the circuit diff's
    snapshot case (tests/control_plane/circuit/test_verify_batch.py)."""
    forward = "eager"
    engine = Engine(tiny_dir, SVC)
    engine.set_forward(forward)
    src = engine.alloc_sequence()
    engine.prefill([src], [SHARED])
    (snap,) = engine.snapshot_prefixes([src])
    # The sequence it came from goes on with drafts rejected at every position: its rows past
    # the prefix never reach the snapshot's blocks.
    (first,) = engine.prefill([src], [_suffix(9)]).argmax
    steps = 3
    rejected = _steps(engine, src, first, steps, wrong=True)
    assert [r.accepted[0] for r in rejected[1:]] == [0] * steps
    for seed in (1, 2):
        prompt = SHARED + _suffix(seed)
        seq = engine.alloc_sequence()
        engine.restore_prefixes([seq], [snap])
        assert seq.seq_len == len(SHARED)
        (first,) = engine.prefill([seq], [_suffix(seed)]).argmax
        restored = _steps(engine, seq, first, steps)
        logits = engine.state.logits.clone()
        engine.free_sequence(seq)
        other = engine
        if seed == 1:  # on an engine of its own, and on this one, beside the snapshot
            other = Engine(tiny_dir, SVC)
            other.set_forward(forward)
        whole, whole_logits = _fresh(other, prompt, steps)
        assert restored == whole
        assert torch.equal(logits, whole_logits)
        # Its drafts, from the first step on, are the whole prefill's: the same drafter state.
        assert restored[0].proposers == [0] and restored[0].proposal == whole[0].proposal


def test_shared_blocks_are_held_until_their_last_holder_lets_go(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, SVC)
    blocks = engine.slots.blocks
    src = engine.alloc_sequence()
    engine.prefill([src], [SHARED])
    assert blocks.held(src.slot) == [0, 1]
    (snap,) = engine.snapshot_prefixes([src])
    # Block 0 (positions 0-63) is shared; block 1 holds position 127, whose drafter entry each
    # continuation writes its own: the snapshot keeps a copy of it, block 2.
    assert [blocks.refs(b) for b in (0, 1, 2)] == [2, 1, 1]
    a, b = engine.alloc_sequence(), engine.alloc_sequence()
    engine.restore_prefixes([a, b], [snap, snap])
    assert blocks.held(a.slot) == [0, 3] and blocks.held(b.slot) == [0, 4]
    assert blocks.refs(0) == 4
    engine.free_sequence(src)
    assert blocks.num_used == 4, "a and b hold block 0 and their copies; the snapshot its own"
    engine.drop_prefixes([snap])  # evicted while sequences made from it still hold block 0
    assert blocks.refs(0) == 2 and blocks.num_used == 3
    engine.prefill([a], [[9] * 70])  # a goes on, in blocks of its own past block 0
    assert blocks.held(a.slot)[0] == 0 and blocks.refs(0) == 2
    for seq in (a, b):
        engine.free_sequence(seq)
    assert blocks.num_used == 0 and engine.prefixes.num_held == 0
    with pytest.raises(NotFound, match="snapshot 1 is unknown"):
        engine.drop_prefixes([snap])


def test_refusals_leave_nothing_behind(tiny_dir: Path) -> None:
    engine = Engine(tiny_dir, SVC)
    blocks = engine.slots.blocks
    seq = engine.alloc_sequence()
    engine.prefill([seq], [SHARED[:100]])
    with pytest.raises(InvalidArgument, match="holds 100 tokens; a snapshot is taken at a whole"):
        engine.snapshot_prefixes([seq])
    engine.prefill([seq], [SHARED[100:]])
    engine.decode_verify_batched([1, 2], [2], [seq])
    with pytest.raises(FailedPrecondition, match="has a verify pending"):
        engine.snapshot_prefixes([seq])
    engine.free_sequence(seq)
    a, b, c = (engine.alloc_sequence() for _ in range(3))
    engine.prefill([a, b, c], [SHARED, SHARED, SHARED])
    used = blocks.num_used
    with pytest.raises(ResourceExhausted, match="all 2 prefix snapshots are held"):
        engine.snapshot_prefixes([a, b, c])
    assert engine.prefixes.num_held == 0 and blocks.num_used == used
    snaps = engine.snapshot_prefixes([a, b])
    fresh = engine.alloc_sequence()
    with pytest.raises(FailedPrecondition, match=f"sequence {c.seq_id} holds 128 tokens"):
        engine.restore_prefixes([fresh, c], snaps)
    assert fresh.seq_len == 0 and blocks.held(fresh.slot) == []
    with pytest.raises(NotFound, match="snapshot 99 is unknown"):
        engine.restore_prefixes([fresh], [99])
    for s in (a, b, c, fresh):
        engine.free_sequence(s)
    engine.drop_prefixes(snaps)
    assert blocks.num_used == 0


# Slow: starts a GPU service process.
@pytest.mark.slow
def test_over_grpc_a_snapshot_is_its_sessions(tiny_dir: Path) -> None:
    """Another session's snapshot is not found; a session's end drops its snapshots, and the
    blocks they held go back to the pool."""
    proc, target = start_gpu_service(tiny_dir, *SERVE_ARGS, "--prefix-snapshots", "2")
    mine, theirs = GrpcModel(target), GrpcModel(target)
    try:
        total = theirs.capabilities().kv_blocks
        src = mine.alloc_sequence()
        mine.prefill([src], [SHARED])
        (snap,) = mine.snapshot_prefixes([src])
        other = theirs.alloc_sequence()
        with pytest.raises(NotFound, match=f"prefix snapshot {snap} is unknown"):
            theirs.restore_prefixes([other], [snap])
        with pytest.raises(NotFound, match=f"prefix snapshot {snap} is unknown"):
            theirs.drop_prefixes([snap])
        seq = mine.alloc_sequence()
        mine.restore_prefixes([seq], [snap])
        assert seq.seq_len == len(SHARED)
        # src: blocks 0 and 1; the snapshot's copy of block 1; seq's copy of that.
        assert theirs.capabilities().kv_blocks_free == total - 4
        mine.close()
        capability_within(theirs, "kv_blocks_free", total, 5.0)
    finally:
        theirs.close()
        assert stop(proc) == 0
