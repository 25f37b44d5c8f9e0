"""Expert parallelism (`--expert-parallel`) over gloo ranks on the CPU: which experts each rank
holds and what is refused; a row's routed sum byte for byte one device's whatever its batch and
whichever rank computed its experts; a Qwen3.5-MoE checkpoint written by transformers' own class
(and its FP8 form by `met quantize`) served at TP 2 and TP 4 with the experts placed: one
device's greedy tokens for `none`, `mtp` and (at TP 2) `dflash`, and the circuit diff PASSes."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from control_plane.circuit.report import run_diff
from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from control_plane.text.tokenizer import ByteTokenizer
from gpu_service.engine.facade import Engine
from gpu_service.engine.ranks import Launch, launch
from gpu_service.model import shard
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.placement import placed_moe
from gpu_service.model.weights import weight_shapes
from gpu_service.tp.group import Rendezvous, TpGroup
from kernels.fp8.naive import BlockFp8, quantize_blocks
from kernels.moe.naive import routed_moe
from met.main import main as met
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from protos.params import DFLASH, MTP, NONE
from tests.collect import run_all
from tests.control_plane.circuit.test_verify_batch import args as diff_args
from tests.flagship import MINI_FLAGSHIP
from tests.gpu_service.dflash.drafter import write_drafter
from tests.gpu_service.tp.test_tensor_parallel import _diff_passes, killed_rank_ends_the_stream
from tests.qwen3_5_checkpoint import TEXT, make

SERVICE = ServiceConfig(verify_tiers="4:3,4:2", max_context=256, prefix_snapshots=2)
TOK = ByteTokenizer.default()
# The Qwen3.5-MoE test model at the widths whose TP 4 splits fall on whole 128 x 128 FP8
# blocks (a rank's 2 q heads of 64 with their gates, its GDN key head and value head of 128,
# a quarter of the 512-wide shared expert); 8 experts of 128, 2 routed: 2 a rank at TP 4.
EP_TEXT = dict(
    hidden_size=128,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=64,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=512,
    rope_parameters={**TEXT["rope_parameters"], "mrope_section": [3, 3, 2]},
)


# -- what each rank holds ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [2, 4])
def test_each_expert_is_held_whole_by_one_rank_in_id_order(size: int) -> None:
    """Rank r holds experts [r E/N, (r + 1) E/N) whole and none of the others' tensors; its
    config keeps the experts' width and the router's count; everything else splits as TP."""
    cfg = MINI_FLAGSHIP
    held = shard.rank_config(cfg, size, experts=True)
    assert held.moe_intermediate_size == cfg.moe_intermediate_size
    assert held.num_experts == cfg.num_experts
    assert held.num_attention_heads == shard.rank_config(cfg, size).num_attention_heads
    owners: dict[int, list[int]] = {}
    for r in range(size):
        rank = shard.Shard(r, size, experts=True)
        ids = shard.expert_range(cfg.num_experts, rank)
        for name, shape in weight_shapes(cfg).items():
            expert = shard.expert_of(name)
            assert shard.holds(cfg, rank, name) == (expert is None or expert in ids), name
            if expert is not None and expert in ids:
                assert shard.part(cfg, rank, name, shape) is None, name  # whole
                owners.setdefault(expert, []).append(r)
    assert sorted(owners) == list(range(cfg.num_experts))
    per = cfg.num_experts // size
    assert all(set(rs) == {e // per} for e, rs in owners.items())


def test_what_cannot_be_placed_is_refused_by_name() -> None:
    for cfg, size, says in [
        (MINI_FLAGSHIP, 3, r"does not divide num_experts \(128\)"),
        (MINI_FLAGSHIP, 1, "which is 1; give it 2 or more"),
        (ModelConfig(), 2, "the model has no routed experts"),
    ]:
        with pytest.raises(ValueError, match=says):
            shard.rank_config(cfg, size, experts=True)


# -- a row's bytes ----------------------------------------------------------------------------


def _on_ranks(size: int, run) -> list[torch.Tensor]:
    """`run(group)` on `size` gloo ranks placing the experts, each a thread of this process ->
    their results."""
    store = TpGroup.host_store(size)
    out: list[torch.Tensor] = [torch.empty(0)] * size

    def rank(r: int) -> None:
        meet = Rendezvous("127.0.0.1", store.port, size)
        cpu, given = torch.device("cpu"), store if r == 0 else None
        out[r] = run(TpGroup(r, meet, cpu, store=given, expert_parallel=True))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _experts(num: int, hidden: int, inner: int, fp8: bool) -> tuple:
    gen = torch.Generator().manual_seed(5)
    w13 = torch.randn(num, hidden, 2 * inner, generator=gen) / hidden**0.5
    w2 = torch.randn(num, inner, hidden, generator=gen) / inner**0.5
    if not fp8:
        return w13.bfloat16(), w2.bfloat16()
    return tuple(_fp8_stack(w) for w in (w13, w2))


def _fp8_stack(w: torch.Tensor) -> BlockFp8:
    """[E, K, N] -> block FP8, each expert's [K, N] quantized in 128 x 128 blocks."""
    parts = [quantize_blocks(e.t().contiguous()) for e in w]
    weight = torch.stack([q.t().contiguous() for q, _ in parts])
    scales = torch.stack([s.t().contiguous() for _, s in parts])
    groups = torch.arange(w.shape[2], dtype=torch.int32) // 128
    return BlockFp8(weight, scales, groups)


def _held(w: torch.Tensor | BlockFp8, ids: range) -> torch.Tensor | BlockFp8:
    if isinstance(w, BlockFp8):
        return BlockFp8(w.weight[ids.start : ids.stop], w.scales[ids.start : ids.stop], w.groups)
    return w[ids.start : ids.stop].contiguous()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_rows_bytes_follow_neither_its_batch_nor_the_placement(fp8: bool) -> None:
    """Row 0 routed to experts 1 and 6 in batches of 4, 8 and 12 rows whose other rows route to
    other experts, and to its own; at TP 2 and TP 4 (its two experts on different ranks, its sum
    added up by different ranks): every time one device's bytes, the same in every batch."""
    num, hidden, inner = 8, 256, 128
    w13, w2 = _experts(num, hidden, inner, fp8)
    x = torch.randn(12, hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
    weights = torch.softmax(torch.randn(12, 2, generator=torch.Generator().manual_seed(3)), -1)
    batches = [
        [[1, 6], [0, 2], [0, 2], [3, 7]],
        [[1, 6], [2, 3], [4, 5], [3, 4], [0, 2], [2, 3], [4, 7], [0, 5]],
        [[1, 6]] * 4 + [[0, 7]] * 8,
    ]
    firsts = []
    for rows in batches:
        experts = torch.tensor(rows)
        xs, ws = x[: len(rows)], weights[: len(rows)].bfloat16()
        one = routed_moe(xs, w13, w2, experts, ws)
        firsts.append(one[0])
        for size in (2, 4):
            per = num // size

            def run(group: TpGroup, experts=experts, xs=xs, ws=ws, per=per) -> torch.Tensor:
                ids = range(group.rank * per, (group.rank + 1) * per)
                w = (_held(w13, ids), _held(w2, ids))
                return placed_moe(routed_moe, xs, *w, experts, ws, ids, group)

            for got in _on_ranks(size, run):
                assert torch.equal(got, one), (rows, size)
    assert all(torch.equal(f, firsts[0]) for f in firsts)


# -- a Qwen3.5-MoE checkpoint over ranks --------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    src = tmp_path_factory.mktemp("ep") / "bf16"
    make(src, "moe", EP_TEXT)
    met(["quantize", "--fp8-block", "128", str(src), str(src.parent / "fp8")])
    drafter = write_drafter(src.parent / "dflash", ModelConfig.load(src), taps=(1, 2), scale=0.2)
    return {"bf16": src, "fp8": src.parent / "fp8", "dflash": drafter}


PROMPTS = [tuple(range(40, 63)), tuple(b"def add(a, b):\n    return a + b\n" * 2)]
NEW_TOKENS = 12


def _serve(engine: Engine, methods: tuple[str, ...]) -> dict[str, list[list[int]]]:
    """Each method's greedy tokens of PROMPTS, every request served together."""
    reqs = [
        GenRequest(f"{m}{i}", p, NEW_TOKENS, ignore_eos=True, method=m)
        for m in methods
        for i, p in enumerate(PROMPTS)
    ]
    s = Scheduler(lambda: engine, TOK, SchedulerOptions(max_queue=len(reqs)), Env())
    s.start()
    try:
        outs = run_all(s, reqs)
    finally:
        s.stop()
    assert all(o.finish is not None for o in outs), [o.error for o in outs]
    pairs = list(zip(reqs, outs, strict=True))
    return {m: [o.tokens for r, o in pairs if r.method == m] for m in methods}


@pytest.fixture(scope="module")
def one_device(checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    """One device's greedy tokens of each checkpoint (`none`)."""
    out = {}
    for kind in ("bf16", "fp8"):
        engine = Engine(checkpoints[kind], SERVICE, "fp32")
        engine.set_forward("eager")
        out[kind] = _serve(engine, (NONE,))[NONE]
    return out


# (checkpoint, ranks, a drafter beside, the circuit diff): TP 4, whose collectives wait on
# four processes sharing the CPU, runs the greedy streams alone. TP 2 of FP8 is served through
# both processes, where the diff runs too (`test_through_the_pair_and_a_killed_rank`), and TP 4
# of bf16 (`test_tp4_bf16_through_the_pair`).
CASES = {"bf16-2": ("bf16", 2, True, True), "fp8-4": ("fp8", 4, False, False)}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_the_circuit_diff_under_ep(
    checkpoints: dict[str, Path], one_device: dict[str, list[list[int]]], case: str
) -> None:
    """TP N with the experts placed: `none` and `mtp` (and `dflash` with a drafter beside)
    stream one device's greedy tokens; the circuit diff PASSes: every batch's rows byte for
    byte those of each sequence verified alone, the MTP head's proposals too."""
    kind, size, dflash, diff = CASES[case]
    drafter = checkpoints["dflash"] if dflash else None
    faults: list[str] = []
    spec = Launch(checkpoints[kind], SERVICE, "fp32", "cpu", size, drafter=drafter)
    engine = launch(replace(spec, expert_parallel=True), on_fault=faults.append)
    try:
        engine.set_forward("eager")
        got = _serve(engine, (NONE, MTP, DFLASH) if dflash else (NONE, MTP))
        assert got == dict.fromkeys(got, one_device[kind])
        if diff:
            flags = ("--widths", "3", "--ks", "2,3", "--steps", "2", "--fragment", "--mtp")
            report = run_diff(engine, diff_args(*flags))
            assert report["verdict"] == "PASS", report["reasons"]
    finally:
        engine.close()
    assert not faults


def _generate(stub: pb_grpc.GenerationServiceStub, prompt: tuple[int, ...], method: int) -> tuple:
    tokens, drafted = [], 0
    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        max_new_tokens=NEW_TOKENS,
        ignore_eos=True,
        speculative_method=method,
    )
    for msg in stub.Generate(request, timeout=120):
        tokens += msg.token_ids
        drafted = msg.speculative_stats.drafted
    return tokens, drafted


def _start(checkpoint: Path, size: int):
    """`met gpu-service serve --tp SIZE --expert-parallel` on `checkpoint`, small."""
    return start_gpu_service(
        checkpoint,
        *("--tp", str(size), "--expert-parallel", "--dtype", "fp32"),
        *("--verify-tiers", "4:3,4:1", "--max-context", "256"),
    )


def _one_devices_tokens(stub: pb_grpc.GenerationServiceStub, expected: list[list[int]]) -> None:
    """`mtp` (drafting) and `none` stream one device's greedy tokens of PROMPTS."""
    mtp = [_generate(stub, p, pb.SPECULATIVE_METHOD_MTP) for p in PROMPTS]
    none = [_generate(stub, p, pb.SPECULATIVE_METHOD_NONE) for p in PROMPTS]
    assert [t for t, _ in mtp] == [t for t, _ in none] == expected
    assert sum(d for _, d in mtp) > 0


# Slow: starts a service with a rank process, and a control plane.
@pytest.mark.slow
def test_through_the_pair_and_a_killed_rank(
    checkpoints: dict[str, Path], one_device: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    """`met gpu-service serve --tp 2 --expert-parallel` on the FP8 checkpoint and a control
    plane, over gRPC: `mtp` and `none` stream one device's greedy tokens, and
    `met circuit diff --verify-batch` PASSes against the service; then rank 1 is killed while a
    stream is under way: the service exits non-zero and the stream ends UNAVAILABLE."""
    gpu, target = _start(checkpoints["fp8"], 2)
    try:
        cp, cp_target = start_control_plane(target)
        try:
            with grpc.insecure_channel(cp_target) as channel:
                stub = pb_grpc.GenerationServiceStub(channel)
                _one_devices_tokens(stub, one_device["fp8"])
                _diff_passes(target, tmp_path / "diff.json")
                request = pb.GenerateRequest(
                    prompt_token_ids=PROMPTS[0], max_new_tokens=200, ignore_eos=True
                )
                killed_rank_ends_the_stream(stub, gpu, request)
        finally:
            stop(cp)
    finally:
        if gpu.poll() is None:
            assert stop(gpu) == 0


# Slow: starts a service with three rank processes, and a control plane.
@pytest.mark.slow
def test_tp4_bf16_through_the_pair(
    checkpoints: dict[str, Path], one_device: dict[str, list[list[int]]]
) -> None:
    """`--tp 4 --expert-parallel` on the bf16 checkpoint (an expert in four per rank) through
    both processes: `mtp` and `none` stream one device's greedy tokens."""
    gpu, target = _start(checkpoints["bf16"], 4)
    try:
        cp, cp_target = start_control_plane(target)
        try:
            with grpc.insecure_channel(cp_target) as channel:
                _one_devices_tokens(pb_grpc.GenerationServiceStub(channel), one_device["bf16"])
        finally:
            stop(cp)
    finally:
        assert stop(gpu) == 0
