"""Penalties and logit bias: each row the service judges gets vLLM's penalties over the tokens
before it (drafts included), so speculation keeps the output of one token at a time; checked
against a plain reference of the formula, against transformers' repetition penalty, through
the scheduler for every method, and refused with a sentence when out of range."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path

import grpc
import pytest
import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from control_plane.cli import generate
from control_plane.scheduler.seq import GenRequest
from gpu_service.engine.facade import Engine
from gpu_service.engine.penalties import penalize
from gpu_service.memory.sequence import SeqState
from gpu_service.model.config import ServiceConfig
from met.main import build_parser
from protos.convert import penalties_from_pb
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import model_pb2 as model_pb
from protos.met.v1.model_pb2 import AllocSequenceRequest
from protos.model import InvalidArgument, Penalties
from protos.params import MTP, NONE, PROMPT_LOOKUP, SamplingParams
from tests.collect import run_all, serving
from tests.conftest import TINY_SERVICE, random_tokens
from tests.hf_checkpoint import BASE
from tests.steps import decode, logit_rows, verify

# Values exact in fp32, so that the reference's arithmetic rounds as the service's.
PEN = dict(presence=0.5, frequency=0.25, repetition=1.25, bias_ids=(5, 17), bias_values=(2.5, -1.5))
# The service adds, divides and subtracts in the reference's order, on the same fp32 logits.
ATOL = 1e-6


def reference(
    row: torch.Tensor, prompt: list[int], output: list[int], pen: Penalties
) -> torch.Tensor:
    """vLLM's penalties, written out token by token: the bias, then the repetition penalty
    over every token of prompt or output, then frequency and presence over the output."""
    x = row.float().clone()
    for t, b in zip(pen.bias_ids, pen.bias_values, strict=True):
        x[t] += b
    if pen.repetition != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / pen.repetition if x[t] > 0 else x[t] * pen.repetition
    for t, c in Counter(output).items():
        x[t] = x[t] - pen.frequency * c - pen.presence
    return x


def rows_of(raw: list[bytes]) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(r), dtype=torch.float32) for r in raw]


def test_prefill_and_verify_rows_are_the_formula(engine: Engine, rng: torch.Generator) -> None:
    """Row j of a verify predicts the token after prompt + output + drafts[: j]; its logits are
    the unpenalized row's (the same forward) with the formula over exactly those tokens."""
    prompt = random_tokens(rng, 37, vocab=40)  # a small range, so tokens repeat
    pen = Penalties(prompt_tokens=len(prompt), **PEN)
    plain, held = engine.alloc_sequence(), engine.alloc_sequence(pen)
    firsts = engine.prefill([plain, held], [prompt, prompt]).argmax
    base, got = rows_of(logit_rows(engine))
    torch.testing.assert_close(got, reference(base, prompt, [], pen), atol=ATOL, rtol=0)
    assert firsts[1] == int(reference(base, prompt, [], pen).argmax())
    assert not torch.equal(got, base), "the penalties changed nothing"

    drafts = [prompt[3], prompt[3], 5, firsts[1]]  # repeats: counts above one
    rows = [firsts[1], *drafts[:3]]
    argmax, raw = verify(engine, [plain, held], [rows, rows], [4, 4])
    out = rows_of(raw)
    for j in range(4):
        want = reference(out[j], prompt, rows[: j + 1], pen)
        torch.testing.assert_close(out[4 + j], want, atol=ATOL, rtol=0)
        assert argmax[4 + j] == int(want.argmax())
    engine.free_sequence(plain)
    engine.free_sequence(held)


def test_a_chunked_prefill_counts_the_prompt_so_far(engine: Engine, rng: torch.Generator) -> None:
    """Each chunk's last row sees the prompt's tokens up to it, and only those."""
    prompt = random_tokens(rng, 30, vocab=40)
    pen = Penalties(prompt_tokens=len(prompt), **PEN)
    plain, held = engine.alloc_sequence(), engine.alloc_sequence(pen)
    for lo, hi in ((0, 17), (17, 30)):
        engine.prefill([plain, held], [prompt[lo:hi]] * 2)
        base, got = rows_of(logit_rows(engine))
        want = reference(base, prompt[:hi], [], pen)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    engine.free_sequence(plain)
    engine.free_sequence(held)


@pytest.mark.parametrize("held", [(0, 320), (100, 320), (0, 100)], ids=["all", "rank1", "rank0"])
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_both_ways_are_the_formula_call_after_call(
    rng: torch.Generator, dense: bool, held: tuple[int, int]
) -> None:
    """`penalize` over every column (the GPU's way) and over the seen ones (the CPU's), on any
    rank's columns: three sequences (one unpenalized) through two calls, the second after more
    tokens were committed, so the kept counts are brought up to date."""
    lo, hi = held
    kinds = [dict(PEN), dict(presence=-1.0, bias_ids=(150, 7), bias_values=(9.0, -3.0)), None]
    states, prompts = [], []
    for kind in kinds:
        prompt = random_tokens(rng, 12, vocab=320)
        pen = None if kind is None else Penalties(prompt_tokens=len(prompt), **kind)
        states.append(SeqState(len(states), len(states), tokens=list(prompt), penalties=pen))
        prompts.append(prompt)
    for _ in range(2):
        for s in states:
            s.tokens.extend(random_tokens(rng, 5, vocab=320))  # committed since the last call
        rows = [random_tokens(rng, k, vocab=320) for k in (3, 1, 2)]
        starts, before = [0, 3, 4], [s.seq_len for s in states]
        logits = torch.randn(6, 320, generator=rng)
        mine = logits[:, lo:hi].clone()
        penalize(mine, held, states, before, rows, starts, dense=dense)
        for s, new, start, prompt in zip(states, rows, starts, prompts, strict=True):
            for j in range(len(new)):
                r = start + j
                if s.penalties is None:
                    assert torch.equal(mine[r], logits[r, lo:hi])
                    continue
                output = s.tokens[len(prompt) :] + new[: j + 1]
                want = reference(logits[r], prompt, output, s.penalties)[lo:hi]
                torch.testing.assert_close(mine[r], want, atol=ATOL, rtol=0)


BAD = {
    "presence_penalty is 2.5; it must be from -2 to 2": dict(presence=2.5),
    "frequency_penalty is nan; it must be from -2 to 2": dict(frequency=math.nan),
    "repetition_penalty is -1.0; it must be from 0.01 to 100": dict(repetition=-1.0),
    # Just above 0, as vLLM's `> 0` takes it: logit / r would overflow every row to NaN.
    "repetition_penalty is 1e-45; it must be from 0.01 to 100": dict(repetition=1e-45),
    "logit_bias names token id 320, outside the vocabulary (0 .. 319)": dict(
        bias_ids=(320,), bias_values=(1.0,)
    ),
    "logit_bias of token 3 is 101.0; it must be from -100 to 100": dict(
        bias_ids=(3,), bias_values=(101.0,)
    ),
    "logit_bias has 2 token ids but 1 values": dict(bias_ids=(3, 4), bias_values=(1.0,)),
    "logit_bias names a token id more than once": dict(bias_ids=(3, 3), bias_values=(1.0, 2.0)),
}


@pytest.mark.parametrize("sentence", list(BAD))
def test_out_of_range_penalties_are_refused_and_allocate_nothing(
    engine: Engine, sentence: str
) -> None:
    free = engine.capabilities().free_slots
    with pytest.raises(InvalidArgument, match=sentence.replace("(", r"\(").replace(")", r"\)")):
        engine.alloc_sequence(Penalties(**BAD[sentence]))
    assert engine.capabilities().free_slots == free


def greedy_reference(engine: Engine, prompt: list[int], pen: Penalties, n: int) -> list[int]:
    """One token at a time on an unpenalized sequence, the formula applied to each row here."""
    seq = engine.alloc_sequence()
    engine.prefill([seq], [prompt])
    row, out = rows_of(logit_rows(engine))[0], []
    for _ in range(n):
        out.append(int(reference(row, prompt, out, pen).argmax()))
        row = rows_of([decode(engine, seq, out[-1])[1]])[0]
    engine.free_sequence(seq)
    return out


def test_every_method_gives_the_tokens_of_one_at_a_time(
    tiny_dir: Path, rng: torch.Generator
) -> None:
    """none, mtp and prompt lookup, pipelined or not, batched with an unpenalized request:
    the formula's greedy tokens, which differ from the unpenalized ones."""
    # The longer prompt spans a KV block, so the later methods restore it from the prefix cache.
    prompts = [random_tokens(rng, n, vocab=60) for n in (23, 90)]
    pens = [Penalties(prompt_tokens=len(p), **PEN) for p in prompts]
    want = [
        greedy_reference(Engine(tiny_dir, TINY_SERVICE), p, q, 24)
        for p, q in zip(prompts, pens, strict=True)
    ]

    def req(i: int, method: str, pen: Penalties | None) -> GenRequest:
        return GenRequest(
            f"{method}-{i}", tuple(prompts[i]), 24, ignore_eos=True, method=method, penalties=pen
        )

    with serving(tiny_dir, dataclasses.replace(TINY_SERVICE, prefix_snapshots=4)) as s:
        for method in (NONE, MTP, PROMPT_LOOKUP):
            reqs = [req(i, method, pens[i]) for i in range(2)] + [req(0, method, None)]
            got = run_all(s, reqs)
            for i in range(2):
                assert got[i].failure is None
                assert got[i].tokens == want[i], f"{method}: request {i} left the formula's tokens"
            assert got[2].tokens != want[0], "the penalties changed no token"
        assert s.snapshot()["counters"].prefix_hits > 0, "no prompt came from the cache"


def test_preempted_requests_keep_their_counts(tiny_dir: Path) -> None:
    """Four penalized requests in half the KV blocks they need: the preempted ones prefill
    their output again as context, and its tokens still count as output: every request makes
    the tokens it makes with every block it needs."""
    from tests.control_plane.scheduler.test_pressure import _all_finish, _prompt, _serving

    def four() -> list[GenRequest]:
        return [
            GenRequest(
                f"r{i}",
                _prompt(i, 100),
                120,
                ignore_eos=True,
                penalties=Penalties(prompt_tokens=100, **PEN),
            )
            for i in range(4)
        ]

    with _serving(tiny_dir, 0, False) as s:
        want = _all_finish(s, four())
    with _serving(tiny_dir, 8, False) as s:
        assert _all_finish(s, four()) == want
        assert s.snapshot()["counters"].preemptions > 0


def test_a_sampled_request_never_draws_a_banned_token(tiny_dir: Path, rng: torch.Generator) -> None:
    """A bias of -100 takes a token's probability to nothing: sampled drafts and the tokens
    the rejection test draws alike never hold it."""
    prompt = random_tokens(rng, 20, vocab=60)
    with serving(tiny_dir, TINY_SERVICE) as s:
        (free,) = run_all(
            s,
            [
                GenRequest(
                    "free", tuple(prompt), 32, ignore_eos=True, sampling=SamplingParams(0.7, seed=3)
                )
            ],
        )
        common = Counter(free.tokens).most_common(2)
        banned = tuple(sorted(t for t, _ in common))
        pen = Penalties(
            prompt_tokens=len(prompt), bias_ids=banned, bias_values=(-100.0,) * len(banned)
        )
        reqs = [
            GenRequest(
                f"b{seed}",
                tuple(prompt),
                32,
                ignore_eos=True,
                sampling=SamplingParams(0.7, seed=seed),
                penalties=pen,
            )
            for seed in range(3)
        ]
        for out in run_all(s, reqs):
            assert out.failure is None and len(out.tokens) == 32
            assert not set(banned) & set(out.tokens)


@pytest.mark.parametrize("method", [NONE, MTP, PROMPT_LOOKUP])
def test_allowed_ids_hold_every_token_greedy_and_sampled(
    tiny_dir: Path, rng: torch.Generator, method: str
) -> None:
    """vLLM's allowed_token_ids: whatever the method and the sampler, every token is one of
    them, drafts the target would not take included; without them the output leaves the set."""
    prompt = random_tokens(rng, 20, vocab=60)
    allowed = (3, 17, 40, 41)
    pen = Penalties(prompt_tokens=len(prompt), allowed_ids=allowed)
    samplers = [SamplingParams(), SamplingParams(0.9, seed=1)]
    with serving(tiny_dir, TINY_SERVICE) as s:
        reqs = [
            GenRequest(
                f"a{i}",
                tuple(prompt),
                24,
                ignore_eos=True,
                method=method,
                sampling=smp,
                penalties=pen,
            )
            for i, smp in enumerate(samplers)
        ]
        reqs.append(GenRequest("free", tuple(prompt), 24, ignore_eos=True, method=method))
        *held, free = run_all(s, reqs)
    for out in held:
        assert out.failure is None and len(out.tokens) == 24
        assert set(out.tokens) <= set(allowed), out.tokens
    assert not set(free.tokens) <= set(allowed), "the set binds nothing on this prompt"


def test_allowed_ids_outside_the_vocabulary_are_refused(engine: Engine) -> None:
    with pytest.raises(InvalidArgument, match="allowed_token_ids holds token id 320"):
        engine.alloc_sequence(Penalties(allowed_ids=(5, 320)))
    assert engine.slots.num_free == engine.svc.num_slots


def test_repetition_penalty_matches_transformers(tmp_path: Path) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor over prompt and output, greedy."""
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(**BASE, attn_implementation="eager")
    hf = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None
    seed = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # The prompt ends with the model's own greedy continuation, so that it repeats itself.
        prompt = hf.generate(seed[None], max_new_tokens=16, do_sample=False, pad_token_id=0)[0]
        n = len(prompt)
        expected = hf.generate(
            prompt[None], max_new_tokens=16, do_sample=False, repetition_penalty=2.0, pad_token_id=0
        )[0, n:].tolist()
        plain = hf.generate(prompt[None], max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert expected != plain[0, n:].tolist(), "the penalty changed no token"
    svc = ServiceConfig(verify_tiers="4:3", max_context=256)
    pen = Penalties(repetition=2.0, prompt_tokens=n)
    assert greedy_reference(Engine(tmp_path, svc), prompt.tolist(), pen, 16) == expected
    with serving(tmp_path, svc) as s:
        (out,) = run_all(
            s,
            [
                GenRequest(
                    "r", tuple(prompt.tolist()), 16, ignore_eos=True, method=NONE, penalties=pen
                )
            ],
        )
    assert out.tokens == expected


def test_the_api_takes_penalties_and_refuses_bad_ones(stub) -> None:
    """Over gRPC: a penalized request streams; an out-of-range one is INVALID_ARGUMENT with the
    sentence, and the service holds nothing for it."""
    ok = pb.GenerateRequest(
        prompt_token_ids=[7, 7, 9, 7],
        max_new_tokens=8,
        ignore_eos=True,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias={65: 3.0},
    )
    tokens = [t for m in stub.Generate(ok) for t in m.token_ids]
    assert len(tokens) == 8
    bad = pb.GenerateRequest(prompt="x", max_new_tokens=4, logit_bias={9999: 1.0})
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logit_bias names token id 9999, outside the vocabulary" in (e.value.details() or "")


def test_met_generate_sends_penalties() -> None:
    def request(*argv: str) -> pb.GenerateRequest:
        return generate.build_request(build_parser().parse_args(["generate", "hi", *argv]))

    r = request("--presence-penalty", "1", "--repetition-penalty", "1.2", "--logit-bias", "42:-100")
    assert (r.presence_penalty, r.frequency_penalty) == (1.0, 0.0)
    assert r.HasField("repetition_penalty") and r.repetition_penalty == pytest.approx(1.2)
    assert dict(r.logit_bias) == {42: -100.0}
    assert not request().HasField("repetition_penalty") and not request().logit_bias
    with pytest.raises(SystemExit):
        request("--logit-bias", "x:3")


def test_the_service_refuses_bad_penalties_over_grpc(client) -> None:
    """A `ModelService` client gets INVALID_ARGUMENT with the sentence and no sequence; a
    repetition left at 0 on the wire is none, as proto3 leaves an unset field."""
    free = client.capabilities().free_slots
    with pytest.raises(InvalidArgument, match="presence_penalty is 5.0; it must be from -2 to 2"):
        client.alloc_sequence(Penalties(presence=5.0))
    with pytest.raises(InvalidArgument, match="repetition_penalty is 1.4"):  # 1e-45 as fp32
        client.alloc_sequence(Penalties(repetition=1e-45))
    assert client.capabilities().free_slots == free
    bare = AllocSequenceRequest(penalties=model_pb.Penalties(presence=0.5, prompt_tokens=3))
    assert penalties_from_pb(bare) == Penalties(presence=0.5, prompt_tokens=3)
    seq = client.alloc_sequence(Penalties(frequency=0.5, prompt_tokens=3))
    assert client.prefill([seq], [[7, 7, 7]]).argmax[0] >= 0
    client.free_sequence(seq)
