"""Which part of every tensor a tensor-parallel rank holds (the Megatron layout), from shapes
alone: what the loader reads, what the plan counts and what the tests check.

- Gated attention: q heads (with their output gate) split; KV heads split while the rank count
  divides them, and otherwise each rank holds the one KV head its q heads read (the flagship's 2
  KV heads at 4 ranks: 2 copies of each). `o_proj` is row-parallel: each rank reads its heads'
  columns.
- Gated DeltaNet: value heads split, each with its conv channels, `z` gate, `b`, `a`, `A_log`
  and `dt_bias`; a key head goes with its value heads (split while the rank count divides the
  key heads, one replicated key head a rank otherwise). Recurrent state and conv windows hold
  the rank's heads only. `out_proj` is row-parallel.
- SwiGLU MLPs (dense, shared expert, and every routed expert): the intermediate split,
  `gate`/`up` column-parallel, `down` row-parallel. By default the routed experts are split
  too: every rank runs the same routing over the same rows, so no rows cross between ranks.
- Under expert parallelism (`Shard.experts`, `--expert-parallel`) the routed experts are placed
  instead: rank r holds experts [r E / N, (r + 1) E / N) whole (full intermediate, FP8 with its
  own scale blocks), and none of the others (`holds`); their rows travel to it and back
  (`gpu_service/model/placement.py`). Everything else is split as above, the shared expert
  included.
- Embedding and LM head vocab-parallel: rank r holds ids [r * ceil(V / N), (r + 1) * ...).
- Everything else (norms, the router, the shared expert's gate, the MTP head's `fc`) replicated.
- A block-FP8 weight is split as its bf16 twin, and its `weight_scale_inv` by the 128 x 128
  blocks its rows or columns fall in (`scale_part`): a rank's rows and columns must be whole
  blocks (`check_blocks`), so that its part is an ordinary FP8 weight of the rank's config with
  scales of its own, and a row-parallel rank quantizes its activations in the 128 columns one
  device would. The routed experts' FP8 share runs as the bf16 one: the same routing on every
  rank, each rank's partial sum in expert order, the ranks' partials added in rank order.

A rank's tensors keep the checkpoint's layout for its own, smaller config (`rank_config`), so the
packing that follows does not know it is sharded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from gpu_service.model.config import ModelConfig
from gpu_service.tp import SIZES
from kernels.fp8.format import BLOCK


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    experts: bool = False  # expert parallelism: the routed experts placed, not split

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside 0 ..< {self.size}")


def _split(total: int, size: int, what: str) -> None:
    if total % size:
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide {what} ({total}); "
            "use a size that divides it"
        )


def _shared(total: int, size: int, what: str) -> int:
    """Heads a rank holds of `total` that may be replicated: total / size, or 1 when size is a
    multiple of total."""
    if size <= total:
        _split(total, size, what)
        return total // size
    if size % total:
        raise ValueError(
            f"--tensor-parallel-size {size} neither divides {what} ({total}) nor is a multiple "
            "of it; use a size that does either"
        )
    return 1


def _check_placed(cfg: ModelConfig, size: int) -> None:
    """Raises ValueError where `--expert-parallel` cannot place `cfg`'s experts on `size` ranks."""
    if size == 1:
        raise ValueError(
            "--expert-parallel places the routed experts over the ranks of "
            "--tensor-parallel-size, which is 1; give it 2 or more"
        )
    if not cfg.num_experts:
        raise ValueError("--expert-parallel: the model has no routed experts to place")
    if cfg.num_experts % size:
        raise ValueError(
            f"--expert-parallel at --tensor-parallel-size {size} does not divide num_experts "
            f"({cfg.num_experts}) into whole ranks' shares; use a size that divides it"
        )


def check(cfg: ModelConfig, size: int, experts: bool = False) -> None:
    """Raises ValueError naming what `size` ranks cannot split (with `experts`, place)."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size is {size}; it must be at least 1")
    if experts:
        _check_placed(cfg, size)
    if size == 1:
        return
    _split(cfg.num_attention_heads, size, "num_attention_heads")
    _split(cfg.linear_num_value_heads, size, "linear_num_value_heads")
    _split(cfg.intermediate_size, size, "intermediate_size")
    if not experts:
        _split(cfg.moe_intermediate_size, size, "moe_intermediate_size")
    _split(cfg.shared_expert_intermediate_size, size, "shared_expert_intermediate_size")
    kv = _shared(cfg.num_key_value_heads, size, "num_key_value_heads")
    keys = _shared(cfg.linear_num_key_heads, size, "linear_num_key_heads")
    if (cfg.num_attention_heads // size) % kv:
        raise ValueError("a rank's q heads would read more KV heads than it holds")
    if (cfg.linear_num_value_heads // size) % keys:
        raise ValueError("a rank's GDN value heads would read more key heads than it holds")


def rank_config(cfg: ModelConfig, size: int, experts: bool = False) -> ModelConfig:
    """The config of what one of `size` ranks holds: heads and intermediates divided (a
    replicated head counted once), the vocabulary as it is (ids stay global). With `experts`
    the routed experts keep their whole intermediate, and `num_experts` stays the router's
    count: which of them the rank holds is `expert_range`'s."""
    check(cfg, size, experts)
    if size == 1:
        return cfg
    return replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=_shared(cfg.num_key_value_heads, size, "num_key_value_heads"),
        linear_num_key_heads=_shared(cfg.linear_num_key_heads, size, "linear_num_key_heads"),
        linear_num_value_heads=cfg.linear_num_value_heads // size,
        intermediate_size=cfg.intermediate_size // size,
        moe_intermediate_size=cfg.moe_intermediate_size // (1 if experts else size),
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // size,
    )


def expert_range(num_experts: int, shard: Shard | None) -> range:
    """The routed experts rank `shard.rank` holds: every one (one device, or split by tensor
    parallelism), or under expert parallelism its contiguous share by id."""
    if shard is None or not shard.experts:
        return range(num_experts)
    per = num_experts // shard.size
    return range(shard.rank * per, (shard.rank + 1) * per)


def expert_of(name: str) -> int | None:
    """The expert a per-expert tensor belongs to (`...mlp.experts.7.up_proj.weight`, or its
    scales): 7; None for any other tensor."""
    _, sep, rest = name.partition(".experts.")
    number = rest.partition(".")[0]
    return int(number) if sep and number.isdigit() else None


def holds(cfg: ModelConfig, shard: Shard, name: str) -> bool:
    """Whether rank `shard.rank` holds any of tensor `name`: all but the other ranks' experts
    under expert parallelism."""
    expert = expert_of(name)
    return expert is None or expert in expert_range(cfg.num_experts, shard)


def vocab_range(vocab: int, shard: Shard) -> tuple[int, int]:
    """The token ids rank `shard.rank` holds of the embedding and the LM head."""
    per = -(-vocab // shard.size)
    return min(vocab, shard.rank * per), min(vocab, (shard.rank + 1) * per)


def _heads(total: int, shard: Shard) -> list[int]:
    per = total // shard.size
    return list(range(shard.rank * per, (shard.rank + 1) * per))


def _kv_heads(cfg: ModelConfig, shard: Shard) -> list[int]:
    """The KV heads the rank's q heads read."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    return list(dict.fromkeys(h // group for h in _heads(cfg.num_attention_heads, shard)))


def _value_heads(cfg: ModelConfig, shard: Shard) -> list[int]:
    return _heads(cfg.linear_num_value_heads, shard)


def _key_heads(cfg: ModelConfig, shard: Shard) -> dict[int, list[int]]:
    """Each key head the rank holds -> its value heads the rank holds, in order."""
    ratio = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    out: dict[int, list[int]] = {}
    for v in _value_heads(cfg, shard):
        out.setdefault(v // ratio, []).append(v)
    return out


def _spans(width: int, heads: list[int], base: int = 0) -> list[int]:
    return [base + h * width + i for h in heads for i in range(width)]


def _qkvz_rows(cfg: ModelConfig, shard: Shard) -> list[int]:
    """in_proj_qkvz is laid out per key head [q, k, v of its value heads, z of them]."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    ratio = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    group = 2 * dk + 2 * ratio * dv
    rows: list[int] = []
    for g, values in _key_heads(cfg, shard).items():
        start, local = g * group, [v - g * ratio for v in values]
        rows += range(start, start + 2 * dk)
        rows += _spans(dv, local, start + 2 * dk)
        rows += _spans(dv, local, start + 2 * dk + ratio * dv)
    return rows


def _ba_rows(cfg: ModelConfig, shard: Shard) -> list[int]:
    """in_proj_ba is laid out per key head [b of its value heads, a of them]."""
    ratio = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    rows: list[int] = []
    for g, values in _key_heads(cfg, shard).items():
        local = [v - g * ratio for v in values]
        rows += [g * 2 * ratio + j for j in local] + [g * 2 * ratio + ratio + j for j in local]
    return rows


def _conv_rows(cfg: ModelConfig, shard: Shard) -> list[int]:
    """conv1d's channels are [q of every key head, k of them, v of every value head]."""
    keys = list(_key_heads(cfg, shard))
    dk, kd = cfg.linear_key_head_dim, cfg.key_dim
    return (
        _spans(dk, keys)
        + _spans(dk, keys, kd)
        + _spans(cfg.linear_value_head_dim, _value_heads(cfg, shard), 2 * kd)
    )


def _inner(total: int, shard: Shard) -> list[int]:
    per = total // shard.size
    return list(range(shard.rank * per, (shard.rank + 1) * per))


def part(
    cfg: ModelConfig, shard: Shard, name: str, shape: tuple[int, ...]
) -> tuple[int, list[int]] | None:
    """What rank `shard.rank` holds of checkpoint tensor `name` of `shape`: (dim, the indices
    along it, in order), or None where it holds the whole tensor."""
    if shard.size == 1:
        return None
    name = cfg.canonical(name)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, list(range(*vocab_range(shape[0], shard)))
    d, tail = cfg.head_dim, name.rpartition(".")[0]
    kind = tail.rpartition(".")[2] if name.endswith(".weight") else name.rpartition(".")[2]
    hq = _heads(cfg.num_attention_heads, shard)
    if kind == "q_proj":
        return 0, _spans(2 * d, hq)
    if kind in ("k_proj", "v_proj"):
        return 0, _spans(d, _kv_heads(cfg, shard))
    if kind == "o_proj":
        return 1, _spans(d, hq)
    if kind == "in_proj_qkvz":
        return 0, _qkvz_rows(cfg, shard)
    if kind == "in_proj_ba":
        return 0, _ba_rows(cfg, shard)
    if kind in ("conv1d", "in_proj_qkv"):  # Qwen3.5's in_proj_qkv is [q, k, v] as conv1d is
        return 0, _conv_rows(cfg, shard)
    if kind in ("A_log", "dt_bias", "in_proj_b", "in_proj_a"):
        return 0, _value_heads(cfg, shard)
    if kind == "in_proj_z":
        return 0, _spans(cfg.linear_value_head_dim, _value_heads(cfg, shard))
    if len(shape) == 3:  # stacked experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        if shard.experts:
            return 0, list(expert_range(shape[0], shard))
        if kind == "gate_up_proj":
            inner = shape[1] // 2
            return 1, _inner(inner, shard) + [inner + i for i in _inner(inner, shard)]
        return 2, _inner(shape[2], shard)
    if kind == "out_proj":
        return 1, _spans(cfg.linear_value_head_dim, _value_heads(cfg, shard))
    if shard.experts and expert_of(name) is not None:
        return None  # a placed expert is held whole, by the rank `holds` names
    if kind in ("gate_proj", "up_proj"):
        return 0, _inner(shape[0], shard)
    if kind == "down_proj":
        return 1, _inner(shape[1], shard)
    return None


def runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted-or-not indices -> [start, stop) runs of consecutive ones, in order."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def scale_part(
    cfg: ModelConfig, shard: Shard, name: str, shape: tuple[int, ...]
) -> tuple[int, list[int]] | None:
    """What rank `shard.rank` holds of the `weight_scale_inv` of FP8 weight `name` [out, in]:
    the blocks its rows or columns (`part`) fall in, whole where `check_blocks` passed."""
    spec = part(cfg, shard, name, shape)
    if spec is None:
        return None
    dim, indices = spec
    return dim, list(dict.fromkeys(i // BLOCK for i in indices))


def _cut(indices: list[int], total: int) -> tuple[int, int] | None:
    """The first run of `indices` (of `total`) that does not start and end on a block edge, as
    [start, stop); only the tensor's own short last block may end a rank's last run."""
    spans = runs(indices)
    for n, (start, stop) in enumerate(spans):
        last = stop == total and n == len(spans) - 1
        if start % BLOCK or (stop % BLOCK and not last):
            return start, stop
    return None


def _kinds(fp8: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """One FP8 weight of each kind and shape: a rank's part follows neither the layer nor the
    expert, so the first of each stands for the rest (the largest models hold 92k of them)."""
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    for name, shape in fp8.items():
        seen.setdefault((re.sub(r"\.\d+\.", ".#.", name), shape), name)
    return {name: shape for (_, shape), name in seen.items()}


def _block_cut(
    cfg: ModelConfig, shard: Shard, kinds: dict[str, tuple[int, ...]]
) -> tuple[str, int, int, tuple[int, int]] | None:
    """The first FP8 weight of `kinds` of which a rank of `shard.size` (placing the experts as
    `shard` does) would hold part of a block: (its name, the rank, the dim, the run that cuts),
    or None."""
    for name, shape in kinds.items():
        for rank in range(shard.size):
            spec = part(cfg, replace(shard, rank=rank), name, shape)
            cut = None if spec is None else _cut(spec[1], shape[spec[0]])
            if spec is not None and cut is not None:
                return name, rank, spec[0], cut
    return None


def _splits(cfg: ModelConfig, shard: Shard, kinds: dict[str, tuple[int, ...]]) -> bool:
    try:
        check(cfg, shard.size, shard.experts)
    except ValueError:
        return False
    return _block_cut(cfg, shard, kinds) is None


def check_blocks(
    cfg: ModelConfig, size: int, fp8: dict[str, tuple[int, ...]], experts: bool = False
) -> None:
    """Raises ValueError where `size` ranks (with `experts`, placing the routed experts) would
    cut a scale block of an FP8 weight of `fp8` (name -> [out, in]), naming the weight and the
    sizes of `SIZES` that split every one on block edges."""
    kinds = _kinds(fp8) if size > 1 else {}
    cut = _block_cut(cfg, Shard(0, size, experts), kinds)
    if cut is None:
        return
    name, rank, dim, (start, stop) = cut
    fits = [str(n) for n in SIZES if _splits(cfg, Shard(0, n, experts), kinds)]
    if not fits:
        sizes = "no size of --tensor-parallel-size " + ", ".join(map(str, SIZES))
    elif len(fits) > 1:
        sizes = "--tensor-parallel-size " + ", ".join(fits[:-1]) + f" or {fits[-1]}"
    else:
        sizes = f"--tensor-parallel-size {fits[0]}"
    raise ValueError(
        f"{name} is FP8 in {BLOCK} x {BLOCK} scale blocks, and at --tensor-parallel-size {size} "
        f"rank {rank} would hold its {('rows', 'columns')[dim]} {start} to {stop - 1}, which cut "
        f"a block; {sizes} splits every FP8 weight on block edges"
    )
