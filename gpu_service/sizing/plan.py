"""The service's memory plan: the bytes of every part it allocates, from shapes alone.

The model and the `DeviceState` are built on the `meta` device as the engine builds them, and
their tensors counted: the plan counts what the engine allocates. What only a call sizes (the
logits, the verify hiddens, the captured graphs' buffers, activations) is sized here from the
same settings. `met gpu-service plan` prints a plan; `serve` makes one before loading a weight
and refuses to start when it does not fit the device (`plan_report.py` words them).

Under tensor parallelism (`--tensor-parallel-size N`) the plan is one rank's, the largest (rank
0: the vocabulary's remainder falls short on the last), against one device: each rank has its
own. With `--expert-parallel` that rank holds its E / N routed experts whole, and its workspace
the exchange's buffers (`plan_graphs.exchange_bytes`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gpu_service.dflash.config import DFlashConfig, read_config
from gpu_service.engine.penalties import device_bytes
from gpu_service.engine.verifier import SCORE_ROWS
from gpu_service.model.config import (
    DFLASH_VERIFY_TIERS,
    ModelConfig,
    ServiceConfig,
    parse_tiers,
    read_json,
)
from gpu_service.model.hybrid import HybridModel, held_bytes
from gpu_service.model.ops import padded_rows
from gpu_service.model.state import DeviceState
from gpu_service.model.weights import (
    checkpoint_index,
    expected_tensors,
    served_config,
    serving_dtype,
)
from gpu_service.sizing import MAX_AUTO_SLOTS
from gpu_service.sizing.plan_graphs import (
    META,
    activation_bytes,
    exchange_bytes,
    graph_parts,
    split_workspace_bytes,
)
from gpu_service.sizing.plan_meta import by_dtype, meta_drafter, meta_model
from gpu_service.sizing.plan_vision import vision_bytes
from kernels.attention.format import KEY_BLOCK
from protos.hub import model_name

# `--kv-blocks auto` plans this share of the device memory: the rest is the allocator's and
# the CUDA context's, which no tensor counts (vLLM's gpu_memory_utilization is 0.9).
AUTO_BLOCKS_SHARE = 0.95
# Each part's key (in `--json`) and its line in the report; `total_bytes` is their sum.
PARTS = {
    "weights_bytes": "weights",
    "dflash_weights_bytes": "DFlash drafter weights",
    "vision_weights_bytes": "vision tower weights",
    "kv_cache_bytes": "attention KV cache",
    "gdn_state_bytes": "GDN live state",
    "conv_state_bytes": "GDN conv windows",
    "verify_bytes": "verify tiers (GDN + conv)",
    "drafter_kv_bytes": "drafter KV",
    "dflash_kv_bytes": "DFlash context KV",
    "snapshot_bytes": "prefix snapshots",
    "logits_bytes": "logits",
    "score_bytes": "logprob rows",
    "penalty_bytes": "penalty counts",
    "stash_bytes": "stash, verify hiddens, carry",
    "rope_bytes": "RoPE table",
    "graphs_bytes": "captured graphs",
    "workspace_bytes": "activation workspace",
    "vision_bytes": "vision tower activations",
    "other_state_bytes": "other device state",
}
# DeviceState's tensors by part; one this table does not name counts as other device state.
STATE_PARTS = {
    "k_cache": "kv_cache_bytes",
    "v_cache": "kv_cache_bytes",
    "block_table": "kv_cache_bytes",
    "gdn": "gdn_state_bytes",
    "conv": "conv_state_bytes",
    "verify_gdn": "verify_bytes",
    "verify_conv": "verify_bytes",
    "verify_offset_t": "verify_bytes",
    "mtp_k": "drafter_kv_bytes",
    "mtp_v": "drafter_kv_bytes",
    "mtp_valid": "drafter_kv_bytes",
    "dflash_k": "dflash_kv_bytes",
    "dflash_v": "dflash_kv_bytes",
    "logits": "logits_bytes",
    "stash": "stash_bytes",
    "mtp_carry": "stash_bytes",
    "snap_gdn": "snapshot_bytes",
    "snap_conv": "snapshot_bytes",
    "snap_carry": "snapshot_bytes",
    "verify_hidden": "stash_bytes",
    "rope_shift": "stash_bytes",  # a slot's RoPE shift: as small as its carry, and beside it
}


@dataclass(frozen=True)
class Memory:
    """What the plan must fit: `--device-memory`, or the CUDA device's free memory."""

    bytes: int | None  # None: not known (the CPU), no verdict
    source: str = ""  # `--device-memory`, or the device: `cuda:0`


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    dtype: torch.dtype
    svc: ServiceConfig
    graphs: bool  # whether captured graphs are counted
    parts: dict[str, int]  # bytes by PARTS key
    weights_by_dtype: dict[str, int]
    num_graphs: int  # graphs a service can capture over its life (they are captured on use)
    memory: Memory
    seconds: float = 0.0
    quantization: str = ""  # the checkpoint's, as Capabilities names it; "" when none
    tensor_parallel_size: int = 1  # ranks; every part is one rank's
    # The context the model was built for, where the plan lowered `svc.max_context` from it.
    model_context: int = 0
    expert_parallel: bool = False  # the routed experts placed on the ranks, not split
    experts_per_rank: int = 0  # routed experts a rank holds (every one, but under EP)
    expert_bytes: int = 0  # of `weights_bytes`, the routed experts' (with their FP8 scales)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool | None:
        return None if self.memory.bytes is None else self.total <= self.memory.bytes


# -- the model ---------------------------------------------------------------------------


def load_config(path: Path) -> ModelConfig:
    """A checkpoint directory's config as the engine serves it (the drafter off when its
    weights lack `mtp.*`, as `load_weights` decides), or a bare config.json's as written."""
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not path.is_dir():
        return ModelConfig.from_dict(read_json(path))
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json")
    cfg = ModelConfig.load(path)
    try:
        index = checkpoint_index(path)
    except FileNotFoundError:  # a directory with no weights yet: the config as written
        return cfg
    cfg = served_config(cfg, index)
    expected_tensors(cfg, index)  # what the engine would refuse is refused before it loads
    return cfg


# -- what the slots own ------------------------------------------------------------------


def state_bytes(state: DeviceState) -> dict[str, int]:
    """Bytes of every tensor `state` holds, by part."""
    out = dict.fromkeys([*STATE_PARTS.values(), "other_state_bytes"], 0)
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            out[STATE_PARTS.get(name, "other_state_bytes")] += value.numel() * value.element_size()
    return out


def slot_parts(
    model: HybridModel, svc: ServiceConfig, graphs: bool, drafter: DFlashConfig | None = None
) -> tuple[dict[str, int], int]:
    """The parts that grow with the slots -> (bytes by part, graphs): the device state's, the
    captured graphs' (when counted), and the buffers a call sizes beside them: the logits of
    the largest call [rows, vocab] (a verify's row budget, or a prefill's one row per
    sequence), twice, since the last call's are kept while the next call's are made; the
    verify's final hiddens [max_rows, hidden], kept for the stash. Under tensor parallelism a
    rank's logits are its token ids' columns, and reading them back gathers every rank's
    (padded to the widest) beside the kept ones."""
    cfg, size = model.cfg, model.dtype.itemsize
    state = DeviceState(cfg, svc, model.dtype, META)
    if drafter is not None:
        state.add_dflash_pool(
            drafter.num_hidden_layers, drafter.num_key_value_heads, drafter.head_dim
        )
    out = state_bytes(state)
    logits_rows = padded_rows(max(svc.max_rows, min(svc.num_slots, svc.max_prefill_tokens)))
    kept = logits_rows * (model.vocab[1] - model.vocab[0]) * size
    ranks = 1 if model.tp is None else model.tp.size
    gathered = 0 if ranks == 1 else ranks * kept + logits_rows * cfg.vocab_size * size
    out["logits_bytes"] += kept + max(kept, gathered)
    # Log-probabilities beside a call, the larger of two that never run together: a prompt's
    # scores (prompt logprobs) beside a prefill, a tile's logits, gathered whole under tensor
    # parallelism, then their fp32 log-softmax and its comparison with the scored tokens'; and
    # a verify's rows that list alternatives or sample (logprobs under speculation), every row
    # of the budget at most, their logits gathered whole and their fp32 log-softmax.
    shard = SCORE_ROWS * (model.vocab[1] - model.vocab[0]) * size
    tile = SCORE_ROWS * cfg.vocab_size
    prompt_scores = tile * (size + 4 + 1) + (0 if ranks == 1 else shard)
    verify_scores = padded_rows(svc.max_rows) * cfg.vocab_size * (size + 4)
    out["score_bytes"] = max(prompt_scores, verify_scores)
    out["stash_bytes"] += padded_rows(svc.max_rows) * cfg.hidden_size * size
    out["penalty_bytes"], _ = device_bytes(model.vocab[1] - model.vocab[0], svc.num_slots, 0)
    # A prefill's images: the tower's activations at the largest, the embeddings held.
    out["vision_bytes"] = vision_bytes(cfg, svc, size)
    num_graphs, out["graphs_bytes"] = graph_parts(model, state, svc) if graphs else (0, 0)
    return out, num_graphs


# -- the plan --------------------------------------------------------------------------------


def most_slots(fits: Callable[[int], bool]) -> int:
    """The largest slot count, up to MAX_AUTO_SLOTS, for which `fits` (false from some count
    on); 1 where none fits."""
    lo, hi = 0, MAX_AUTO_SLOTS + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return max(lo, 1)


def most_blocks(
    model: HybridModel,
    svc: ServiceConfig,
    graphs: bool,
    room: int,
    drafter: DFlashConfig | None = None,
) -> int:
    """The KV pool's blocks that fit `room` beside the other per-slot parts, up to every
    slot's whole context (a block more is of no use); 1 where none fits."""
    one, _ = slot_parts(model, replace(svc, kv_blocks=1), graphs, drafter)
    two, _ = slot_parts(model, replace(svc, kv_blocks=2), graphs, drafter)
    per_block = sum(two.values()) - sum(one.values())
    full = svc.num_slots * svc.blocks_per_sequence
    return max(1, min(full, 1 + (room - sum(one.values())) // per_block))


def most_context(
    model: HybridModel,
    svc: ServiceConfig,
    graphs: bool,
    room: int,
    drafter: DFlashConfig | None = None,
) -> int:
    """The largest context, in key blocks up to `svc.max_context`, at which the per-slot parts
    fit `room` (the KV pool holds every slot's whole context unless `--kv-blocks` sizes it);
    the model's RoPE table, built for `svc.max_context`, is counted whole. One block where none
    fits: the plan then says what does not."""

    def fits(blocks: int) -> bool:
        parts, _ = slot_parts(model, replace(svc, max_context=blocks * KEY_BLOCK), graphs, drafter)
        return sum(parts.values()) <= room

    lo, hi = 0, svc.max_context // KEY_BLOCK + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return max(lo, 1) * KEY_BLOCK


@dataclass(frozen=True)
class Auto:
    """What a plan settles from a known memory rather than from its flags."""

    slots: bool = False  # --num-slots auto
    blocks: bool = False  # --kv-blocks auto
    context: bool = False  # no --max-context: the model's, lowered to what fits


def _settled(
    model: HybridModel,
    svc: ServiceConfig,
    graphs: bool,
    memory: int,
    fixed: int,
    auto: Auto,
    drafter: DFlashConfig | None = None,
) -> ServiceConfig:
    """`svc` with what `auto` leaves to the memory settled against `memory` less the `fixed`
    parts: the context first (unless the KV pool is sized by memory, which then caps it), the
    slots, then the pool's blocks (in `AUTO_BLOCKS_SHARE` of the memory)."""
    room = memory - fixed
    if auto.context and not auto.blocks:
        svc = replace(svc, max_context=most_context(model, svc, graphs, room, drafter))
    if auto.slots:

        def fits(n: int) -> bool:
            parts, _ = slot_parts(model, replace(svc, num_slots_override=n), graphs, drafter)
            return sum(parts.values()) <= room

        svc = replace(svc, num_slots_override=most_slots(fits))
    if auto.blocks:
        share = int(memory * AUTO_BLOCKS_SHARE) - fixed
        svc = replace(svc, kv_blocks=most_blocks(model, svc, graphs, share, drafter))
        if auto.context:  # a sequence may reach no further than the pool holds
            svc = replace(svc, max_context=min(svc.max_context, svc.num_kv_blocks * KEY_BLOCK))
    return svc


def _fixed_parts(
    model: HybridModel,
    svc: ServiceConfig,
    dtype: torch.dtype,
    weights: dict[str, int],
    drafter: DFlashConfig | None,
) -> dict[str, int]:
    """The parts that do not grow with the slots: the weights (and a DFlash drafter's), the
    RoPE table, and the workspace of the largest call (under expert parallelism, with the
    exchange's buffers)."""
    cfg = model.cfg

    def activations(rows: int) -> int:
        placed = exchange_bytes(cfg, rows, dtype.itemsize) if model.placed else 0
        return activation_bytes(cfg, rows, dtype.itemsize) + placed

    return {
        "weights_bytes": sum(weights.values()),
        "rope_bytes": held_bytes([model.rope]),
        # A prefill's activations, or a verify's with its split kernels' partials, or the
        # penalties of its rows once its logits are made: never two at once.
        "workspace_bytes": max(
            activations(padded_rows(svc.max_prefill_tokens)),
            activations(padded_rows(svc.max_rows))
            + split_workspace_bytes(model, padded_rows(svc.max_rows)),
            device_bytes(model.vocab[1] - model.vocab[0], 0, svc.max_rows)[1],
            # A block propose: a block of rows for each of a batch's sequences.
            activation_bytes(cfg, padded_rows(svc.max_batch * drafter.block_size), dtype.itemsize)
            if drafter is not None
            else 0,
        ),
        "dflash_weights_bytes": 0
        if drafter is None
        else held_bytes(meta_drafter(drafter, model, svc.max_context).held),
    }


def make_plan(
    name: str,
    cfg: ModelConfig,
    svc: ServiceConfig,
    dtype: torch.dtype,
    graphs: bool,
    memory: Memory,
    auto: bool = False,
    size: int = 1,
    auto_blocks: bool = False,
    auto_context: bool = False,
    drafter: DFlashConfig | None = None,
    experts: bool = False,
) -> MemoryPlan:
    """The plan of serving `cfg` with `svc` in `dtype` over `size` ranks (one rank's; with
    `experts`, the routed experts placed on them, `--expert-parallel`); with
    `auto` and a known memory, at the most slots whose plan fits it; with `auto_blocks`, the KV
    pool as large as the rest leaves room for (`most_blocks`); with `auto_context`, the
    model's context (`svc.max_context`) lowered to what a known memory holds (`most_context`);
    with `drafter`, a DFlash drafter's weights, its context KV and its block's activations.
    The model is built once, however many counts that tries. ValueError where `size` does not
    split `cfg`."""
    start = time.perf_counter()
    model_context = svc.max_context if auto_context else 0
    graphs = graphs and size == 1  # the engine captures none under tensor parallelism
    model = meta_model(cfg, dtype, svc.max_context, size, experts)
    cfg = model.cfg
    weights = by_dtype(model.held_tensors())
    fixed = _fixed_parts(model, svc, dtype, weights, drafter)
    # The tower, whole on every rank, in the serving dtype (an FP8 one dequantized).
    fixed["vision_weights_bytes"] = cfg.vision_params * dtype.itemsize
    if memory.bytes is not None:
        settle = Auto(auto, auto_blocks, auto_context)
        svc = _settled(model, svc, graphs, memory.bytes, sum(fixed.values()), settle, drafter)
    parts, num_graphs = slot_parts(model, svc, graphs, drafter)
    parts |= fixed
    return MemoryPlan(
        name,
        dtype,
        svc,
        graphs,
        {key: parts[key] for key in PARTS},
        weights,
        num_graphs,
        memory,
        time.perf_counter() - start,
        cfg.quantization.name if cfg.quantization else "",
        size,
        model_context if svc.max_context < model_context else 0,
        experts,
        len(model.experts),
        routed_expert_bytes(model),
    )


def routed_expert_bytes(model: HybridModel) -> int:
    """The bytes of the routed experts `model` holds (FP8 with their scales and groups)."""
    held = model.named_held()
    return held_bytes([t for name, t in held.items() if ".experts.w" in name])


def model_context(cfg: ModelConfig) -> int:
    """The context a model was built for (its max_position_embeddings), in whole key blocks."""
    return max(KEY_BLOCK, cfg.max_position_embeddings // KEY_BLOCK * KEY_BLOCK)


def service_config(args: argparse.Namespace, cfg: ModelConfig) -> ServiceConfig:
    """The service's settings from its flags (`--num-slots auto` is the plan's to settle, and
    so is the context when `--max-context` is not given: `cfg`'s, then what memory holds);
    ValueError with a sentence on a bad one."""
    tiers = args.verify_tiers or (
        DFLASH_VERIFY_TIERS if getattr(args, "drafter", None) else ServiceConfig.verify_tiers
    )
    parse_tiers(tiers)
    return ServiceConfig(
        verify_tiers=tiers,
        max_context=args.max_context or model_context(cfg),
        kv_blocks=args.kv_blocks if isinstance(args.kv_blocks, int) else 0,
        prefix_snapshots=args.prefix_snapshots,
        max_rows=args.max_rows,
        max_batch=args.max_batch,
        max_prefill_tokens=args.max_prefill_tokens,
        cuda_graphs=args.cuda_graphs,
        compile_cache=str(args.compile_cache or ""),
        num_slots_override=args.num_slots if isinstance(args.num_slots, int) else None,
        max_images_per_prompt=args.limit_images_per_prompt,
        max_image_pixels=args.max_image_pixels,
    )


def from_args(args: argparse.Namespace, device: torch.device, graphs: bool) -> MemoryPlan:
    """The plan of what `serve`'s flags (or `plan`'s, the same) ask for on `device`. Raises
    ValueError or OSError with a sentence: a bad flag, an unreadable config, a
    `--tensor-parallel-size` that does not split the model."""
    cfg = load_config(args.model)
    name = model_name(args.model) if args.model.is_dir() else str(args.model)
    svc = service_config(args, cfg)
    dtype = serving_dtype(cfg, args.dtype)
    memory = device_memory(args.device_memory, device)
    auto, size = args.num_slots == "auto", args.tensor_parallel_size
    experts = bool(getattr(args, "expert_parallel", False))
    blocks, context = args.kv_blocks == "auto", args.max_context is None
    # The drafter's shapes: its config alone (a plan reads no weights).
    drafter = None
    if args.drafter is not None:
        drafter = read_config(args.drafter, cfg)
    return make_plan(
        name, cfg, svc, dtype, graphs, memory, auto, size, blocks, context, drafter, experts
    )


def device_memory(given: int | None, device: torch.device) -> Memory:
    if given is not None:
        return Memory(given, "--device-memory")
    if device.type == "cuda":
        return Memory(torch.cuda.mem_get_info(device)[0], str(device))
    return Memory(None)
