"""The whole model under `triton` against `eager`, its batch invariance byte for byte, the
forward over gRPC, and the circuit diff on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from control_plane.circuit.report import run_diff
from control_plane.replicas.client import GrpcModel
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.model import InvalidArgument
from tests.conftest import random_tokens
from tests.control_plane.circuit.test_verify_batch import args
from tests.gpu_service.test_batch_invariance import _batched_run
from tests.steps import logit_rows

# Slow: whole forwards under the Triton interpreter.
pytestmark = pytest.mark.slow

# fp32 logits of the tiny model: kernels reassociate sums (online softmax, chunked GDN).
ATOL = 5e-4


def _floats(model) -> np.ndarray:
    lg = model.read_logits()
    return np.frombuffer(lg.data, dtype=np.float32).reshape(lg.shape)


def _session(engine: Engine, forward: str, prompts: list[list[int]], drafts: list[list[int]]):
    """Prefill, a ragged verify, its fold and commit, a propose, then a decode: each step's
    logits and argmaxes."""
    engine.set_forward(forward)
    seqs = [engine.alloc_sequence() for _ in prompts]
    out = {"prefill": (engine.prefill(seqs, prompts).argmax, _floats(engine))}
    rows = [[out["prefill"][0][i], *drafts[i]] for i in range(len(seqs))]
    ks = [len(r) for r in rows]
    argmax = engine.decode_verify_batched([t for r in rows for t in r], ks, seqs).argmax
    out["verify"] = (argmax, _floats(engine))
    offs = np.cumsum([0, *ks])[:-1].tolist()
    engine.stash_verify_hidden_rows([o + 1 for o in offs])
    engine.gdn_fold_accepted(seqs, [2] * len(seqs))
    engine.commit_accepted_prefix(seqs, [2] * len(seqs), ks)
    last = [argmax[o + 1] for o in offs]
    proposal = engine.run_mtp_propose_batched(last, list(range(len(seqs))), 2, seqs)
    out["propose"] = (proposal.drafts, _floats(engine))
    engine.trim_proposer_state(seqs)
    out["decode"] = (
        engine.decode_verify_batched(last, [1] * len(seqs), seqs).argmax,
        _floats(engine),
    )
    for s in seqs:
        engine.free_sequence(s)
    engine.set_forward("eager")
    return out


def test_triton_model_matches_eager(tiny_dir, rng: torch.Generator) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256))
    prompts = [random_tokens(rng, n) for n in (3, 21, 40)]
    drafts = [random_tokens(rng, k) for k in (3, 1, 2)]
    eager = _session(engine, "eager", prompts, drafts)
    triton = _session(engine, "triton", prompts, drafts)
    for phase in ("prefill", "verify", "propose", "decode"):
        np.testing.assert_allclose(
            triton[phase][1], eager[phase][1], atol=ATOL, rtol=0, err_msg=phase
        )
        agree = np.mean(np.argmax(triton[phase][1], -1) == np.argmax(eager[phase][1], -1))
        assert agree == 1.0, f"{phase}: argmax agreement {agree}"
        assert triton[phase][0] == eager[phase][0], phase


@pytest.mark.parametrize(
    ("ks", "spare_at"), [([4, 4], None), ([4, 1, 3], 1)], ids=["uniform-k4", "ragged-fragmented"]
)
def test_triton_batch_equals_serial(
    tiny_dir, rng: torch.Generator, ks: list[int], spare_at: int | None
) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256))
    prompts = [random_tokens(rng, 3 + 5 * i) for i in range(len(ks))]
    batched = _batched_run(engine, prompts, ks, "triton", 5, spare_at)
    serial = _batched_run(engine, prompts, ks, "triton-serial", 5, spare_at)
    assert batched[0] == serial[0], "prefill logits differ between batched and serial"
    for step, (b, s) in enumerate(zip(batched[1], serial[1], strict=True)):
        assert b == s, f"step {step}: the Triton batch differs from each sequence alone"


def test_triton_over_grpc(client: GrpcModel, tiny_dir) -> None:
    caps = client.capabilities()
    assert caps.forwards == ("eager", "eager-serial", "triton", "triton-serial")
    with pytest.raises(InvalidArgument, match="unknown forward"):
        client.set_forward("cuda")
    local = Engine(tiny_dir, ServiceConfig(verify_tiers="2:3,2:2,4:1", max_context=256))
    results = []
    for model in (client, local):
        model.set_forward("triton")
        seq = model.alloc_sequence()
        first = model.prefill([seq], [[5, 6, 7]]).argmax
        model.decode_verify_batched([first[0], 9, 10], [3], [seq])
        results.append((first, logit_rows(model), model.capabilities().current_forward))
        model.free_sequence(seq)
        model.set_forward("eager")
    assert results[0] == results[1] and results[0][2] == "triton"


def test_circuit_diff_on_triton(tiny_dir) -> None:
    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256))
    flags = ["--widths", "2", "--ks", "3,2", "--steps", "2"]
    same = run_diff(engine, args(*flags, "--reference", "triton", "--forwards", "triton-serial"))
    assert same["verdict"] == "PASS", same["reasons"]
    drift = run_diff(engine, args(*flags, "--reference", "eager", "--forwards", "triton"))
    for shape in drift["shapes"]:
        (c,) = shape["comparisons"]
        assert c["max_abs_diff"] > 0 and c["max_ulp"] > 0
        assert 0.9 <= c["argmax_agreement"] <= 1.0
    assert drift["verdict"] == "FAIL" and "triton: prefill equal False" in drift["reasons"][0]


def test_triton_write_on_accept_values_agree(tiny_dir, rng: torch.Generator) -> None:
    """The live-advancing verify (write_on_accept false) folds back to the same state."""
    from tests.steps import verify

    engine = Engine(tiny_dir, ServiceConfig(verify_tiers="4:3", max_context=256))
    engine.set_forward("triton")
    prompt, drafts = random_tokens(rng, 9), random_tokens(rng, 6)
    runs = []
    for woa in (True, False):
        seq = engine.alloc_sequence()
        last = engine.prefill([seq], [prompt]).argmax[0]
        logits = []
        for step in range(2):
            rows = [last, *drafts[3 * step : 3 * step + 3]]
            out, got = verify(engine, [seq], [rows], [2], woa)
            last = out[1]
            logits.append(got)
        runs.append(logits)
        engine.free_sequence(seq)
    assert runs[0] == runs[1]
