"""The flagship in miniature (tests/flagship.py: Qwen3-Next-80B-A3B's structure at a small
width, 128 experts with 10 routed): its routed experts give the bytes of the dense sum over
every expert, greedy `mtp` equals `none` through both real processes, and the circuit diff
PASSes on the eager and the triton forward."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.control_plane.circuit.test_verify_batch import args
from tests.flagship import MINI_FLAGSHIP
from tests.steps import logit_rows
from tools.moe_bench import DenseOps
from training.checkpoint import init_model

SERVICE = ServiceConfig(verify_tiers="4:3,4:1", max_context=256, max_rows=24, max_batch=8)


def _logit_bytes(engine: Engine, prompts: list[list[int]]) -> list[bytes]:
    """Prefill two sequences, then verify three rows of each: every logits row read back."""
    seqs = [engine.alloc_sequence() for _ in prompts]
    engine.prefill(seqs, prompts)
    rows = logit_rows(engine)
    engine.decode_verify_batched([5, 6, 7, 8, 9, 10], [3, 3], seqs)
    return rows + logit_rows(engine)


@pytest.fixture(scope="module")
def other_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another MoE shape: no shared expert, weights not renormalised, every other layer sparse."""
    cfg = replace(
        MINI_FLAGSHIP,
        num_experts=12,
        num_experts_per_tok=3,
        shared_expert_intermediate_size=0,
        norm_topk_prob=False,
        decoder_sparse_step=2,
    )
    directory = tmp_path_factory.mktemp("moe-sparse-step")
    init_model(directory, cfg, seed=9)
    return directory


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("model", ["mini-flagship", "sparse-step"])
def test_routed_experts_give_the_dense_bytes(
    mini_dir: Path, other_moe_dir: Path, model: str, dtype: str
) -> None:
    directory = mini_dir if model == "mini-flagship" else other_moe_dir
    prompts = [list(range(40, 53)), list(range(90, 97))]
    routed = Engine(directory, SERVICE, dtype)
    dense = Engine(directory, SERVICE, dtype)
    dense.model.ops = dense.choice.ops = DenseOps()
    got, expected = _logit_bytes(routed, prompts), _logit_bytes(dense, prompts)
    assert len(got) == 2 + 6
    assert got == expected


def test_a_rows_bytes_do_not_depend_on_its_batch(mini_dir: Path) -> None:
    """Routing groups rows by expert: a sequence verified alone and beside another reads the
    same bytes."""
    alone = Engine(mini_dir, SERVICE, "bf16")
    seq = alone.alloc_sequence()
    alone.prefill([seq], [list(range(40, 53))])
    alone.decode_verify_batched([5, 6, 7], [3], [seq])
    expected = logit_rows(alone)
    together = Engine(mini_dir, SERVICE, "bf16")
    seqs = [together.alloc_sequence() for _ in range(2)]
    together.prefill(seqs, [list(range(40, 53)), list(range(100, 120))])
    together.decode_verify_batched([5, 6, 7, 200, 201, 202, 203], [3, 4], seqs)
    assert logit_rows(together)[:3] == expected


def _generate(stub: pb_grpc.GenerationServiceStub, prompt: list[int], method: int) -> tuple:
    tokens, last = [], pb.GenerateResponse()
    request = pb.GenerateRequest(
        prompt_token_ids=prompt, max_new_tokens=16, ignore_eos=True, speculative_method=method
    )
    for msg in stub.Generate(request, timeout=120):
        tokens += msg.token_ids
        last = msg
    return tokens, last.speculative_stats.drafted


# Slow: starts both processes on the miniature flagship.
@pytest.mark.slow
def test_mtp_equals_none_through_both_processes(mini_dir: Path) -> None:
    assert_mtp_equals_none(mini_dir)


def assert_mtp_equals_none(directory: Path) -> None:
    """Greedy `mtp` and `none` stream the same tokens from `directory` through a GPU service
    and a control plane, the drafter drafting."""
    gpu, target = start_gpu_service(
        directory, "--verify-tiers", "4:3,4:1", "--max-context", "256", "--dtype", "bf16"
    )
    try:
        cp, cp_target = start_control_plane(target)
        try:
            with grpc.insecure_channel(cp_target) as channel:
                stub = pb_grpc.GenerationServiceStub(channel)
                prompts = [list(range(30, 30 + n)) for n in (5, 17, 40)]
                mtp = [_generate(stub, p, pb.SPECULATIVE_METHOD_MTP) for p in prompts]
                none = [_generate(stub, p, pb.SPECULATIVE_METHOD_NONE) for p in prompts]
        finally:
            assert stop(cp) == 0
    finally:
        assert stop(gpu) == 0
    assert [t for t, _ in mtp] == [t for t, _ in none]
    assert all(len(t) == 16 for t, _ in mtp)
    assert sum(d for _, d in mtp) > 0 and sum(d for _, d in none) == 0


# Interpreted, the triton forward's GDN kernels take a second a call: its diff runs one shape,
# two sequences of three rows (with the detection control's corrupted steps), in 45 s.
DIFF_FLAGS = {
    "eager": ["--widths", "2,3", "--ks", "2,3,4", "--steps", "3"],
    "triton": ["--widths", "2", "--ks", "3", "--steps", "2"],
}


# Slow: verify batches through a forward and its serial form (the triton one interpreted).
@pytest.mark.slow
@pytest.mark.parametrize("forward", ["eager", "triton"])
def test_circuit_diff_passes(mini_dir: Path, forward: str) -> None:
    """With the drafter: every step's verify logits, and the propose's logits, drafts and
    confidences."""
    from control_plane.circuit.report import run_diff

    engine = Engine(mini_dir, SERVICE, "bf16")
    flags = [*DIFF_FLAGS[forward], "--reference", forward, "--forwards", f"{forward}-serial"]
    report = run_diff(engine, args(*flags, "--mtp"))
    assert report["verdict"] == "PASS", report["reasons"]
    assert all(s["detection_control"]["mismatched_steps"] > 0 for s in report["shapes"])
    assert engine.capabilities().free_slots == SERVICE.num_slots
