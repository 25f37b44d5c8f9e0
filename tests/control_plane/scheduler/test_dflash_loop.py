"""Requests with method dflash through the scheduler and an in-process engine with a DFlash
drafter: greedy output equals `none` token for token (alone, 16 at once, with penalties and a
grammar, mixed with mtp requests), and sampled output keeps the target's distribution."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.grammar import GrammarCompiler
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.model.config import DFLASH_VERIFY_TIERS, ModelConfig, ServiceConfig
from protos.defaults import DEFAULT_MODEL_DIR, DRAFTER_DIR
from protos.model import Penalties
from protos.params import DFLASH, MTP, NONE
from tests.collect import run_all
from tests.gpu_service.dflash.drafter import write_drafter
from tools.bench.workload import Workload

TOK = ByteTokenizer.default()


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The bundled model and its trained drafter: drafts that stand, fall, and stand in part."""
    svc = ServiceConfig(verify_tiers=DFLASH_VERIFY_TIERS, max_context=256)
    return Engine(DEFAULT_MODEL_DIR, svc, drafter=DEFAULT_MODEL_DIR / DRAFTER_DIR)


def _requests(method: str, n: int, seed: int = 0, **extra) -> list[GenRequest]:
    """The bundled model's held-out prompts (code its drafter can follow), cut at random."""
    rng = random.Random(seed)
    prompts = Workload(DEFAULT_MODEL_DIR).prompts
    out = []
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        prompt = prompt[: rng.randint(min(len(prompt), 40), len(prompt))]
        out.append(GenRequest(f"r{i}", prompt, rng.randint(8, 24), method=method, **extra))
    return out


def _serve(engine: Engine, reqs: list[GenRequest]) -> list[list[int]]:
    """Each request's tokens; the dflash ones must have drafted (so the verify judged), but for
    a grammar's, whose drafts the grammar may cut to none."""
    s = Scheduler(lambda: engine, TOK, SchedulerOptions(max_queue=len(reqs)), Env())
    s.start()
    try:
        outs = run_all(s, reqs, timeout=600)
    finally:
        s.stop()
    assert all(o.finish is not None for o in outs), [o.error for o in outs]
    stats = [
        o.finish.stats
        for o, r in zip(outs, reqs, strict=True)
        if r.method == DFLASH and r.grammar is None
    ]
    assert all(s.drafted > 0 for s in stats), [s.drafted for s in stats]
    if stats:
        assert sum(s.accepted for s in stats) > 0, "no draft stood: partial accepts went untried"
    return [o.tokens for o in outs]


@pytest.mark.parametrize("n", [1, 16])
def test_greedy_dflash_equals_none(engine: Engine, n: int) -> None:
    assert _serve(engine, _requests(DFLASH, n)) == _serve(engine, _requests(NONE, n))


def test_penalties_a_grammar_and_mtp_beside(engine: Engine) -> None:
    caps = engine.capabilities()
    compiler = GrammarCompiler(TOK, caps.vocab_size, caps.eos_token_ids)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})

    def reqs(method: str) -> list[GenRequest]:
        out = _requests(method, 6, seed=3, penalties=Penalties(repetition=1.3, presence=0.5))
        out[1] = GenRequest(
            "g", (65, 66), 20, method=method, grammar=compiler.compile("json_schema", schema)
        )
        out[4] = GenRequest("m", (70, 71, 72), 16, method=MTP if method == DFLASH else NONE)
        return out

    assert _serve(engine, reqs(DFLASH)) == _serve(engine, reqs(NONE))


def test_sampled_dflash_keeps_the_targets_distribution(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Seeded sampled requests: a seed replays, and the tokens the DFlash verifies choose
    (rejection sampling against the drafter's q) are distributed as plain sampling's (the
    chi-square test of the MTP head's)."""
    from tests.gpu_service.test_sampling import _chi_square, _first_tokens

    target = ModelConfig.load(tiny_dir)
    drafter = write_drafter(
        tmp_path_factory.mktemp("dflash"), target, taps=(0, target.num_hidden_layers - 1)
    )
    engine = Engine(
        tiny_dir, ServiceConfig(verify_tiers="8:3,8:2", max_context=256), drafter=drafter
    )
    n = 240
    spec, plain = _first_tokens(engine, DFLASH, n), _first_tokens(engine, NONE, n)
    assert _first_tokens(engine, DFLASH, n) == spec, "a seed gives the same tokens"
    for position in (2, 3):
        stat, df, critical = _chi_square([t[position] for t in spec], [t[position] for t in plain])
        assert stat < critical, f"position {position}: chi-square {stat:.1f} on {df} df"
