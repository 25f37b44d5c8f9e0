"""Block-FP8 checkpoints as Qwen publishes them (gpu_service/model/quantization.py): written by
`met quantize` from the default model and from the flagship in miniature, or by hand in the
published layout; held as FP8 with their scales; their logits within FP8's error of the same
weights dequantized, and of transformers' dequantized load; lossless speculation through both
processes; and a checkpoint holding what the engine would not read refused at start-up."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_service.engine.facade import Engine
from gpu_service.model.config import ServiceConfig
from gpu_service.model.hybrid import held_bytes
from gpu_service.model.weights import WEIGHTS_FILE, checkpoint_index
from kernels.fp8.naive import FP8, BlockFp8, dequantize_blocks
from met.main import main as met
from protos.defaults import DEFAULT_MODEL_DIR
from tests.control_plane.circuit.test_verify_batch import args
from tests.flagship import MINI_FLAGSHIP
from tests.gpu_service.model.test_flagship_mini import DIFF_FLAGS, assert_mtp_equals_none
from tests.gpu_service.model.test_hf_parity import ATOL, RTOL
from training.checkpoint import init_model

SERVICE = ServiceConfig(verify_tiers="4:3,4:1", max_context=256, max_rows=24, max_batch=8)
PROMPTS = [list(range(40, 53)), list(range(90, 97))]
# FP8 against the same weights dequantized: the activations' per-row, per-128-column e4m3
# rounding (3 mantissa bits: 2.6% relative RMS error through one random linear) compounded
# through every linear of the model. Measured as ||got - expected|| / ||expected|| over the
# logits rows: 4% on the trained default model, 10% on transformers' random checkpoint; a
# wrong scale, block or column group is off by the logits' whole size.
FP8_TOLERANCE = 0.15
SCALE = ".weight_scale_inv"


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The FP8 checkpoint `src` with every FP8 weight replaced by its real values in fp32,
    and no quantization_config: the same model, unquantized."""
    shutil.copytree(src, dst)
    for shard in src.glob("*.safetensors"):
        tensors = load_file(str(shard))
        out = {}
        for name, t in tensors.items():
            if name.endswith(SCALE):
                continue
            scale = tensors.get(name.removesuffix(".weight") + SCALE)
            out[name] = t if scale is None else dequantize_blocks(t, scale)
        save_file(out, str(dst / shard.name))
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, mini_dir: Path) -> dict[str, Path]:
    """name -> the FP8 checkpoint `met quantize` wrote; name + "-src" -> its source;
    "default-deq" -> the default FP8 checkpoint dequantized."""
    out = {}
    for name, src in {"default": DEFAULT_MODEL_DIR, "moe": mini_dir}.items():
        dst = tmp_path_factory.mktemp(name) / "fp8"
        met(["quantize", "--fp8-block", "128", str(src), str(dst)])
        out[name], out[f"{name}-src"] = dst, src
    out["default-deq"] = dequantized_copy(out["default"], out["default"].parent / "deq")
    return out


def _logits(engine: Engine) -> torch.Tensor:
    """Prefill two sequences, then verify three rows of each: every logits row, fp32."""
    seqs = [engine.alloc_sequence() for _ in PROMPTS]
    engine.prefill(seqs, PROMPTS)
    rows = [_read(engine)]
    engine.decode_verify_batched([5, 6, 7, 8, 9, 10], [3, 3], seqs)
    return torch.cat([*rows, _read(engine)])


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def _logits_of(directory: Path, tokens: list[int]) -> torch.Tensor:
    """The last prompt row after a prefill of tokens[:7], then a verify of the rest."""
    engine = Engine(directory, SERVICE, "fp32")
    seq = engine.alloc_sequence()
    engine.prefill([seq], [tokens[:7]])
    last = _read(engine)
    engine.decode_verify_batched(tokens[7:], [len(tokens) - 7], [seq])
    return torch.cat([last, _read(engine)])


def _read(engine: Engine) -> torch.Tensor:
    lg = engine.read_logits()
    return torch.frombuffer(bytearray(lg.data), dtype=torch.float32).view(lg.shape[0], -1)


@pytest.mark.parametrize("name", ["default", "moe"])
def test_linears_are_held_in_fp8(checkpoints: dict[str, Path], name: str) -> None:
    """Every FP8 weight of the checkpoint is held at one byte a weight, with its scale grid and
    column groups; nothing is widened, and nothing else takes more than its bf16 bytes."""
    index = checkpoint_index(checkpoints[name])
    fp8_bytes = sum(math.prod(shape) for _, shape, dtype in index.values() if dtype == "F8_E4M3")
    other_bytes = sum(
        2 * math.prod(shape)
        for n, (_, shape, dtype) in index.items()
        if dtype != "F8_E4M3" and not n.endswith(SCALE)
    )
    engine = Engine(checkpoints[name], SERVICE, "bf16")
    held = engine.model.held_tensors()
    assert held_bytes([t for t in held if t.dtype == FP8]) == fp8_bytes > 0
    fp8 = [w for w in engine.model.wt.values() if isinstance(w, BlockFp8)]
    assert fp8 and all(w.weight.dtype == FP8 for w in fp8)
    assert all(w.scales.dtype == torch.float32 and w.groups.dtype == torch.int32 for w in fp8)
    assert all(w.groups.shape == w.weight.shape[-1:] for w in fp8)
    scale_bytes = held_bytes([t for w in fp8 for t in (w.scales, w.groups)])
    # A grid has a column per run of kept columns from one 128-row block: the packing's
    # regrouping cuts blocks at head boundaries, so scales and groups grow with the columns.
    assert scale_bytes <= 0.05 * fp8_bytes
    rest = held_bytes([t for t in held if t.dtype not in (FP8, torch.int32, torch.float32)])
    assert rest <= 1.02 * other_bytes
    assert engine.capabilities().quantization == "fp8-e4m3-block128"


def test_logits_match_the_dequantized_weights(checkpoints: dict[str, Path]) -> None:
    """The trained default model: FP8 within FP8's error of its weights dequantized."""
    got = _logits(Engine(checkpoints["default"], SERVICE, "fp32"))
    expected = _logits(Engine(checkpoints["default-deq"], SERVICE, "fp32"))
    assert _relative_error(got, expected) <= FP8_TOLERANCE
    # and the quantization is not a no-op: FP8 rounds the source weights
    source = _logits(Engine(checkpoints["default-src"], SERVICE, "fp32"))
    assert _relative_error(got, source) > 1e-3


# The miniature flagship's seeded weights have unit gain: through its 8 layers and 128 experts
# a perturbation grows, and a 2.6% random error on every linear's input (what e4m3 rounding
# makes) moves its dequantized model's logits by 87% (3% on the trained default model). Its
# FP8 forward is therefore compared at a quarter of the gain, a contracting model as trained
# ones are (measured: 4.5%; at unit gain 102%).
TAME_GAIN = 0.25


def test_moe_logits_match_the_dequantized_weights(tmp_path: Path) -> None:
    src = init_model(tmp_path / "src", MINI_FLAGSHIP, seed=5).parent
    weights = load_file(str(src / WEIGHTS_FILE))
    for name, t in weights.items():
        if t.dim() == 2 and "embed" not in name and "lm_head" not in name:
            weights[name] = t * TAME_GAIN
    save_file(weights, str(src / WEIGHTS_FILE))
    met(["quantize", "--fp8-block", "128", str(src), str(tmp_path / "fp8")])
    deq = dequantized_copy(tmp_path / "fp8", tmp_path / "deq")
    got = _logits(Engine(tmp_path / "fp8", SERVICE, "fp32"))
    expected = _logits(Engine(deq, SERVICE, "fp32"))
    assert _relative_error(got, expected) <= FP8_TOLERANCE
    assert _relative_error(got, _logits(Engine(src, SERVICE, "fp32"))) > 1e-3


# Slow: starts both processes on each FP8 checkpoint.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["default", "moe"])
def test_mtp_equals_none_through_both_processes(checkpoints: dict[str, Path], name: str) -> None:
    assert_mtp_equals_none(checkpoints[name])


def _published(tmp: Path) -> tuple[Path, torch.nn.Module]:
    """A Qwen3-Next checkpoint written by transformers in shards, rewritten here tensor by
    tensor in the published block-FP8 layout, without `met quantize`: every 2-D linear but
    the head and GDN's b/a projection as float8_e4m3fn, a scale per 128 x 128 block (the last
    blocks ragged), `weight_scale_inv` beside it, modules_to_not_convert by full name, and the
    index naming every tensor. -> (the checkpoint, transformers' model it came from)"""
    from tests.gpu_service.model.test_hf_parity import _checkpoint

    # Every quantized linear's sides a multiple of 128 and some past one block: transformers
    # 5.23 takes a block's size as side // blocks, which misplaces the blocks of a ragged side.
    overrides = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_value_heads": 2,
    }
    src, reference = _checkpoint(tmp / "src", overrides)
    dst = tmp / "published"
    dst.mkdir()
    kept = ["lm_head"] + [f"model.layers.{i}.linear_attn.in_proj_ba" for i in range(3)]
    weight_map = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name in list(tensors):
            w = tensors[name]
            module = name.removesuffix(".weight")
            if w.dim() != 2 or "embed_tokens" in name or module in kept:
                continue
            rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
            scale = torch.empty(rows, cols)
            q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
            for i in range(rows):
                for j in range(cols):
                    block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
                    scale[i, j] = block.abs().max() / 448.0
                    q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / scale[i, j]).to(
                        torch.float8_e4m3fn
                    )
            tensors[name], tensors[f"{module}.weight_scale_inv"] = q, scale
        save_file(tensors, str(dst / shard.name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard.name)
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": kept,
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dst, reference


# Slow: loads the checkpoint in transformers.
@pytest.mark.slow
def test_the_published_layout_loads_and_matches_transformers(tmp_path: Path) -> None:
    """transformers loads the same FP8 checkpoint on a CPU by dequantizing it: our FP8 forward
    stays within FP8's error of it, and of the dequantized weights in our own forward."""
    from transformers import Qwen3NextForCausalLM

    directory, source = _published(tmp_path)
    engine = Engine(directory, SERVICE, "fp32")
    assert engine.capabilities().quantization == "fp8-e4m3-block128"
    held = [w for w in engine.model.wt.values() if isinstance(w, BlockFp8)]
    assert len(held) == 3 * 2 + 1 * 2 + 4 * 2  # GDN qkvz, out; attention qkvg, o; MLPs
    tokens = [5, 17, 99, 3, 250, 8, 41, 77, 120, 6, 231]
    seq = engine.alloc_sequence()
    engine.prefill([seq], [tokens[:7]])
    last = _read(engine)  # the prompt's last row
    engine.decode_verify_batched(tokens[7:], [4], [seq])
    got = torch.cat([last, _read(engine)])
    theirs = Qwen3NextForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        expected = theirs(torch.tensor([tokens])).logits[0, 6:].float()
        unquantized = source(torch.tensor([tokens])).logits[0, 6:].float()
    assert _relative_error(got, expected) <= FP8_TOLERANCE
    assert _relative_error(expected, unquantized) > 1e-3  # transformers read the FP8 bytes
    # The format read as transformers reads it: our forward over the weights dequantized
    # gives transformers' logits to fp32's parity (tests/gpu_service/model/test_hf_parity.py).
    ours = _logits_of(dequantized_copy(directory, tmp_path / "deq"), tokens)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL)


def _serve_status(directory: Path) -> tuple[int, str]:
    """`met gpu-service serve` on `directory`: (exit status, stderr), for a checkpoint that
    must be refused before the port opens."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "met",
            "gpu-service",
            "serve",
            "--model",
            str(directory),
            "--port",
            "0",
            "--max-context",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stderr


def _edited(checkpoints: dict[str, Path], tmp: Path, tensors: dict, config: dict) -> Path:
    """A copy of the default FP8 checkpoint with `tensors` added (None: removed) and the
    config's keys `config` set (None: removed)."""
    directory = tmp / "edited"
    shutil.copytree(checkpoints["default"], directory)
    weights = load_file(str(directory / "model.safetensors"))
    for name, t in tensors.items():
        if t is None:
            weights.pop(name)
        else:
            weights[name] = t
    save_file(weights, str(directory / "model.safetensors"))
    raw = json.loads((directory / "config.json").read_text())
    for key, value in config.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


QKVZ = "model.layers.0.linear_attn.in_proj_qkvz"
BA = "model.layers.0.linear_attn.in_proj_ba"


@pytest.mark.parametrize(
    ("tensors", "config", "named"),
    [
        ({f"{QKVZ}.input_scale": torch.ones(1)}, {}, f"{QKVZ}.input_scale"),
        ({f"{BA}.weight_scale_inv": torch.ones(1, 1)}, {}, f"{BA}.weight_scale_inv"),
        ({}, {"quantization_config": None}, f"{QKVZ}.weight is stored as float8_e4m3fn"),
        (
            {
                f"{BA}.weight": torch.zeros(8, 128, dtype=FP8),
                f"{BA}.weight_scale_inv": torch.ones(1, 1),
            },
            {},
            f"{BA}.weight is stored as float8_e4m3fn, but modules_to_not_convert",
        ),
        (
            {f"{QKVZ}.weight_scale_inv": None},
            {},
            f"lacks 1 tensors, first '{QKVZ}.weight_scale_inv'",
        ),
        (
            {f"{QKVZ}.weight": torch.zeros(384, 128, dtype=torch.float8_e5m2)},
            {},
            f"{QKVZ}.weight is stored as F8_E5M2, which is not supported",
        ),
    ],
    ids=[
        "unknown-scale",
        "scale-of-a-bf16-weight",
        "no-quantization-config",
        "kept-module-in-fp8",
        "missing-scale",
        "e5m2",
    ],
)
def test_what_the_engine_would_not_read_is_refused(
    checkpoints: dict[str, Path], tmp_path: Path, tensors: dict, config: dict, named: str
) -> None:
    directory = _edited(checkpoints, tmp_path, tensors, config)
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace(".", r"\.")):
        Engine(directory, SERVICE, "fp32")


# Slow: starts a GPU service process.
@pytest.mark.slow
def test_serve_refuses_at_start_up_with_status_2(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the port opens, one sentence, no traceback: an unknown tensor; and, through the
    same plan `serve` makes first, a quantization this engine does not serve (its method and
    block size named)."""
    unknown = _edited(checkpoints, tmp_path / "a", {f"{QKVZ}.input_scale": torch.ones(1)}, {})
    status, err = _serve_status(unknown)
    assert status == 2 and f"'{QKVZ}.input_scale'" in err and "Traceback" not in err, err
    gptq = {"quant_method": "gptq", "weight_block_size": [64, 64]}
    other = _edited(checkpoints, tmp_path / "b", {}, {"quantization_config": gptq})
    with pytest.raises(SystemExit) as exit_:
        met(["gpu-service", "plan", str(other)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'gptq'" in err and "[64, 64]" in err, err


# Slow: verify batches through a forward and its serial form.
@pytest.mark.slow
def test_circuit_diff_passes(checkpoints: dict[str, Path]) -> None:
    """The miniature flagship in FP8: batched verification against one sequence at a time,
    with the drafter, byte for byte, on one shape. On the CPU the triton forward multiplies FP8
    linears and experts by this same torch path (the interpreted FP8 GEMMs would take minutes;
    tests/kernels/test_fp8.py and test_moe.py hold them to it), so its diff adds nothing here
    that tests/gpu_service/model/test_flagship_mini.py's does not."""
    from control_plane.circuit.report import run_diff

    engine = Engine(checkpoints["moe"], SERVICE, "bf16")
    flags = [*DIFF_FLAGS["triton"], "--reference", "eager", "--forwards", "eager-serial"]
    report = run_diff(engine, args(*flags, "--mtp"))
    assert report["verdict"] == "PASS", report["reasons"]
    assert all(s["detection_control"]["mismatched_steps"] > 0 for s in report["shapes"])


def test_quantize_keeps_a_sharded_checkpoint_sharded(tmp_path: Path) -> None:
    """transformers' shards in, the same shards out with each scale beside its weight, and
    an index naming every tensor; the result loads."""
    from tests.gpu_service.model.test_hf_parity import _checkpoint

    src, _ = _checkpoint(tmp_path / "src", {})
    met(["quantize", "--fp8-block", "128", str(src), str(tmp_path / "fp8")])
    dst = tmp_path / "fp8"
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(p.name for p in dst.glob("*.safetensors")) == shards
    weight_map = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    index = checkpoint_index(dst)
    assert set(weight_map) == set(index)
    assert all(weight_map[n] == shard.name for n, (shard, _, _) in index.items())
    scales = [n for n in index if n.endswith(SCALE)]
    assert scales and all(weight_map[n] == weight_map[n.replace(SCALE, ".weight")] for n in scales)
    assert Engine(dst, SERVICE, "fp32").capabilities().quantization == "fp8-e4m3-block128"
