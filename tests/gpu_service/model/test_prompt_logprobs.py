"""Prompt log-probabilities (a prefill's scores) against transformers' Qwen3NextForCausalLM:
each prompt token's log-softmax, its rank and every row's top alternatives, the prompt whole
and in chunks (each chunk's last row scored against the next chunk's first token), beside a
prompt that asks none. fp32."""

from __future__ import annotations

import pytest
import torch

from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.handles import ScoreAsk
from protos.model import InvalidArgument
from tests.gpu_service.model.test_hf_parity import ATOL, _checkpoint

TOP = 5


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, torch.Tensor]:
    directory, reference = _checkpoint(tmp_path_factory.mktemp("ckpt"), {})
    # Past two tiles of scored rows.
    tokens = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = torch.log_softmax(reference(tokens[None]).logits[0].float(), -1)
    return Engine(directory, ServiceConfig(verify_tiers="4:3", max_context=256)), (tokens, want)


def check(scores, tokens: torch.Tensor, want: torch.Tensor, rows: range) -> None:  # type: ignore[no-untyped-def]
    chosen = torch.tensor(scores.logprobs)
    after = tokens[rows.start + 1 : rows.start + 1 + len(chosen)]
    expected = want[rows.start : rows.start + len(chosen)].gather(-1, after[:, None])[:, 0]
    torch.testing.assert_close(chosen, expected, atol=ATOL, rtol=0)
    ranks = (want[rows.start : rows.start + len(chosen)] > expected[:, None] + ATOL).sum(-1) + 1
    assert all(r <= got for r, got in zip(ranks.tolist(), scores.ranks, strict=True))
    top = torch.tensor(scores.top_logprobs)
    torch.testing.assert_close(top, want[rows].topk(TOP, -1).values, atol=ATOL, rtol=0)


def test_scores_are_transformers_log_softmax(pair) -> None:  # type: ignore[no-untyped-def]
    engine, (tokens, want) = pair
    ids = tokens.tolist()
    whole, plain = engine.alloc_sequence(), engine.alloc_sequence()
    done = engine.prefill([whole, plain], [ids, ids], scores=[ScoreAsk(TOP), None])
    scores = done.scores[0]
    assert done.scores[1] is None and len(scores.logprobs) == len(ids) - 1
    assert len(scores.top_ids) == len(ids)  # the last row's: the first generated token's
    check(scores, tokens, want, range(0, len(ids)))
    # The scores leave the prefill's own answer as it is without them.
    assert done.argmax[0] == done.argmax[1] and done.logprobs[0] == done.logprobs[1]
    for s in (whole, plain):
        engine.free_sequence(s)


def test_a_prompt_scored_in_chunks(pair) -> None:  # type: ignore[no-untyped-def]
    engine, (tokens, want) = pair
    ids = tokens.tolist()
    seq = engine.alloc_sequence()
    first = engine.prefill([seq], [ids[:70]], scores=[ScoreAsk(TOP, ids[70])]).scores[0]
    rest = engine.prefill([seq], [ids[70:]], scores=[ScoreAsk(TOP)]).scores[0]
    assert len(first.logprobs) == 70 and len(rest.logprobs) == len(ids) - 71
    check(first, tokens, want, range(0, 70))
    check(rest, tokens, want, range(70, len(ids)))
    engine.free_sequence(seq)


def test_bad_asks_are_refused(pair) -> None:  # type: ignore[no-untyped-def]
    engine, (tokens, _) = pair
    seq = engine.alloc_sequence()
    for ask, sentence in ((ScoreAsk(21), "from 0 to 20"), (ScoreAsk(1, 10**6), "vocab")):
        with pytest.raises(InvalidArgument, match=sentence):
            engine.prefill([seq], [tokens.tolist()], scores=[ask])
    engine.free_sequence(seq)
