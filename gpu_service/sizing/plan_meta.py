"""The model and a DFlash drafter built on the `meta` device as the engine builds them, for the
memory plan and the kernels' report to count and drive (`plan.py`)."""

from __future__ import annotations

import torch

from gpu_service.dflash.config import DFlashConfig
from gpu_service.dflash.model import DFlashModel
from gpu_service.dflash.weights import expected_tensors as expected_tensors_dflash
from gpu_service.model.config import ModelConfig
from gpu_service.model.hybrid import HybridModel, held_bytes
from gpu_service.model.quantization import fp8_names, scale_name, scale_shape
from gpu_service.model.shard import Shard, check_blocks, holds, part, rank_config
from gpu_service.model.weights import PER_EXPERT, STACKED, weight_shapes
from gpu_service.sizing.plan_graphs import META
from gpu_service.tp.group import TpGroup
from kernels.fp8.naive import FP8

__all__ = ["META", "by_dtype", "meta_drafter", "meta_model", "rank_shapes"]


class MetaGroup(TpGroup):
    """Rank 0 of `size`, for a model on the meta device that the plan counts and never runs:
    it tells the model which token ids it holds (`HybridModel.vocab`). It has no peers."""

    def __init__(self, size: int, expert_parallel: bool = False) -> None:
        self.rank, self.size, self.reduce_mode, self.device = 0, size, "ordered", META
        self.expert_parallel = expert_parallel

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """What every rank would send, as shapes alone: what a model built on `meta` asks of
        its peers while it loads (the DFlash drafter's mask row is a reduced embedding)."""
        return [torch.empty_like(x) for _ in range(self.size)]

    def exchange(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """The rows the ranks would send here, as a shape alone."""
        return x.new_empty(sum(receive), *x.shape[1:])


def rank_shapes(
    cfg: ModelConfig, size: int, experts: bool = False, layout: str = PER_EXPERT
) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor of `cfg` whose experts are laid out as `layout` that rank 0 of
    `size` reads, as it reads it (`tp.shard.part`); with `experts`, its share of the routed
    experts only."""
    shard, out = Shard(0, size, experts), {}
    for name, shape in weight_shapes(cfg, layout).items():
        if not holds(cfg, shard, name):
            continue
        spec = part(cfg, shard, name, shape)
        if spec is not None:
            dim, indices = spec
            shape = (*shape[:dim], len(indices), *shape[dim + 1 :])
        out[name] = shape
    return out


def meta_model(
    cfg: ModelConfig, dtype: torch.dtype, max_context: int, size: int = 1, experts: bool = False
) -> HybridModel:
    """Rank 0 of `size`'s model on `meta`, its weights as it reads them from a checkpoint of
    `cfg`: in `dtype`, or in FP8 with their scales where the config quantizes them (a rank's
    scales are the blocks of its rows and columns); with `experts`, the routed experts placed
    (`--expert-parallel`). ValueError where `size` does not split `cfg` (`tp.shard.check`) or
    would cut an FP8 weight's scale block (`check_blocks`)."""
    held = rank_config(cfg, size, experts)
    whole = weight_shapes(cfg)
    fp8 = fp8_names(cfg.quantization, whole)
    check_blocks(cfg, size, {n: s for n, s in whole.items() if n in fp8}, experts)
    # Experts in FP8 come one tensor each, with their scales; else stacked (`STACKED`): the
    # same kept tensors from 2 tensors a layer rather than 3 E, a plan of the largest in seconds.
    layout = PER_EXPERT if any(".experts." in n for n in fp8) else STACKED
    shapes = rank_shapes(cfg, size, experts, layout)
    weights = {}
    for name, shape in shapes.items():
        if name in fp8:
            weights[name] = torch.empty(shape, dtype=FP8, device=META)
            scales = torch.empty(scale_shape(shape), dtype=torch.float32, device=META)
            weights[scale_name(name)] = scales
        else:
            weights[name] = torch.empty(shape, dtype=dtype, device=META)
    group = None if size == 1 else MetaGroup(size, experts)
    return HybridModel(held, weights, max_context, group)


def meta_drafter(cfg: DFlashConfig, model: HybridModel, max_context: int) -> DFlashModel:
    """The DFlash drafter on `meta` as the engine holds it beside `model`."""
    weights = {
        name: torch.empty(shape, dtype=model.dtype, device=META)
        for name, shape in expected_tensors_dflash(cfg).items()
    }
    return DFlashModel(cfg, weights, model.embed_rows, model.dtype, META, max_context)


def by_dtype(tensors: list[torch.Tensor]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tensors:
        name = str(t.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + held_bytes([t])
    return out
