"""Weight names and shapes (HF Qwen3-Next layout), seeded initialisation, safetensors I/O."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from gpu_service.model import shard as tp_shard
from gpu_service.model.config import FULL, ModelConfig
from gpu_service.model.quantization import SCALE_SUFFIX, quantizable, scale_name, scale_shape
from gpu_service.model.shard import Shard
from gpu_service.model.vision import VISION_PREFIX, vision_shapes

WEIGHTS_FILE = "model.safetensors"


def _attention_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {
        f"{prefix}.self_attn.q_proj.weight": (cfg.num_attention_heads * d * 2, h),
        f"{prefix}.self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{prefix}.self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{prefix}.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
        f"{prefix}.self_attn.q_norm.weight": (d,),
        f"{prefix}.self_attn.k_norm.weight": (d,),
    }


def _gdn_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    p = f"{prefix}.linear_attn"
    if cfg.separate_gdn_projections:
        projections = {
            f"{p}.in_proj_qkv.weight": (cfg.conv_dim, h),
            f"{p}.in_proj_z.weight": (cfg.value_dim, h),
            f"{p}.in_proj_b.weight": (hv, h),
            f"{p}.in_proj_a.weight": (hv, h),
        }
    else:
        projections = {
            f"{p}.in_proj_qkvz.weight": (2 * cfg.key_dim + 2 * cfg.value_dim, h),
            f"{p}.in_proj_ba.weight": (2 * hv, h),
        }
    return {
        **projections,
        f"{p}.conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
        f"{p}.A_log": (hv,),
        f"{p}.dt_bias": (hv,),
        f"{p}.norm.weight": (cfg.linear_value_head_dim,),
        f"{p}.out_proj.weight": (h, cfg.value_dim),
    }


def _swiglu_shapes(prefix: str, h: int, i: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (i, h),
        f"{prefix}.up_proj.weight": (i, h),
        f"{prefix}.down_proj.weight": (h, i),
    }


# How a checkpoint holds a MoE layer's experts: a SwiGLU each (`experts.E.gate_proj.weight`,
# as transformers' save_pretrained writes them), or stacked (`experts.gate_up_proj`
# [E, 2I, H], gate rows first, and `experts.down_proj` [E, H, I], transformers' own layout).
PER_EXPERT, STACKED = "per_expert", "stacked"


def expert_layout(names: Iterable[str]) -> str:
    """The expert layout of a checkpoint holding tensors `names`."""
    return STACKED if any(n.endswith(".experts.gate_up_proj") for n in names) else PER_EXPERT


def _moe_shapes(cfg: ModelConfig, prefix: str, experts: str) -> dict[str, tuple[int, ...]]:
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.gate.weight": (e, h)}
    if experts == STACKED:
        shapes[f"{prefix}.experts.gate_up_proj"] = (e, 2 * i, h)
        shapes[f"{prefix}.experts.down_proj"] = (e, h, i)
    for n in range(e if experts == PER_EXPERT else 0):
        shapes.update(_swiglu_shapes(f"{prefix}.experts.{n}", h, i))
    if cfg.shared_expert_intermediate_size:
        shapes.update(
            _swiglu_shapes(f"{prefix}.shared_expert", h, cfg.shared_expert_intermediate_size)
        )
        shapes[f"{prefix}.shared_expert_gate.weight"] = (1, h)
    return shapes


def _layer_shapes(
    cfg: ModelConfig, prefix: str, kind: str, moe: bool, experts: str
) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    mixer = _attention_shapes(cfg, prefix) if kind == FULL else _gdn_shapes(cfg, prefix)
    if moe:
        mlp = _moe_shapes(cfg, f"{prefix}.mlp", experts)
    else:
        mlp = _swiglu_shapes(f"{prefix}.mlp", h, i)
    return {
        f"{prefix}.input_layernorm.weight": (h,),
        f"{prefix}.post_attention_layernorm.weight": (h,),
        **mixer,
        **mlp,
    }


def weight_shapes(cfg: ModelConfig, experts: str = PER_EXPERT) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine reads from a checkpoint of `cfg` whose experts are laid out as
    `experts`, by its name there (the text model under `cfg.weight_prefix`)."""
    h, model = cfg.hidden_size, cfg.weight_prefix
    shapes: dict[str, tuple[int, ...]] = {f"{model}embed_tokens.weight": (cfg.vocab_size, h)}
    for n, kind in enumerate(cfg.layer_types):
        moe = cfg.is_moe_layer(n)
        shapes.update(_layer_shapes(cfg, f"{model}layers.{n}", kind, moe, experts))
    shapes[f"{model}norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_nextn_predict_layers):
        shapes.update(_layer_shapes(cfg, f"mtp.layers.{n}", FULL, cfg.num_experts > 0, experts))
    if cfg.has_mtp:
        shapes.update(
            {
                "mtp.fc.weight": (h, 2 * h),
                "mtp.pre_fc_norm_embedding.weight": (h,),
                "mtp.pre_fc_norm_hidden.weight": (h,),
                "mtp.norm.weight": (h,),
            }
        )
    return shapes


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)
    if len(shape) == 1:  # zero-centred RMSNorm: (1 + w)
        return torch.zeros(shape)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def vision_tensors(cfg: ModelConfig, names: Iterable[str]) -> list[str]:
    """The vision tower's tensors among `names` (a Qwen3.5 checkpoint's `model.visual.*`)."""
    nested = cfg.weight_prefix != "model."
    return [n for n in names if nested and n.startswith(VISION_PREFIX)]


def _tower_expected(
    cfg: ModelConfig, index: dict[str, tuple[Path, tuple[int, ...], str]]
) -> dict[str, tuple[int, ...]]:
    """The tower's tensors (`vision.vision_shapes`), with the scale of each weight stored in
    FP8 (the tower dequantizes it at load: it runs in the serving dtype)."""
    if cfg.vision is None:
        return {}
    shapes = vision_shapes(cfg.vision)
    for name in [n for n in shapes if n in index and index[n][2] == FP8_NAME]:
        if not quantizable(name, shapes[name]):
            raise ValueError(f"{name} is stored as float8_e4m3fn; only linear weights load as FP8")
        shapes[scale_name(name)] = scale_shape(shapes[name])
    return shapes


def init_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights for `cfg`, in the config's dtype."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.torch_dtype)
    return {n: _init(n, s, gen).to(dtype) for n, s in weight_shapes(cfg).items()}


def save_weights(weights: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        str(directory / WEIGHTS_FILE),
        metadata={"format": "pt"},
    )


def shard_paths(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    single = directory / WEIGHTS_FILE
    if not single.exists():
        raise FileNotFoundError(
            f"{single} does not exist; write seeded weights with `met init-model {directory}`"
        )
    return [single]


# safetensors' dtype names; a tensor of another dtype is refused by name.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
}
FP8_NAME = "F8_E4M3"


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """A safetensors file's tensors (name -> dtype, shape, data_offsets) and where its data
    starts. Layout: u64 little-endian header length n, n bytes of JSON, then the data."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def checkpoint_index(directory: Path) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Every tensor of the checkpoint in `directory` -> its shard, shape and safetensors dtype
    name, from the headers alone."""
    return {
        n: (shard, tuple(e["shape"]), e["dtype"])
        for shard in shard_paths(directory)
        for n, e in read_header(shard)[0].items()
    }


def expected_tensors(
    cfg: ModelConfig, index: dict[str, tuple[Path, tuple[int, ...], str]]
) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """What the engine reads from a checkpoint of `cfg` whose headers are `index`: (every
    tensor's name -> shape, the weights held in FP8). A tensor missing, of another shape, in
    FP8 where it cannot be, or one the engine would not read is refused with a sentence naming
    it (the first by name), before any tensor is read."""
    expected = weight_shapes(cfg, expert_layout(index))
    fp8 = {n for n in expected if n in index and index[n][2] == FP8_NAME}
    for name in sorted(fp8):
        if cfg.quantization is None:
            raise ValueError(
                f"{name} is stored as float8_e4m3fn, but config.json has no quantization_config"
            )
        if not quantizable(name, expected[name]):
            raise ValueError(f"{name} is stored as float8_e4m3fn; only linear weights load as FP8")
        if cfg.quantization.keeps(name):
            raise ValueError(
                f"{name} is stored as float8_e4m3fn, but modules_to_not_convert keeps it "
                "unquantized"
            )
        expected[scale_name(name)] = scale_shape(expected[name])
    expected |= _tower_expected(cfg, index)
    missing = sorted(set(expected) - set(index))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, first {missing[0]!r}")
    for name, shape in expected.items():
        if index[name][1] != shape:
            raise ValueError(f"{name} has shape {index[name][1]}; the config says {shape}")
        if index[name][2] not in _DTYPES:
            raise ValueError(f"{name} is stored as {index[name][2]}, which is not supported")
    unread = set(index) - set(expected)
    unknown = sorted(n for n in unread if not _moot(cfg, n, index[n][1]))
    if unknown:
        raise ValueError(
            f"the checkpoint holds {unknown[0]!r}, which this engine would not read"
            f"{_unknown_hint(unknown[0], cfg)}; it refuses to drop a tensor without a word"
        )
    return expected, fp8


def _moot(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor the engine does not read cannot change what the model computes:
    transformers writes a shared expert of size 0 as empty tensors beside its gate, which
    scales that expert's zero output."""
    gate = name.endswith(".mlp.shared_expert_gate.weight")
    return not math.prod(shape) or (gate and not cfg.shared_expert_intermediate_size)


def _unknown_hint(name: str, cfg: ModelConfig) -> str:
    if name.endswith(SCALE_SUFFIX):
        return " (a scale beside a weight that is not stored as float8_e4m3fn)"
    if "scale" in name.rsplit(".", 1)[-1]:
        return " (a quantization scale of a kind this engine does not serve)"
    if name.startswith("mtp.") and not cfg.has_mtp:
        return " (an MTP head the config does not declare)"
    if name.startswith(VISION_PREFIX):
        return " (a vision tower the config does not declare)"
    return ""


def _read_tensors(shard: Path, wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `shard` named in `wanted`, in file order, each read into memory of its
    own (no mapping of the file stays resident behind it)."""
    header, start = read_header(shard)
    entries = sorted(
        ((n, e) for n, e in header.items() if n in wanted), key=lambda x: x[1]["data_offsets"][0]
    )
    with shard.open("rb") as f:
        for name, entry in entries:
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{name} is stored as {entry['dtype']}, which is not supported")
            begin, end = entry["data_offsets"]
            shape = tuple(entry["shape"])
            if begin == end:
                yield name, torch.empty(shape, dtype=dtype)
                continue
            f.seek(start + begin)
            data = bytearray(end - begin)
            f.readinto(data)
            yield name, torch.frombuffer(data, dtype=dtype).view(shape)


def _rank_part(
    cfg: ModelConfig, shard: Shard, name: str, expected: dict[str, tuple[int, ...]]
) -> tuple[int, list[int]] | None:
    """What the rank holds of tensor `name`; of an FP8 weight's scales, the blocks of its part."""
    if name.endswith(SCALE_SUFFIX):
        weight = name.removesuffix(SCALE_SUFFIX) + "weight"
        return tp_shard.scale_part(cfg, shard, weight, expected[weight])
    return tp_shard.part(cfg, shard, name, expected[name])


def _read_parts(
    path: Path, expected: dict[str, tuple[int, ...]], cfg: ModelConfig, shard: Shard
) -> Iterator[tuple[str, torch.Tensor]]:
    """`_read_tensors` for one tensor-parallel rank: of each tensor of `expected` (name ->
    shape), the runs of rows or columns the rank holds, each read through a safetensors slice
    (only its bytes leave the file)."""
    with safe_open(str(path), framework="pt") as f:
        for name in [n for n in f.keys() if n in expected]:  # noqa: SIM118 (safe_open has no iter)
            piece = f.get_slice(name)
            spec = _rank_part(cfg, shard, name, expected)
            if spec is None:
                yield name, piece[:].clone()
                continue
            dim, indices = spec
            lead = (slice(None),) * dim
            parts = [piece[(*lead, slice(a, b))] for a, b in tp_shard.runs(indices) or [(0, 0)]]
            yield name, torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone()


DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def serving_dtype(cfg: ModelConfig, dtype: str | None) -> torch.dtype:
    """`--dtype` (`fp32`, `bfloat16`, ...), or else the checkpoint's."""
    name = dtype or cfg.torch_dtype
    return getattr(torch, DTYPE_NAMES.get(name, name))


def served_config(cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """The config as served from a checkpoint holding tensors `names`: without `mtp.*` tensors
    the drafter is off (no MTP layer); without `model.visual.*` ones, the tower (the model
    serves text, and a prefill with images is refused)."""
    names = list(names)
    if cfg.vision is not None and not vision_tensors(cfg, names):
        cfg = replace(cfg, vision=None)
    if cfg.has_mtp and not any(n.startswith("mtp.") for n in names):
        return replace(cfg, num_nextn_predict_layers=0)
    return cfg


def stream_weights(
    cfg: ModelConfig,
    directory: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    shard: Shard | None = None,
) -> tuple[Iterator[tuple[str, torch.Tensor]], ModelConfig]:
    """The checkpoint's tensors one at a time, each on `device` in `dtype` (FP8 weights stay
    FP8 and their scales fp32), checked name by name, shape by shape and dtype by dtype against
    `cfg` before the first is read (`expected_tensors`). A checkpoint without `mtp.*` tensors
    loads with the drafter off (the returned config has no MTP layer). With a tensor-parallel
    `shard`, each tensor is only what that rank holds (`gpu_service/model/shard.py`), and only
    those bytes are read: under expert parallelism, none of the other ranks' experts."""
    index = checkpoint_index(directory)
    cfg = served_config(cfg, index)
    try:
        expected, fp8 = expected_tensors(cfg, index)
        if shard is not None:
            tp_shard.check(cfg, shard.size, shard.experts)
            fp8_shapes = {n: s for n, s in expected.items() if n in fp8}
            tp_shard.check_blocks(cfg, shard.size, fp8_shapes, shard.experts)
            # Under expert parallelism the other ranks' experts are never read.
            expected = {n: s for n, s in expected.items() if tp_shard.holds(cfg, shard, n)}
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None

    def kept_dtype(name: str) -> torch.dtype | None:
        if name in fp8:
            return None  # as stored
        return torch.float32 if name.endswith(SCALE_SUFFIX) else dtype

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for path in dict.fromkeys(index[n][0] for n in expected):
            if shard is None or shard.size == 1:
                tensors = _read_tensors(path, set(expected))
            else:
                tensors = _read_parts(path, expected, cfg, shard)
            for name, t in tensors:
                yield name, t.to(device=device, dtype=kept_dtype(name))

    return stream(), cfg


def load_weights(
    cfg: ModelConfig,
    directory: Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Every tensor of `stream_weights` at once, by HF name (training and tests; the engine
    streams them into its own layout)."""
    stream, cfg = stream_weights(cfg, directory, dtype, device)
    return dict(stream), cfg
