"""Qwen3.5 / Qwen3.6, dense and MoE, tied and untied (tests/qwen3_5_checkpoint.py: written by
transformers' own classes, with a vision tower and an MTP layer): logits against transformers'
(prefill and decode), both expert layouts, greedy through both processes against transformers'
`generate`, `mtp` equal to `none`, the circuit diff on both forwards, the FP8 copy, TP 2 (a
prompt with images too: the tower whole on every rank), and YaRN past the original context for
both families. Prompts with images: tests/gpu_service/engine/test_images.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from transformers import PreTrainedModel, Qwen3NextConfig, Qwen3NextForCausalLM

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from gpu_service.engine.facade import Engine
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.hybrid import PREFILL, Segment
from gpu_service.model.ops import rope_table
from gpu_service.model.weights import checkpoint_index, vision_tensors
from kernels.fp8.naive import BlockFp8
from met.main import main as met
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tests.control_plane.circuit.test_verify_batch import args
from tests.gpu_service.model.test_flagship_mini import _generate
from tests.gpu_service.model.test_hf_parity import ATOL, RTOL
from tests.hf_checkpoint import BASE, greedy
from tests.qwen3_5_checkpoint import KINDS, make, stack_experts
from tests.steps import logit_rows

# Slow: transformers' Qwen3.5 models, both processes, TP ranks, the interpreted diff.
pytestmark = pytest.mark.slow

SERVICE = ServiceConfig(verify_tiers="4:3,4:1", max_context=256, max_rows=24, max_batch=8)
TOKENS = torch.randint(0, 500, (30,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture
def made(qwen3_5_made: dict) -> dict[str, tuple[Path, PreTrainedModel]]:
    return qwen3_5_made


def _rows(engine: Engine) -> torch.Tensor:
    return torch.stack(
        [torch.frombuffer(bytearray(r), dtype=torch.float32) for r in logit_rows(engine)]
    )


def _prefill_and_decode(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """Logits of every position: a prefill of the first 10 tokens (its last row), then verifies
    of widths 1..4, each folded and committed whole."""
    seq = engine.alloc_sequence()
    engine.prefill([seq], [tokens[:10]])
    out, pos = [_rows(engine)], 10
    for k in (1, 2, 3, 4, 4, 4, 2):
        engine.decode_verify_batched(tokens[pos : pos + k], [k], [seq])
        out.append(_rows(engine))
        engine.gdn_fold_accepted([seq], [k])
        engine.commit_accepted_prefix([seq], [k], [k])
        pos += k
    engine.free_sequence(seq)
    return torch.cat(out)


def _theirs(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_match_transformers(made: dict, kind: str) -> None:
    directory, model = made[kind]
    engine = Engine(directory, SERVICE, "fp32")
    assert engine.cfg.has_mtp and engine.cfg.tie_word_embeddings == kind.endswith("tied")
    assert vision_tensors(engine.cfg, checkpoint_index(directory)) and engine.model.vision
    tower = sum(p.numel() for n, p in model.named_parameters() if ".visual." in n)
    held = sum(t.numel() for t in engine.model.vision.held().values())
    assert engine.cfg.vision_params == tower == held > 0
    expected = _theirs(model, TOKENS)
    seq = engine.alloc_sequence()
    tokens = torch.tensor(TOKENS)
    hidden = engine.model.forward(tokens, [Segment(seq.slot, 0, 30, 0)], engine.state, PREFILL)
    prefill = engine.model.logits(hidden[:30])
    torch.testing.assert_close(prefill, expected, atol=ATOL, rtol=RTOL)
    engine.free_sequence(seq)
    decoded = _prefill_and_decode(engine, TOKENS)
    torch.testing.assert_close(decoded, expected[9:], atol=ATOL, rtol=RTOL)
    assert torch.equal(decoded.argmax(-1), expected[9:].argmax(-1))


def test_both_expert_layouts_load_to_the_same_logits(made: dict, tmp_path: Path) -> None:
    directory, _ = made["moe"]
    stack_experts(directory, tmp_path)
    assert any(n.endswith("experts.gate_up_proj") for n in checkpoint_index(tmp_path))
    per_expert = _prefill_and_decode(Engine(directory, SERVICE, "fp32"), TOKENS)
    stacked = _prefill_and_decode(Engine(tmp_path, SERVICE, "fp32"), TOKENS)
    assert torch.equal(per_expert, stacked)


@pytest.mark.parametrize("kind", ["dense-tied", "moe"])
def test_greedy_through_both_processes_is_transformers_and_mtp_is_none(
    made: dict, kind: str
) -> None:
    directory, model = made[kind]
    prompts = [TOKENS[:5], TOKENS[:17]]
    gpu, target = start_gpu_service(
        directory, "--verify-tiers", "4:3,4:1", "--max-context", "256", "--dtype", "fp32"
    )
    try:
        cp, cp_target = start_control_plane(target)
        try:
            with grpc.insecure_channel(cp_target) as channel:
                stub = pb_grpc.GenerationServiceStub(channel)
                none = [_generate(stub, p, pb.SPECULATIVE_METHOD_NONE) for p in prompts]
                mtp = [_generate(stub, p, pb.SPECULATIVE_METHOD_MTP) for p in prompts]
        finally:
            assert stop(cp) == 0
    finally:
        assert stop(gpu) == 0
    assert [t for t, _ in none] == [greedy(model, p, 16) for p in prompts]
    assert [t for t, _ in mtp] == [t for t, _ in none]
    assert sum(d for _, d in mtp) > 0 and sum(d for _, d in none) == 0


# Interpreted, the triton forward's kernels take about a second a call: one shape, on a
# two-layer dense model (one GDN layer, one attention layer; the routed experts' kernel is the
# flagship miniature's diff's).
TWO_LAYERS = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
DIFF_FLAGS = {
    "eager": ["--widths", "2,3", "--ks", "2,3,4", "--steps", "3"],
    "triton": ["--widths", "2", "--ks", "2", "--steps", "2"],
}


@pytest.mark.parametrize("forward", ["eager", "triton"])
def test_circuit_diff_passes(
    made: dict, forward: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from control_plane.circuit.report import run_diff

    if forward == "triton":
        directory = tmp_path_factory.mktemp("two-layers")
        make(directory, "dense-tied", TWO_LAYERS)
    else:
        directory = made["moe-tied"][0]
    # The attention kernel's programs grow with the context; the diff's sequences fit in 128.
    engine = Engine(directory, replace(SERVICE, max_context=128), "bf16")
    flags = [*DIFF_FLAGS[forward], "--reference", forward, "--forwards", f"{forward}-serial"]
    report = run_diff(engine, args(*flags, "--mtp"))
    assert report["verdict"] == "PASS", report["reasons"]
    assert all(s["detection_control"]["mismatched_steps"] > 0 for s in report["shapes"])


def _served_tokens(engine: Engine, method: str) -> tuple[list[list[int]], int]:
    from control_plane.scheduler.env import Env
    from control_plane.scheduler.scheduler import Scheduler
    from control_plane.scheduler.seq import GenRequest
    from control_plane.text.tokenizer import ByteTokenizer
    from tests.collect import run_all

    s = Scheduler(lambda: engine, ByteTokenizer.default(), env=Env())
    s.start()
    try:
        reqs = [GenRequest(f"{method}{n}", tuple(TOKENS[:n]), 10, method=method) for n in (6, 19)]
        outs = run_all(s, reqs)
    finally:
        s.stop()
    return [o.tokens for o in outs], sum(o.finish.stats.drafted for o in outs)


def test_the_fp8_copy_loads_and_mtp_is_none(made: dict, tmp_path: Path) -> None:
    from protos.params import MTP, NONE

    src, dst = made["moe"][0], tmp_path / "fp8"
    met(["quantize", "--fp8-block", "128", str(src), str(dst)])
    engine = Engine(dst, SERVICE, "bf16")
    index = checkpoint_index(dst)
    assert vision_tensors(engine.cfg, index) == vision_tensors(engine.cfg, checkpoint_index(src))
    assert any(isinstance(w, BlockFp8) for w in engine.model.wt.values())
    assert engine.capabilities().quantization == "fp8-e4m3-block128"
    none, drafted_none = _served_tokens(engine, NONE)
    mtp, drafted = _served_tokens(engine, MTP)
    assert mtp == none and drafted > 0 == drafted_none


def _image_logits(engine: Engine, model: PreTrainedModel) -> torch.Tensor:
    """The last row's logits of a prompt with two images (the tower replicated on every rank)."""
    from tests.gpu_service.engine.test_images import GRIDS, _prompt, _rows

    ids, images, _ = _prompt(model, GRIDS)
    seq = engine.alloc_sequence()
    try:
        engine.prefill([seq], [ids], images=[images])
        return _rows(engine)
    finally:
        engine.free_sequence(seq)


@pytest.mark.parametrize("kind", ["dense", "moe-tied"])
def test_tp_2_equals_one_device(made: dict, kind: str) -> None:
    from tests.gpu_service.tp.test_tensor_parallel import _calls, _launch

    directory, model = made[kind]
    single = Engine(directory, SERVICE, "fp32")
    one = [*_calls(single), _image_logits(single, model)]
    tp = _launch(directory, 2)
    try:
        split = [*_calls(tp), _image_logits(tp, model)]
    finally:
        tp.close()
    assert len(one) == len(split) == 4
    for a, b in zip(one, split, strict=True):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=RTOL)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 12}


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_yarn_matches_transformers_past_the_original_context(family: str, tmp_path: Path) -> None:
    """Positions 0..39 with an original context of 12: most of the rows lie past it."""
    if family == "qwen3_5":
        rope = {**YARN, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        model = make(tmp_path, "dense", {"rope_parameters": rope, "head_dim": 16})
    else:
        torch.manual_seed(0)
        rope = {**YARN, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        cfg = Qwen3NextConfig(**{**BASE, "rope_parameters": rope}, attn_implementation="eager")
        model = Qwen3NextForCausalLM(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(tmp_path)
    engine = Engine(tmp_path, SERVICE, "fp32")
    assert engine.cfg.yarn is not None and engine.cfg.yarn.factor == 4.0
    tokens = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3))
    seq = engine.alloc_sequence()
    hidden = engine.model.forward(tokens, [Segment(seq.slot, 0, 40, 0)], engine.state, PREFILL)
    got = engine.model.logits(hidden[:40])
    expected = _theirs(model, tokens.tolist())
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    # and YaRN is not a no-op here: its table is not plain RoPE's
    plain = replace(engine.cfg, rope_type="default", yarn=None)
    assert not torch.allclose(rope_table(plain, 40)[0], rope_table(engine.cfg, 40)[0])


def test_the_plan_names_the_tower_and_the_tensor_parallel_size_that_holds_it(capsys) -> None:
    """Qwen3.5-27B at its whole context on one H200: refused, and TP 2 named; the vision
    tower's bf16 bytes among the parts."""
    import json

    from tests.gpu_service.test_hf_config import MODELS

    config = MODELS / "qwen3.5-27b" / "config.json"
    flags = ["--device-memory", "141GB", "--max-context", "262144", "--num-slots", "8"]
    with pytest.raises(SystemExit) as refused:
        met(["gpu-service", "plan", str(config), *flags, "--json"])
    assert refused.value.code == 1
    body = json.loads(capsys.readouterr().out)
    assert body["fits"] is False and body["tensor_parallel_size_that_fits"] == 2
    tower = ModelConfig.from_dict(json.loads(config.read_text())).vision_params
    assert body["vision_weights_bytes"] == 2 * tower


def test_prefix_cache_paged_kv_and_penalties_change_no_greedy_token(made: dict) -> None:
    """The MoE checkpoint with a KV pool smaller than its slots' whole contexts, prefix
    snapshots, and penalties: two turns of prompts sharing a 130-token prefix give, with the
    cache and with `mtp`, the tokens of plain decoding without the cache, and the second turn
    takes its prefix from the cache."""
    from control_plane.scheduler.env import Env
    from control_plane.scheduler.options import SchedulerOptions
    from control_plane.scheduler.scheduler import Scheduler
    from control_plane.scheduler.seq import GenRequest
    from control_plane.text.tokenizer import ByteTokenizer
    from protos.model import Penalties
    from protos.params import MTP, NONE
    from tests.collect import run_all

    svc = replace(SERVICE, kv_blocks=12, prefix_snapshots=4)
    shared = [(11 * i + 5) % 480 for i in range(130)]
    prompts = [[*shared, *TOKENS[:n]] for n in (3, 9)]

    def serve(cache: bool, method: str) -> tuple[list[list[int]], int]:
        engine = Engine(made["moe"][0], svc, "fp32")
        options = SchedulerOptions(prefix_cache=cache)
        s = Scheduler(lambda: engine, ByteTokenizer.default(), options, Env())
        s.start()
        try:
            out = []
            for turn, prompt in enumerate(prompts):
                pen = Penalties(presence=0.5, frequency=0.25, repetition=1.25)
                pen = replace(pen, prompt_tokens=len(prompt))
                req = GenRequest(f"{turn}", tuple(prompt), 8, method=method, penalties=pen)
                out += [o.tokens for o in run_all(s, [req])]
            hits = s.prefix.hits if s.prefix is not None else 0
        finally:
            s.stop()
        assert engine.slots.blocks.num_used == 0
        return out, hits

    plain, _ = serve(False, NONE)
    cached, hits = serve(True, MTP)
    assert cached == plain and hits >= 128
