"""The memory plan (gpu_service/sizing/plan.py): its parts against what the engine allocates, the
flagship's weights against its checkpoint, `--num-slots`, and `met gpu-service plan`/`serve`."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_service.dflash.config import read_config
from gpu_service.engine.facade import Engine
from gpu_service.engine.ranks import Launch, launch
from gpu_service.model import shard
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.hybrid import held_bytes
from gpu_service.model.quantization import fp8_names
from gpu_service.model.weights import weight_shapes
from gpu_service.rpc import server
from gpu_service.rpc.options import parse_bytes
from gpu_service.sizing import plan, plan_graphs, plan_report
from gpu_service.sizing.plan_meta import meta_model
from kernels.fp8.format import BLOCK
from met.main import build_parser, main
from protos.defaults import DEFAULT_MODEL_DIR
from tests.conftest import TINY_SERVICE
from tests.flagship import FLAGSHIP_DRAFTER, QWEN3_NEXT_80B

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
# The parts DeviceState allocates, and its tensors in each.
STATE = {
    "kv_cache_bytes": ("k_cache", "v_cache", "block_table"),
    "gdn_state_bytes": ("gdn",),
    "conv_state_bytes": ("conv",),
    "verify_bytes": ("verify_gdn", "verify_conv", "verify_offset_t"),
    "drafter_kv_bytes": ("mtp_k", "mtp_v", "mtp_valid"),
}
NO_MEMORY = plan.Memory(None)


def _plan(
    model: Path, *flags: str, device: torch.device = CPU, graphs: bool = False
) -> plan.MemoryPlan:
    args = build_parser().parse_args(["gpu-service", "plan", str(model), *flags])
    return plan.from_args(args, device, graphs)


def _tiny_flags(*more: str) -> tuple[str, ...]:
    svc = TINY_SERVICE
    return (
        *("--verify-tiers", svc.verify_tiers, "--max-context", str(svc.max_context)),
        *("--max-rows", str(svc.max_rows), "--max-batch", str(svc.max_batch)),
        *("--max-prefill-tokens", str(svc.max_prefill_tokens)),
        *more,
    )


# Slow: builds Qwen3-Next-80B's 76k weight tensors on the meta device.
@pytest.mark.slow
def test_flagship_weights_are_its_checkpoints_bytes() -> None:
    """With the 5-layer DFlash drafter shaped for it, so every part is there."""
    cfg = ModelConfig.from_dict(QWEN3_NEXT_80B)
    svc = ServiceConfig(prefix_snapshots=4)
    drafter = read_config(FLAGSHIP_DRAFTER, cfg)
    made = plan.make_plan("flagship", cfg, svc, torch.bfloat16, True, NO_MEMORY, drafter=drafter)
    checkpoint = sum(2 * math.prod(s) for s in weight_shapes(cfg).values())
    # The held layout may add fp32 norm multipliers; nothing more.
    assert checkpoint <= made.parts["weights_bytes"] <= 1.02 * checkpoint
    print(plan_report.report(made))
    none = ("other_state_bytes", "vision_weights_bytes", "vision_bytes")  # Qwen3-Next: no tower
    assert all(v > 0 for k, v in made.parts.items() if k not in none), made.parts
    assert all(made.parts[k] == 0 for k in none)
    # Each snapshot: every GDN layer's state (fp32) and conv window, and a hidden of carry.
    snapshot = (
        cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        + (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * 2
    ) * len(cfg.linear_layers) + cfg.hidden_size * 2
    assert made.parts["snapshot_bytes"] == 4 * snapshot


# Slow: builds the FP8 flagship on the meta device.
@pytest.mark.slow
def test_flagship_fp8_counts_a_byte_a_weight_and_fits_one_h200() -> None:
    """The FP8 checkpoint Qwen publishes: its quantized linears at one byte a weight, their
    scales and column groups, the rest in bf16; on one H200 (141 GB) it leaves slots at the
    model's full context."""
    config = ROOT / "gpu_service/models/qwen3-next-80b-a3b-fp8/config.json"
    made = _plan(config, "--device-memory", "141GB", "--num-slots", "6", "--max-context", "262144")
    cfg = plan.load_config(config)
    assert cfg.quantization is not None and made.quantization == "fp8-e4m3-block128"
    shapes = weight_shapes(cfg)
    fp8 = fp8_names(cfg.quantization, shapes)
    assert made.weights_by_dtype["float8_e4m3fn"] == sum(math.prod(shapes[n]) for n in fp8)
    kept = sum(2 * math.prod(s) for n, s in shapes.items() if n not in fp8)
    assert kept <= made.weights_by_dtype["bfloat16"] <= 1.02 * kept
    scales = made.weights_by_dtype["float32"] + made.weights_by_dtype["int32"]
    assert scales <= 0.001 * made.weights_by_dtype["float8_e4m3fn"]
    assert made.fits, plan_report.report(made)
    print(plan_report.report(made))


def test_flagship_workspace_holds_the_split_kernels_partials() -> None:
    """A verify's attention splits its keys, 16 partial rows a query row and head; the plan's
    workspace counts them on top of the verify's activations."""
    from kernels.attention.splits import MAX_SPLITS

    cfg = ModelConfig.from_dict(QWEN3_NEXT_80B)
    svc = ServiceConfig()
    model = meta_model(cfg, torch.bfloat16, svc.max_context)
    rows = svc.max_rows
    partials = rows * cfg.num_attention_heads * MAX_SPLITS * (cfg.head_dim + 2) * 4
    assert plan_graphs.split_workspace_bytes(model, rows) >= partials
    made = plan.make_plan("flagship", cfg, svc, torch.bfloat16, False, NO_MEMORY)
    verify = plan_graphs.activation_bytes(cfg, rows, 2) + plan_graphs.split_workspace_bytes(
        model, rows
    )
    assert made.parts["workspace_bytes"] >= verify


@pytest.fixture(scope="module")
def mini_fp8_dir(mini_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The miniature flagship rewritten in block FP8 by `met quantize`."""
    directory = tmp_path_factory.mktemp("mini-fp8") / "fp8"
    main(["quantize", "--fp8-block", "128", str(mini_dir), str(directory)])
    return directory


@pytest.mark.parametrize("model", ["tiny_dir", "mini_dir", "mini_fp8_dir"])
def test_parts_are_the_engines_allocations(request: pytest.FixtureRequest, model: str) -> None:
    directory = request.getfixturevalue(model)
    engine = Engine(directory, TINY_SERVICE)
    made = _plan(directory, *_tiny_flags())
    held = vars(engine.state)
    for part, names in STATE.items():
        allocated = sum(held[n].numel() * held[n].element_size() for n in names)
        assert made.parts[part] == pytest.approx(allocated, rel=0.01), part
    weights = held_bytes(engine.model.held_tensors())
    assert made.parts["weights_bytes"] == pytest.approx(weights, rel=0.01)
    assert made.parts["rope_bytes"] == engine.model.rope.numel() * 4


def test_every_state_tensor_has_a_part(tiny_dir: Path) -> None:
    state = Engine(tiny_dir, TINY_SERVICE).state
    tensors = {n for n, v in vars(state).items() if isinstance(v, torch.Tensor)}
    assert tensors <= set(plan.STATE_PARTS), tensors - set(plan.STATE_PARTS)


def test_num_slots_extends_or_cuts_the_tiers() -> None:
    tiers = "2:3,1:1"
    assert ServiceConfig(verify_tiers=tiers).slot_verify_drafts == (3, 3, 1)
    assert ServiceConfig(verify_tiers=tiers, num_slots_override=2).slot_verify_drafts == (3, 3)
    five = ServiceConfig(verify_tiers=tiers, num_slots_override=5)
    assert five.slot_verify_drafts == (3, 3, 1, 1, 1) and five.num_slots == 5
    with pytest.raises(ValueError, match="must be >= 1"):
        ServiceConfig(num_slots_override=0)


def test_num_slots_sizes_the_plan(tiny_dir: Path) -> None:
    eight, forty = (_plan(tiny_dir, *_tiny_flags("--num-slots", n)) for n in ("8", "40"))
    assert (eight.svc.num_slots, forty.svc.num_slots) == (8, 40)
    # By default the pool backs every slot's whole context, plus the pad block; each slot and
    # the pad slot has a block table of int32 entries, one a block of its context.
    per_seq = TINY_SERVICE.max_context // 64
    for p in (eight, forty):
        n = p.svc.num_slots
        assert p.parts["kv_cache_bytes"] == (n * per_seq + 1) * _block_bytes(tiny_dir) + (
            (n + 1) * per_seq * 4
        )


def test_kv_blocks_sizes_the_pool(tiny_dir: Path) -> None:
    ten = _plan(tiny_dir, *_tiny_flags("--num-slots", "40", "--kv-blocks", "10"))
    per_seq = TINY_SERVICE.max_context // 64
    assert ten.parts["kv_cache_bytes"] == 11 * _block_bytes(tiny_dir) + 41 * per_seq * 4
    with pytest.raises(SystemExit):
        _plan(tiny_dir, *_tiny_flags("--kv-blocks", "-1"))


def _block_bytes(model: Path) -> int:
    """One block's keys and values over every full-attention layer, fp32."""
    cfg = ModelConfig.load(model)
    return 2 * len(cfg.full_layers) * 64 * cfg.num_key_value_heads * cfg.head_dim * 4


def test_auto_takes_the_most_slots_that_fit(tiny_dir: Path) -> None:
    twelve = _plan(tiny_dir, *_tiny_flags("--num-slots", "12"))
    room = str(twelve.total + 100)
    auto = _plan(tiny_dir, *_tiny_flags("--num-slots", "auto", "--device-memory", room))
    assert auto.svc.num_slots == 12 and auto.fits
    # No memory to fit on the CPU: the tiers' count.
    assert _plan(tiny_dir, *_tiny_flags("--num-slots", "auto")).svc.num_slots == 8
    none_fit = _plan(tiny_dir, *_tiny_flags("--num-slots", "auto", "--device-memory", "1MB"))
    assert none_fit.svc.num_slots == 1 and none_fit.fits is False


def test_graphs_count_every_key_a_service_can_capture(tiny_dir: Path) -> None:
    off, on = (_plan(tiny_dir, *_tiny_flags(), graphs=g) for g in (False, True))
    assert off.parts["graphs_bytes"] == 0 and on.parts["graphs_bytes"] > 0
    svc = on.svc
    # Verify (tiers 2:3,2:2,4:1, 24 rows): bucket 4 at 1..4 rows a sequence; bucket 8 (5
    # sequences or more) at 1 or 2 only, since 3 rows a sequence need slots of 2 drafts or more,
    # and there are 4. Each at two write modes. Chain: 2 buckets x 4 depths.
    assert plan_graphs.verify_shapes(svc) == [(4, 1), (4, 2), (4, 3), (4, 4), (8, 1), (8, 2)]
    assert plan_graphs.key_lengths(svc.max_context) == [64, 128, 256]
    assert on.num_graphs == (2 * 6 + 8) * 3
    one = _plan(tiny_dir, *_tiny_flags("--num-slots", "1"), graphs=True)
    assert plan_graphs.verify_shapes(one.svc) == [(4, 1), (4, 2), (4, 3), (4, 4)]
    assert one.num_graphs == (2 * 4 + 4) * 3


def test_bare_config_trusts_its_drafter(tiny_dir: Path, tmp_path: Path) -> None:
    bare = _plan(tiny_dir / "config.json", *_tiny_flags())
    assert bare.parts == _plan(tiny_dir, *_tiny_flags()).parts
    # A checkpoint without mtp.* tensors serves with the drafter off, as the engine loads it.
    weights = load_file(str(tiny_dir / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    save_file(kept, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    no_mtp = _plan(tmp_path, *_tiny_flags())
    engine = Engine(tmp_path, TINY_SERVICE)
    assert not engine.cfg.has_mtp
    assert no_mtp.parts["weights_bytes"] == held_bytes(engine.model.held_tensors())
    assert no_mtp.parts["weights_bytes"] < bare.parts["weights_bytes"]


def test_json_has_every_part(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["gpu-service", "plan", str(tiny_dir), "--json", "--device-memory", "1GiB"])
    assert done.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(plan.PARTS) | {"weights_by_dtype", "total_bytes", "fits"} <= set(out)
    assert out["total_bytes"] == sum(out[k] for k in plan.PARTS)
    assert out["weights_bytes"] == sum(out["weights_by_dtype"].values())
    assert (out["device_memory_bytes"], out["fits"]) == (2**30, True)


def test_report_without_memory_has_no_verdict(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["gpu-service", "plan", str(tiny_dir), "--device", "cpu"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "total" in out and "no device memory" in out and "fits" not in out


@pytest.mark.parametrize(
    "flags, code, says",
    [
        (["--device-memory", "1MB"], 1, "does not fit: the plan needs"),
        (["--num-slots", "0"], 2, "argument --num-slots: expected a whole number"),
        (["--device-memory", "12XB"], 2, "argument --device-memory: expected bytes"),
        (["--verify-tiers", "8:x"], 2, "met gpu-service plan: error: bad verify tier"),
        (["--max-context", "100"], 2, "expected a positive multiple of 64"),
    ],
    ids=["too-small", "zero-slots", "bad-unit", "bad-tiers", "bad-context"],
)
def test_plan_exit_status(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], flags: list[str], code: int, says: str
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["gpu-service", "plan", str(tiny_dir), *flags])
    assert done.value.code == code
    captured = capsys.readouterr()
    assert says in captured.out + captured.err


def test_a_missing_model_is_one_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["gpu-service", "plan", "/nonexistent/model"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err == "met gpu-service plan: error: /nonexistent/model does not exist\n"


@pytest.mark.parametrize(
    "text, value",
    [("123", 123), ("141GB", 141 * 10**9), ("80GiB", 80 * 2**30), ("1.5 gb", 1_500_000_000)],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "-1", "12XB", "GB", "1.5.2GB", "0.5"])
def test_parse_bytes_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected bytes"):
        parse_bytes(text)


def _serve_args(tiny_dir: Path, *flags: str) -> argparse.Namespace:
    args = ["gpu-service", "serve", "--model", str(tiny_dir), *_tiny_flags(*flags)]
    return build_parser().parse_args(args)


def test_serve_plans_before_it_loads(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svc = server._planned(_serve_args(tiny_dir, "--num-slots", "auto"), CPU, False)
    assert svc.num_slots == TINY_SERVICE.num_slots
    out = capsys.readouterr().out
    assert out.startswith("gpu-service plan: weights ") and "no device memory" in out
    with pytest.raises(SystemExit) as done:
        server._planned(_serve_args(tiny_dir, "--device-memory", "1.5MB"), CPU, False)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("met gpu-service serve: error: the plan needs ")
    assert "lower --num-slots (8), --kv-blocks (32) or --verify-tiers" in err


# Slow: starts a GPU service process.
@pytest.mark.slow
def test_serve_refuses_a_plan_that_does_not_fit(tiny_dir: Path) -> None:
    cmd = [sys.executable, "-m", "met", "gpu-service", "serve", "--port", "0"]
    args = ["--model", str(tiny_dir), "--device", "cpu", "--device-memory", "2MB"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        cmd + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("met gpu-service serve: error: the plan needs ")
    assert "but --device-memory is 2.0 MB" in lines[0] and "lower --num-slots (32)" in lines[0]
    assert "gpu-service plan:" in done.stdout and "listening" not in done.stdout


# -- tensor parallelism: one rank's plan -----------------------------------------------------


def _rank_bytes(cfg: ModelConfig, size: int, itemsize: int, only: set[str] | None = None) -> int:
    """Bytes of what rank 0 of `size` reads of a checkpoint of `cfg` (`tp.shard.part`), of the
    tensors named in `only` where given."""
    total = 0
    for name, shape in weight_shapes(cfg).items():
        if only is not None and name not in only:
            continue
        spec = shard.part(cfg, shard.Shard(0, size), name, shape)
        numel = math.prod(shape)
        total += itemsize * (numel if spec is None else numel // shape[spec[0]] * len(spec[1]))
    return total


# Slow: builds Qwen3-Next-80B's rank-0 shard on the meta device.
@pytest.mark.slow
def test_flagship_bf16_at_tp2_fits_h200s_with_room_for_slots() -> None:
    """The flagship in bf16 (163 GB) fits no single H200; at TP 2 each rank holds half its
    weights, plus the replicated norms and routers, and leaves a 141 GB H200 room for slots at
    the model's full context."""
    config = ROOT / "gpu_service/models/qwen3-next-80b-a3b/config.json"
    flags = ("--device-memory", "141GB", "--num-slots", "auto", "--max-context", "262144")
    made = _plan(config, *flags, "--tp", "2")
    cfg = plan.load_config(config)
    whole, rank = (_rank_bytes(cfg, n, 2) for n in (1, 2))
    weights = made.parts["weights_bytes"]
    # The held layout may add fp32 norm multipliers; nothing more.
    assert rank <= weights <= 1.001 * rank
    assert whole > 141 * 10**9 and 0.5 * whole < weights < 0.51 * whole
    report = plan_report.report(made)
    assert made.tensor_parallel_size == 2 and made.fits and made.svc.num_slots >= 8, report
    assert "per rank x 2 ranks" in report.splitlines()[0] and "\nfits per rank: " in report
    assert plan_report.to_json(made)["tensor_parallel_size"] == 2
    print(report)


# Slow: builds Qwen3.5-397B-A17B's rank-0 shard on the meta device.
@pytest.mark.slow
def test_397b_fp8_at_tp8_counts_a_ranks_fp8_bytes_and_fits_h200s() -> None:
    """The largest checkpoint in FP8 over eight H200s: rank 0 holds its part of each FP8
    weight at a byte a weight (an eighth of each split one, the MTP head's fc whole), their
    scales and column groups beside them, the rest in bf16; each rank fits 141 GB."""
    config = ROOT / "gpu_service/models/qwen3.5-397b-a17b-fp8"
    made = _plan(config, "--device-memory", "141GB", "--tp", "8")
    cfg = plan.load_config(config)
    assert cfg.quantization is not None
    fp8 = fp8_names(cfg.quantization, weight_shapes(cfg))
    rank = _rank_bytes(cfg, 8, 1, fp8)
    assert made.weights_by_dtype["float8_e4m3fn"] == rank
    assert 0.124 * _rank_bytes(cfg, 1, 1, fp8) < rank < 0.126 * _rank_bytes(cfg, 1, 1, fp8)
    scales = made.weights_by_dtype["float32"] + made.weights_by_dtype["int32"]
    assert rank // BLOCK**2 * 4 <= scales <= 0.001 * rank
    assert made.tensor_parallel_size == 8 and made.fits, plan_report.report(made)
    print(plan_report.report(made))


# Slow: builds the flagship and its drafter on the meta device.
@pytest.mark.slow
def test_flagship_at_tp2_with_its_drafter_counts_the_logprob_rows() -> None:
    """Every rank holds the whole DFlash drafter and its context KV; the logprob rows are the
    larger of a prompt's scored tile and a verify's whole row budget listing alternatives
    (logprobs under speculation): its logits and their fp32 log-softmax. It fits two H200s."""
    config = ROOT / "gpu_service/models/qwen3-next-80b-a3b/config.json"
    made = _plan(
        config, "--drafter", str(FLAGSHIP_DRAFTER), "--device-memory", "141GB", "--tp", "2"
    )
    cfg = plan.load_config(config)
    verify = plan.padded_rows(made.svc.max_rows) * cfg.vocab_size * (2 + 4)
    assert made.parts["score_bytes"] >= verify
    assert made.parts["dflash_weights_bytes"] > 0 and made.parts["dflash_kv_bytes"] > 0
    assert made.fits, plan_report.report(made)


# Slow: starts a tensor-parallel rank process.
@pytest.mark.slow
def test_tp2_plan_is_each_ranks_allocations(mini_dir: Path) -> None:
    """The flagship in miniature (MoE, one KV head: replicated at TP 2) over two CPU
    processes: every rank holds what the plan counts for one rank (and no captured graphs:
    the engine replays none under tensor parallelism)."""
    made = _plan(mini_dir, *_tiny_flags("--tp", "2"), graphs=True)
    assert not made.graphs and made.parts["graphs_bytes"] == 0
    engine = launch(Launch(mini_dir, TINY_SERVICE, None, "cpu", 2))
    try:
        by_rank = engine.held_bytes_by_rank()
    finally:
        engine.close()
    assert len(by_rank) == 2
    for held in by_rank:
        for part, names in STATE.items():
            allocated = sum(held["state"][n] for n in names)
            assert made.parts[part] == pytest.approx(allocated, rel=0.01), part
        weights = sum(held["weights"].values())
        assert made.parts["weights_bytes"] == pytest.approx(weights, rel=0.01)


def test_a_size_that_does_not_split_the_model_is_refused(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """By `plan` and `serve`, with status 2 and the sentence naming what does not divide; the
    flagship's FP8 checkpoint at TP 8, where a rank's share of an expert (64 of its 512) would
    cut a 128-row scale block, with the sizes that split it."""
    fp8 = ROOT / "gpu_service/models/qwen3-next-80b-a3b-fp8/config.json"
    for model, size, says in [
        (DEFAULT_MODEL_DIR, "3", "--tensor-parallel-size 3 does not divide num_attention_heads"),
        (fp8, "8", "rank 0 would hold its rows 0 to 63, which cut a block; "),
        (fp8, "8", "--tensor-parallel-size 1, 2 or 4 splits every FP8 weight on block edges"),
    ]:
        with pytest.raises(SystemExit) as done:
            main(["gpu-service", "plan", str(model), "--tp", size])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("met gpu-service plan: error: ") and says in err, err
    with pytest.raises(SystemExit) as done:
        server._planned(_serve_args(tiny_dir, "--tp", "3"), CPU, False)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("met gpu-service serve: error: --tensor-parallel-size 3 does not divide")


def test_kv_blocks_auto_fills_the_memory_left(tiny_dir: Path) -> None:
    """The most blocks within 95% of the memory, and no more than every slot's whole context;
    with no memory known, every slot's whole context."""
    small = _plan(tiny_dir, *_tiny_flags("--num-slots", "4", "--kv-blocks", "1"))
    # A block of every attention layer and the drafter's, with its drafter marks.
    block = (
        _plan(tiny_dir, *_tiny_flags("--num-slots", "4", "--kv-blocks", "2")).total - small.total
    )
    memory = int((small.total + 10 * block + block // 2) / plan.AUTO_BLOCKS_SHARE)
    auto = _plan(
        tiny_dir,
        *_tiny_flags("--num-slots", "4", "--kv-blocks", "auto", "--device-memory", str(memory)),
    )
    assert auto.svc.kv_blocks == 11 and auto.fits
    assert auto.total <= plan.AUTO_BLOCKS_SHARE * memory < auto.total + block
    roomy = _plan(
        tiny_dir, *_tiny_flags("--num-slots", "4", "--kv-blocks", "auto", "--device-memory", "1TB")
    )
    assert roomy.svc.kv_blocks == 4 * TINY_SERVICE.max_context // 64
    cpu = _plan(tiny_dir, *_tiny_flags("--num-slots", "4", "--kv-blocks", "auto"))
    assert cpu.svc.kv_blocks == 0 and cpu.svc.num_kv_blocks == 4 * TINY_SERVICE.max_context // 64


def test_the_context_is_the_models_lowered_to_what_memory_holds(tiny_dir: Path) -> None:
    """No --max-context: the model's max_position_embeddings (512), and with a device memory
    that does not hold it, the largest whole number of key blocks that does; a --max-context
    given is never lowered."""
    flags = ["--verify-tiers", "4:3", "--max-rows", "16", "--max-batch", "4"]
    whole = _plan(tiny_dir, *flags)
    assert whole.svc.max_context == 512 and whole.model_context == 0
    tight = f"{whole.total - 1}"
    lowered = _plan(tiny_dir, *flags, "--device-memory", tight)
    assert lowered.fits and lowered.svc.max_context < 512 and lowered.svc.max_context % 64 == 0
    assert lowered.model_context == 512
    assert "(the model's 512, lowered to what the memory holds)" in plan_report.report(lowered)
    given = _plan(tiny_dir, *flags, "--device-memory", tight, "--max-context", "512")
    assert given.svc.max_context == 512 and given.fits is False
