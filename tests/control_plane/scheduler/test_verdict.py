"""What a verdict gives a request that asks log-probabilities: each token's own (an accepted
draft's, the bonus's, a draw's) and, when asked, its row's alternatives, whichever method
drafted it and whether the step ran ahead or not."""

from __future__ import annotations

import pytest

from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.params import MTP, NONE, PROMPT_LOOKUP, SamplingParams
from tests.collect import Outcome, run_all
from tests.conftest import TRAINED
from tests.fake_model import FakeModel

TOK = ByteTokenizer.default()
SERVICE = ServiceConfig(verify_tiers="8:3", max_context=256)
PROMPT = "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n   "
LOGPROB_ATOL = 1e-6  # one engine, one forward: only the rows sharing a call differ


def _asking(method: str, top: int, n: int = 12, **extra) -> GenRequest:
    prompt = tuple(PROMPT.encode())
    return GenRequest(
        f"{method}-{top}", prompt, n, method=method, logprobs=True, top_logprobs=top, **extra
    )


def test_alternatives_take_the_verify_path_and_reach_every_token() -> None:
    """With the pipeline and the fused step on, a request asking alternatives still steps by
    a verify and a verdict (a step plan lists none): every token, the first included, comes
    with the alternatives of the row that gave it."""
    model = FakeModel()
    s = Scheduler(lambda: model, TOK, SchedulerOptions(), Env())
    s.start()
    try:
        outs = run_all(s, [_asking(MTP, 3), _asking(NONE, 2)])
    finally:
        s.stop()
    assert not [c for c in model.calls if c[0] == "step"], "a step plan or decode_step ran"
    for out, top in zip(outs, (3, 2), strict=True):
        assert len(out.tokens) == 12 and out.logprobs == [-0.5] * 12
        # The fake's alternatives: the row's argmax (the token, greedy), then the ids after it.
        assert out.top_ids == [[(t + j) % 256 for j in range(top)] for t in out.tokens]
        assert out.top_logprobs == [[-0.5 - j for j in range(top)]] * 12


@pytest.fixture(scope="module")
def engine() -> Engine:
    """A trained checkpoint: its drafts are accepted, so verdicts keep drafts."""
    return Engine(TRAINED, SERVICE)


def _serve(engine: Engine, reqs: list[GenRequest]) -> list[Outcome]:
    s = Scheduler(lambda: engine, TOK, SchedulerOptions(), Env())
    s.start()
    try:
        return run_all(s, reqs)
    finally:
        s.stop()


def test_greedy_logprobs_and_alternatives_agree_across_methods(engine: Engine) -> None:
    """On a trained checkpoint, greedy mtp and prompt lookup give none's tokens, log-probabilities
    and alternatives, with a request that asks none beside them (which runs ahead)."""
    runs = {
        m: _serve(engine, [_asking(m, 5, 16), _asking(m, 0, 16)])
        for m in (NONE, MTP, PROMPT_LOOKUP)
    }
    plain = runs[NONE][0]
    assert len(plain.top_ids) == 16 and all(len(t) == 5 for t in plain.top_ids)
    for m in (MTP, PROMPT_LOOKUP):
        got = runs[m][0]
        assert got.finish is not None and got.finish.stats.accepted > 0, f"{m} kept no draft"
        assert got.tokens == plain.tokens and got.top_ids == plain.top_ids, m
        for a, b in [
            (got.logprobs, plain.logprobs),
            *zip(got.top_logprobs, plain.top_logprobs, strict=True),
        ]:
            assert a == pytest.approx(b, abs=LOGPROB_ATOL), m
        assert runs[m][1].tokens == plain.tokens and runs[m][1].top_ids == []


@pytest.mark.parametrize("method", [NONE, MTP])
def test_a_sampled_tokens_logprob_is_its_own(engine: Engine, method: str) -> None:
    """A sampled token's log-probability is its own, not its row's argmax's: drawn from its
    row's 20 most probable (top_k 20), it has the value listed for it among them."""
    sampling = SamplingParams(temperature=1.5, top_k=20, seed=3)
    (out,) = _serve(engine, [_asking(method, 20, 24, sampling=sampling)])
    rows = zip(out.tokens, out.logprobs, out.top_ids, out.top_logprobs, strict=True)
    assert len(out.tokens) == 24 and out.finish is not None
    # A kept draft's log-probability is its row's of the next row's token, the bonus's a draw's.
    assert method == NONE or out.finish.stats.accepted > 0
    for t, lp, ids, values in rows:
        assert lp == pytest.approx(values[ids.index(t)], abs=LOGPROB_ATOL)
    assert any(t != ids[0] for t, ids in zip(out.tokens, out.top_ids, strict=True))
