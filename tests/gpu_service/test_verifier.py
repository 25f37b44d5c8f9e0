"""Verify, fold and commit leave a sequence exactly where one-token decoding leaves it."""

from __future__ import annotations

import pytest
import torch

from control_plane.replicas.client import GrpcModel
from gpu_service.engine.facade import Engine
from protos.handles import Prefilled, SequenceHandle, Verified
from protos.model import InvalidArgument, Penalties, Sampling, ServingModel
from tests.conftest import random_tokens
from tests.servers import model_server
from tests.steps import decode, logit_rows, verify


# Slow: one verify per token, for every depth and write mode.
@pytest.mark.slow
@pytest.mark.parametrize("write_on_accept", [True, False], ids=["woa", "live"])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_verify_fold_commit_equals_one_at_a_time(
    engine: Engine, rng: torch.Generator, k: int, write_on_accept: bool
) -> None:
    prompt = random_tokens(rng, 37)
    for accepted in range(k):
        drafts = random_tokens(rng, k - 1)
        a, b = engine.alloc_sequence(), engine.alloc_sequence()
        first = engine.prefill([a, b], [prompt, prompt]).argmax
        rows = [first[0], *drafts]
        _, batched = verify(engine, [a], [rows], [accepted + 1], write_on_accept)
        singles = [decode(engine, b, t)[1] for t in rows[: accepted + 1]]
        assert batched[: accepted + 1] == singles, "a verified row differs from its decode"
        assert a.seq_len == b.seq_len == len(prompt) + accepted + 1
        nxt = random_tokens(rng, 1)[0]
        assert decode(engine, a, nxt) == decode(engine, b, nxt), (
            f"k={k}, {accepted} accepted: the next decode differs after the verdict"
        )
        engine.free_sequence(a)
        engine.free_sequence(b)


def test_write_on_accept_values_agree(engine: Engine, rng: torch.Generator) -> None:
    prompts = [random_tokens(rng, n) for n in (11, 20)]
    drafts = [random_tokens(rng, 3) for _ in range(6)]
    runs = []
    for woa in (True, False):
        seqs = [engine.alloc_sequence() for _ in prompts]
        last = engine.prefill(seqs, prompts).argmax
        logits = []
        for step in range(3):
            rows = [[last[i], *drafts[2 * step + i][: 3 - i]] for i in range(2)]
            kept = [1 + (step + i) % len(rows[i]) for i in range(2)]
            out, got = verify(engine, seqs, rows, kept, woa)
            offsets = [0, len(rows[0])]
            last = [out[offsets[i] + kept[i] - 1] for i in range(2)]
            logits.append(got)
        runs.append(logits)
        for s in seqs:
            engine.free_sequence(s)
    assert runs[0] == runs[1]


# Slow: both prefills.
@pytest.mark.slow
def test_recurrent_and_chunked_prefill_agree(engine: Engine, rng: torch.Generator) -> None:
    """A prompt prefilled (chunked GDN) and the same prompt decoded row by row (recurrent)
    reach the same next-token logits within fp32 rounding. The two forms sum in different
    orders (matmuls within chunks against batched row products); on this random-init model
    the GDN output norm of a late layer amplifies that rounding to about 2e-4 on logits of
    magnitude 2.6, so the bound is set there (a wrong state would be off by far more)."""
    prompt = random_tokens(rng, 70)
    a, b = engine.alloc_sequence(), engine.alloc_sequence()
    engine.prefill([a], [prompt])
    chunked = torch.frombuffer(bytearray(logit_rows(engine)[0]), dtype=torch.float32)
    engine.prefill([b], [prompt[:1]])
    for t in prompt[1:-1]:
        decode(engine, b, t)
    _, row = decode(engine, b, prompt[-1])
    recurrent = torch.frombuffer(bytearray(row), dtype=torch.float32)
    torch.testing.assert_close(chunked, recurrent, atol=5e-4, rtol=1e-3)


def test_chunked_prefill_matches_whole_prefill(engine: Engine, rng: torch.Generator) -> None:
    prompt = random_tokens(rng, 90)
    a, b = engine.alloc_sequence(), engine.alloc_sequence()
    whole = engine.prefill([a], [prompt]).argmax[0]
    whole_row = torch.frombuffer(bytearray(logit_rows(engine)[0]), dtype=torch.float32)
    for lo in range(0, 90, 32):
        part = engine.prefill([b], [prompt[lo : lo + 32]]).argmax[0]
    assert b.seq_len == a.seq_len == 90
    torch.testing.assert_close(
        torch.frombuffer(bytearray(logit_rows(engine)[0]), dtype=torch.float32),
        whole_row,
        atol=2e-5,
        rtol=1e-4,
    )
    assert part == whole


def test_propose_after_trim_equals_fresh_propose(engine: Engine, rng: torch.Generator) -> None:
    """Two sequences with the same history: one proposes, is trimmed and proposes again; the
    other proposes once. Drafts, confidences and logits are the same bytes."""
    prompt = random_tokens(rng, 25)
    a, b = engine.alloc_sequence(), engine.alloc_sequence()
    first = engine.prefill([a, b], [prompt, prompt]).argmax
    out = engine.decode_verify_batched([first[0], first[1]], [1, 1], [a, b]).argmax
    engine.stash_verify_hidden_rows([0, 1])
    engine.gdn_fold_accepted([a, b], [1, 1])
    engine.commit_accepted_prefix([a, b], [1, 1], [1, 1])
    engine.run_mtp_propose_batched([out[0]], [0], 3, [a])
    engine.trim_proposer_state([a])
    again = engine.run_mtp_propose_batched([out[0]], [0], 3, [a])
    again_logits = logit_rows(engine)
    fresh = engine.run_mtp_propose_batched([out[1]], [1], 3, [b])
    assert again == fresh
    assert again_logits == logit_rows(engine)
    assert all(0.0 < c <= 1.0 for c in fresh.confidences[0])


def test_untrimmed_drafter_differs(engine: Engine, rng: torch.Generator) -> None:
    """The control for the trim test: an untrimmed drafter keeps the entries it built from its
    own hidden at positions the next verify then commits, and the next propose sees them."""
    prompt = random_tokens(rng, 25)
    seqs = [engine.alloc_sequence(), engine.alloc_sequence()]
    first = engine.prefill(seqs, [prompt, prompt]).argmax
    out = engine.decode_verify_batched(first, [1, 1], seqs).argmax
    engine.stash_verify_hidden_rows([0, 1])
    engine.gdn_fold_accepted(seqs, [1, 1])
    engine.commit_accepted_prefix(seqs, [1, 1], [1, 1])
    drafts = engine.run_mtp_propose_batched(out, [0, 1], 3, seqs).drafts
    engine.trim_proposer_state([seqs[1]])
    rows = [[out[i], *drafts[i][:2]] for i in range(2)]
    out = engine.decode_verify_batched([t for r in rows for t in r], [3, 3], seqs).argmax
    engine.stash_verify_hidden_rows([2, 5])
    engine.gdn_fold_accepted(seqs, [3, 3])
    engine.commit_accepted_prefix(seqs, [3, 3], [3, 3])
    engine.run_mtp_propose_batched([out[2]], [0], 2, [seqs[0]])
    untrimmed = logit_rows(engine)
    engine.run_mtp_propose_batched([out[5]], [1], 2, [seqs[1]])
    assert untrimmed != logit_rows(engine)


def _verified_pair(engine: Engine, rng: torch.Generator):
    prompt = random_tokens(rng, 30)
    seqs = [engine.alloc_sequence() for _ in range(4)]
    first = engine.prefill(seqs, [prompt, prompt, prompt[:20], prompt[:20]]).argmax
    rows = [first[0], 3, 4, first[2], 5]
    return seqs, rows


def test_fused_verdict_equals_the_five_calls(engine: Engine, rng: torch.Generator) -> None:
    seqs, rows = _verified_pair(engine, rng)
    out = engine.decode_verify_batched(
        rows * 2, [3, 2, 3, 2], [seqs[0], seqs[2], seqs[1], seqs[3]]
    ).argmax
    # Halves 0/2 take the single calls; 1/3 the fused one, keeping 2 and 1 rows.
    last = [out[1], out[3]]
    engine.stash_verify_hidden_rows([1, 3])
    engine.gdn_fold_accepted([seqs[0], seqs[2]], [2, 1])
    engine.commit_accepted_prefix([seqs[0], seqs[2]], [2, 1], [3, 2])
    single = engine.run_mtp_propose_batched(last, [0, 1], 2, [seqs[0], seqs[2]])
    engine.trim_proposer_state([seqs[0], seqs[2]])
    fused = engine.settle_verdict([seqs[1], seqs[3]], [2, 1], [3, 2], [0, 1], last, 2)
    assert fused == single
    assert [s.seq_len for s in seqs] == [32, 32, 21, 21]
    assert decode(engine, seqs[0], 9) == decode(engine, seqs[1], 9)
    assert decode(engine, seqs[2], 9) == decode(engine, seqs[3], 9)


def test_refused_verdict_changes_nothing(engine: Engine, rng: torch.Generator) -> None:
    from protos.model import FailedPrecondition, InvalidArgument

    seqs, rows = _verified_pair(engine, rng)
    engine.decode_verify_batched(rows[:3], [3], [seqs[0]])
    engine.decode_verify_batched(rows[:3], [3], [seqs[1]])
    with pytest.raises(FailedPrecondition, match="no longer the last"):
        engine.settle_verdict([seqs[0]], [2], [3], [0], [7], 2)
    with pytest.raises(InvalidArgument, match="kept_rows"):
        engine.settle_verdict([seqs[1]], [4], [3], [], [], 0)
    engine.settle_verdict([seqs[0], seqs[1]], [2, 2], [3, 3], [], [], 0)
    assert decode(engine, seqs[0], 9) == decode(engine, seqs[1], 9)


# -- log-probabilities and alternatives -----------------------------------------------------

PENALIZED = Penalties(presence=0.5, repetition=1.3, bias_ids=(5,), bias_values=(3.0,))
# A mask of the tiny vocabulary (320 ids, ten 32-bit words) allowing tokens 3 and 70 alone.
TWO_TOKENS = bytes(
    b | (1 << 3) if i == 0 else b | (1 << 6) if i == 8 else b for i, b in enumerate(bytes(40))
)
LOGPROB_ATOL = 1e-6  # the reference is the same fp32 log-softmax, over another row count


def _logp(engine: Engine) -> torch.Tensor:
    """The processed logits the last call left, as the reference's log-softmax [rows, V]."""
    lg = engine.read_logits()
    rows = torch.frombuffer(bytearray(lg.data), dtype=getattr(torch, lg.dtype)).view(lg.shape)
    return torch.log_softmax(rows.float(), -1)


def _asked_prefill(model: ServingModel, seqs: list[SequenceHandle], prompt: list[int]) -> Prefilled:
    """Three prompts: penalized with 5 alternatives, sampled with 3, greedy with none."""
    sampling = [None, Sampling(0.8, top_k=40, uniforms=(0.3,)), None]
    return model.prefill(seqs, [prompt, prompt[:9], prompt[:5]], sampling=sampling, top=[5, 3, 0])


def _asked_verify(model: ServingModel, seqs: list[SequenceHandle], first: list[int]) -> Verified:
    """Rows [a, 3, 70] (row 1 masked to two tokens), [b, 7] sampled, [c]: 5, 2 and no
    alternatives."""
    return model.decode_verify_batched(
        [first[0], 3, 70, first[1], 7, first[2]],
        [3, 2, 1],
        seqs,
        masks={1: TWO_TOKENS},
        sampling={1: Sampling(0.9, top_k=50, uniforms=(0.2, 0.7))},
        top=[5, 2, 0],
    )


def _close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want, atol=LOGPROB_ATOL, rtol=0)


def _alternatives_match(ids: list[int], values: list[float], logp: torch.Tensor) -> None:
    """A row's alternatives are its most probable tokens in order (ids where finite: the
    tokens a mask forbids tie at -inf)."""
    want = logp.topk(len(ids))
    _close(values, want.values)
    finite = want.values.isfinite()
    assert torch.tensor(ids, dtype=torch.long)[finite].tolist() == want.indices[finite].tolist()


def test_a_verifys_logprobs_are_the_processed_logits_log_softmax(
    engine: Engine, rng: torch.Generator
) -> None:
    """Each asked row's alternatives, its next row's token's log-probability and a sampled
    row's draws' log-probabilities equal a torch log-softmax of the logits the verdict read:
    penalties, bias and the mask applied."""
    prompt = random_tokens(rng, 14)
    seqs = [engine.alloc_sequence(PENALIZED), engine.alloc_sequence(), engine.alloc_sequence()]
    p = _asked_prefill(engine, seqs, prompt)
    ref = _logp(engine)
    _alternatives_match(p.top_ids[0], p.top_logprobs[0], ref[0])
    _alternatives_match(p.top_ids[1], p.top_logprobs[1], ref[1])
    assert p.top_ids[2] == p.top_logprobs[2] == []
    # The greedy first tokens' are their argmaxes'; the sampled one's, its own token's (which
    # is not the argmax here, so an argmax's log-probability would not pass).
    assert p.argmax[1] != int(ref[1].argmax())
    _close(p.logprobs, torch.stack([ref[0].max(), ref[1, p.argmax[1]], ref[2].max()]))
    v = _asked_verify(engine, seqs, p.argmax)
    ref = _logp(engine)
    for r in range(5):
        _alternatives_match(v.top_ids[r], v.top_logprobs[r], ref[r])
    assert v.top_ids[5] == v.top_logprobs[5] == [] and v.draws[5] is None
    assert not ref[1].isfinite().all(), "the masked row holds forbidden tokens at -inf"
    _close([v.next_logprobs[r] for r in (0, 1, 3)], ref[[0, 1, 3], [3, 70, 7]])
    assert [v.next_logprobs[r] for r in (2, 4, 5)] == [0.0, 0.0, 0.0]
    for r in (3, 4):
        d = v.draws[r]
        assert d is not None
        _close([d.resample_logprob, d.sample_logprob], ref[r, [d.resample, d.sample]])
    _close(v.logprobs, ref.max(-1).values)


def test_logprobs_and_alternatives_cross_the_wire(engine: Engine, rng: torch.Generator) -> None:
    """Over gRPC, the same calls give the same replies; counts out of range are refused
    with a sentence."""
    prompt = random_tokens(rng, 14)
    local = [engine.alloc_sequence(PENALIZED), engine.alloc_sequence(), engine.alloc_sequence()]
    p = _asked_prefill(engine, local, prompt)
    v = _asked_verify(engine, local, p.argmax)
    with model_server(engine) as target:
        client = GrpcModel(target)
        try:
            seqs = [client.alloc_sequence(PENALIZED), *(client.alloc_sequence() for _ in "ab")]
            assert _asked_prefill(client, seqs, prompt) == p
            assert _asked_verify(client, seqs, p.argmax) == v
            client.settle_verdict(seqs, [1, 1, 1], [3, 2, 1], [], [], 0)
            with pytest.raises(InvalidArgument, match="at most 20"):
                client.decode_verify_batched([1], [1], seqs[:1], top=[21])
            with pytest.raises(InvalidArgument, match="2 alternative counts for 1 sequences"):
                client.decode_verify_batched([1], [1], seqs[:1], top=[1, 2])
            with pytest.raises(InvalidArgument, match="at most 20"):
                client.prefill(seqs[:1], [[1]], top=[99])
        finally:
            client.close()
