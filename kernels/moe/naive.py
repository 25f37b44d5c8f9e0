"""Qwen3-Next's routed experts in plain torch: the router's top-k, and each expert's SwiGLU MLP
over only the rows routed to it, the eager forward's path and the reference of the fused Triton
kernel beside it.

Pairs (row, expert) are stably sorted by expert and each expert's run padded to `ROW_TILE` rows
(the CPU GEMM then gives a row the same bytes whatever rows share the call); one grouped GEMM
runs a GEMM per expert hit over its run (on the CPU, where each call costs microseconds of
dispatch, small experts' runs go instead through batched GEMMs over copies of their
weights: the same bytes); a row's contributions are then added in increasing expert-index
order, so a row's bytes depend on neither its batch nor the other rows' experts.
Adding the experts a row did not choose would add exact zeros: this is the dense sum over every
expert, byte for byte (`dense_moe`, kept to prove it).

Expert weights may be block FP8 (`BlockFp8`, stacked `[E, K, N]`): each expert's GEMM is then
`fp8_linear`'s math over its rows, the rows quantized each on its own and the product summed K
block by K block, with only the experts hit upcast, one K block of a bounded number of them at
a time. The same two ways serve on the CPU, and give the same bytes; off it the blocks go
through batched GEMMs of one shape, without reading the alignment to the host.
"""

from __future__ import annotations

from typing import NamedTuple, overload

import torch
import torch.nn.functional as F

from kernels.common import ROW_TILE, silu
from kernels.fp8.naive import BLOCK, FP8, BlockFp8, blocks, fp8_linear, quantize_rows, upcast

# An expert stack: plain `[E, K, N]` in the activations' dtype, or block FP8.
Experts = torch.Tensor | BlockFp8

# A CPU GEMM call costs some microseconds of dispatch whatever its size, about what copying this
# many bytes of weights costs: below it per block, copying each block's expert weights out for
# one batched GEMM beats a GEMM per expert hit.
CALL_BYTES = 64 * 1024
# The expert weights copied for one batched GEMM: half a core's L2 here, so that the GEMM reads
# the copies from cache rather than from memory, where they would have been written back.
COPY_BYTES = 1 << 20
# Copying an FP8 weight and upcasting it to fp32 (`_upcast`) costs about what copying this many
# bytes does.
UPCAST_BYTES = 8
# Off the CPU, the fp32 K-block tiles of the FP8 blocks one batched GEMM takes, every call
# padded to that shape: a GPU library may pick its kernel by the batch, so a block's bytes would
# otherwise depend on how many blocks share its call.
DEVICE_TILE_BYTES = 64 << 20


class Aligned(NamedTuple):
    """The pairs sorted by expert, each expert's run padded to a multiple of the block rows."""

    pairs: torch.Tensor  # [bound] int64: pair index row * k + j; P * k marks padding
    block_experts: torch.Tensor  # [bound / BM] int64: each block's expert; E past `num_used`
    num_used: torch.Tensor  # [1] int64: entries used, a multiple of BM
    ends: torch.Tensor  # [E] int32: where each expert's padded run ends (its start: the last's)


def padded_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most entries `align` can use, a multiple of `block_m`: each expert hit pads at most
    `block_m - 1` entries, and at most min(E, P * k) experts are hit."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """experts: [P, k] int64 -> the pairs sorted by expert, padded per expert to `block_m`."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    bound = padded_bound(num_pairs, num_experts, block_m)
    sorted_experts, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    # [P k]: an entry's place is its expert's padded start plus its rank among the expert's pairs
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank
    pairs = torch.full((bound,), num_pairs, dtype=torch.int64, device=flat.device)
    pairs.scatter_(0, dest, order)
    block_starts = torch.arange(0, bound, block_m, device=flat.device)
    block_experts = torch.searchsorted(ends, block_starts, right=True)
    return Aligned(pairs, block_experts, ends[-1:].clone(), ends.to(torch.int32))


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [P, E] fp32 -> (weights [P, k] fp32, experts [P, k] int64): softmax, the k most
    probable experts, renormalised to sum to 1 when asked (in the top-k's order), then each
    row's experts sorted by increasing index, their weights alike."""
    probs = torch.softmax(logits, -1)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    experts, order = experts.sort(-1)
    return weights.gather(-1, order), experts


@overload
def expert_weight(w: BlockFp8, e: int) -> BlockFp8: ...
@overload
def expert_weight(w: torch.Tensor, e: int) -> torch.Tensor: ...
def expert_weight(w: Experts, e: int) -> Experts:
    """Expert `e`'s weight of a stack: [K, N], block FP8 with its own scales where `w` is."""
    if isinstance(w, BlockFp8):
        return BlockFp8(w.weight[e], w.scales[e], w.groups)
    return w[e]


def _mm(x: torch.Tensor, w: torch.Tensor | BlockFp8) -> torch.Tensor:
    return fp8_linear(x, w) if isinstance(w, BlockFp8) else torch.mm(x, w)


def expert_mlp(
    x: torch.Tensor, w13: torch.Tensor | BlockFp8, w2: torch.Tensor | BlockFp8
) -> torch.Tensor:
    """One expert's SwiGLU. x: [M, H] (M a multiple of ROW_TILE), w13: [H, 2I] (gate columns,
    then up), w2: [I, H] -> [M, H]; a block-FP8 weight multiplies as `fp8_linear`."""
    gate_up = _mm(x, w13)
    inner = w2.shape[0]
    return _mm(silu(gate_up)[:, :inner] * gate_up[:, inner:], w2)


def check_fp8_experts(caller: str, name: str, w: Experts) -> None:
    """A block-FP8 expert stack's parts agree: weight [E, K, N] FP8, scales
    [E, ceil(K / 128), G] fp32, groups [N] int32, on one device. A plain tensor passes."""
    if not isinstance(w, BlockFp8):
        return
    q, scales, groups = w
    if q.dim() != 3 or q.dtype != FP8:
        raise ValueError(
            f"{caller}: {name}.weight must be [E, K, N] {FP8}, not {_dims(q)} {q.dtype}."
        )
    e, k, n = q.shape
    if scales.dim() != 3 or scales.shape[:2] != (e, blocks(k)) or scales.shape[2] == 0:
        raise ValueError(
            f"{caller}: {name}.scales must be [E, ceil(K / {BLOCK}), G] = [{e}, {blocks(k)}, G] "
            f"for weight {_dims(q)}, not {_dims(scales)}."
        )
    if groups.shape != (n,):
        raise ValueError(
            f"{caller}: {name}.groups must name a scale column for each of the {n} output "
            f"columns, not {_dims(groups)}."
        )
    if scales.dtype != torch.float32 or groups.dtype != torch.int32:
        raise ValueError(
            f"{caller}: {name}.scales must be fp32 and {name}.groups int32, not {scales.dtype} "
            f"and {groups.dtype}."
        )
    if scales.device != q.device or groups.device != q.device:
        raise ValueError(f"{caller}: {name}'s weight, scales and groups are on different devices.")


def _dims(t: torch.Tensor) -> str:
    return f"[{', '.join(map(str, t.shape))}]"


def sum_in_expert_order(contributions: torch.Tensor) -> torch.Tensor:
    """contributions: [P, k, H], each row's in increasing expert index -> [P, H]: k adds in the
    contributions' dtype, in that order."""
    out = torch.zeros_like(contributions[:, 0])
    for j in range(contributions.shape[1]):
        out = out + contributions[:, j]
    return out


def grouped_mm(x: torch.Tensor, w: Experts, ends: torch.Tensor) -> torch.Tensor:
    """x: [M, K], w: [E, K, N], ends: [E] int32 -> [M, N]: rows ends[e-1] .. ends[e] times
    w[e] (rows past ends[-1] are left undefined). torch's grouped GEMM where this torch has
    one; otherwise a GEMM per expert hit, looped here (one read of `ends` to the host). A
    block-FP8 `w` reads `ends` to the host (`_fp8_grouped_mm`)."""
    if isinstance(w, BlockFp8):
        return _fp8_grouped_mm(x, w, ends)
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(x, w, offs=ends)
    out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


def blocked_mm(x: torch.Tensor, w: Experts, block_experts: torch.Tensor) -> torch.Tensor:
    """x: [B * BM, K], w: [E, K, N], block_experts: [B] int64 (each < E) -> [B * BM, N]: each
    block of BM rows times its expert's weight, by batched GEMMs over copies of the blocks'
    weights, `COPY_BYTES` of them at a time into one buffer. A block's rows get the bytes
    `torch.mm` gives them (a block-FP8 `w`: those of `fp8_linear`, `_fp8_blocked_mm`)."""
    if isinstance(w, BlockFp8):
        if x.device.type == "cpu":
            return _fp8_blocked_mm(x, w, block_experts, COPY_BYTES, pad=False)
        return _fp8_blocked_mm(x, w, block_experts, DEVICE_TILE_BYTES, pad=True)
    blocks = block_experts.numel()
    xs = x.view(blocks, -1, x.shape[1])
    out = x.new_empty(blocks, xs.shape[1], w.shape[2])
    per_call = max(1, COPY_BYTES // (w.shape[1] * w.shape[2] * w.element_size()))
    copies = w.new_empty(min(per_call, blocks), w.shape[1], w.shape[2])
    for start in range(0, blocks, per_call):
        chosen = block_experts[start : start + per_call]
        n = chosen.numel()
        torch.index_select(w, 0, chosen, out=copies[:n])
        torch.bmm(xs[start : start + n], copies[:n], out=out[start : start + n])
    return out.view(x.shape[0], w.shape[2])


def _k_blocks(k: int) -> list[slice]:
    """The scale blocks of K, in the order `fp8_linear` adds them."""
    return [slice(s, min(k, s + BLOCK)) for s in range(0, k, BLOCK)]


def _tile_bytes(w: BlockFp8) -> int:
    """One expert's fp32 upcast of one K block of its weight."""
    return 4 * min(w.shape[1], BLOCK) * w.shape[2]


def _quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (its rows quantized by `quantize_rows`, upcast to fp32 for the GEMMs:
    [M, K]; their scales [M, ceil(K / 128)])"""
    q, scales = quantize_rows(x)
    return upcast(q), scales


def _fp8_grouped_mm(x: torch.Tensor, w: BlockFp8, ends: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` of a block-FP8 stack: each expert hit's rows times its weight as
    `fp8_linear` multiplies them. The experts hit go `COPY_BYTES` of upcast K-block tiles at a
    time through one grouped GEMM per K block, each tile upcast from a copy of the experts' FP8
    weights; the experts not hit are never read. -> [M, N] in x's dtype"""
    m, k = x.shape
    q, sx = _quantized(x)
    acc = torch.zeros(m, w.shape[2], dtype=torch.float32, device=x.device)
    bounds = ends.tolist()
    runs = [
        (e, s, t) for e, (s, t) in enumerate(zip([0, *bounds[:-1]], bounds, strict=True)) if t > s
    ]
    per_call = max(1, COPY_BYTES // _tile_bytes(w))
    for c in range(0, len(runs), per_call):
        chunk = runs[c : c + per_call]
        chosen = torch.tensor([e for e, _, _ in chunk], device=x.device)
        sizes = torch.tensor([t - s for _, s, t in chunk], device=x.device)
        offs = sizes.cumsum(0).to(torch.int32)
        rows = slice(chunk[0][1], chunk[-1][2])
        copies = w.weight.index_select(0, chosen)
        sw = w.scales.index_select(0, chosen).index_select(-1, w.groups)  # [experts, KB, N]
        for kb, ks in enumerate(_k_blocks(k)):
            part = grouped_mm(q[rows, ks], upcast(copies[:, ks]), offs)
            row_sw = sw[:, kb].repeat_interleave(sizes, 0, output_size=rows.stop - rows.start)
            acc[rows] += part * sx[rows, kb : kb + 1] * row_sw
    return acc.to(x.dtype)


def _fp8_blocked_mm(
    x: torch.Tensor, w: BlockFp8, block_experts: torch.Tensor, tile_bytes: int, pad: bool
) -> torch.Tensor:
    """`blocked_mm` of a block-FP8 stack: per batched GEMM and K block, the blocks' FP8 tiles
    copied and upcast, `tile_bytes` of fp32 at most (at least one block's); with `pad`, the
    last call padded with zero rows to the others' shape. -> [B * BM, N] in x's dtype"""
    num_blocks, (m, k), n = block_experts.numel(), x.shape, w.shape[2]
    q, sx = _quantized(x)
    per_call = max(1, tile_bytes // _tile_bytes(w))
    padded = -(-num_blocks // per_call) * per_call if pad else num_blocks
    if padded > num_blocks:
        extra = (padded - num_blocks) * (m // num_blocks)
        q, sx = F.pad(q, (0, 0, 0, extra)), F.pad(sx, (0, 0, 0, extra))
        block_experts = F.pad(block_experts, (0, padded - num_blocks))
    qs, sxs = q.view(padded, -1, k), sx.view(padded, -1, sx.shape[1])
    acc = torch.zeros(padded, qs.shape[1], n, dtype=torch.float32, device=x.device)
    for start in range(0, padded, per_call):
        chosen = block_experts[start : start + per_call]
        span = slice(start, start + chosen.numel())
        sw = w.scales.index_select(0, chosen).index_select(-1, w.groups)  # [blocks, KB, N]
        for kb, ks in enumerate(_k_blocks(k)):
            tiles = upcast(w.weight[:, ks].index_select(0, chosen))
            part = torch.bmm(qs[span, :, ks], tiles)
            acc[span] += part * sxs[span, :, kb : kb + 1] * sw[:, None, kb]
    return acc.view(-1, n)[:m].to(x.dtype)


def _trimmed(aligned: Aligned, block_m: int) -> Aligned:
    """The alignment cut to the entries it uses: reading that length costs nothing on the CPU,
    and what lies past it is padding."""
    used = int(aligned.num_used)
    return aligned._replace(
        pairs=aligned.pairs[:used], block_experts=aligned.block_experts[: used // block_m]
    )


def _cpu_expert_mm(x: torch.Tensor, w: Experts, aligned: Aligned) -> torch.Tensor:
    """grouped_mm over a trimmed alignment, as one batched GEMM where copying the blocks'
    weights costs less than a GEMM call per expert hit."""
    hits = int(torch.count_nonzero(torch.diff(aligned.ends, prepend=aligned.ends[:1] * 0)))
    num_blocks = aligned.block_experts.numel()
    if isinstance(w, BlockFp8):
        # Both upcast the weights they use: by blocks, an expert's once a block rather than
        # once, for a batched GEMM per K block rather than a GEMM per expert hit and K block.
        extra = (num_blocks - hits) * w.shape[1] * w.shape[2] * UPCAST_BYTES
        if extra <= hits * blocks(w.shape[1]) * CALL_BYTES:
            return blocked_mm(x, w, aligned.block_experts)
        return grouped_mm(x, w, aligned.ends)
    block_bytes = w.shape[1] * w.shape[2] * w.element_size()
    if num_blocks * block_bytes <= hits * CALL_BYTES:
        return blocked_mm(x, w, aligned.block_experts)
    return grouped_mm(x, w, aligned.ends)


def _device_expert_mm(x: torch.Tensor, w: Experts, aligned: Aligned) -> torch.Tensor:
    """grouped_mm over a whole alignment without reading it to the host: a block-FP8 stack
    goes by blocks, those past the entries used taking the last expert's weights."""
    if isinstance(w, BlockFp8):
        return blocked_mm(x, w, aligned.block_experts.clamp(max=w.shape[0] - 1))
    return grouped_mm(x, w, aligned.ends)


def routed_moe(
    x: torch.Tensor,
    w13: Experts,
    w2: Experts,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """x: [P, H], w13: [E, H, 2I], w2: [E, I, H], experts: [P, k] int64 (sorted per row),
    weights: [P, k] in x's dtype -> [P, H]: sum over j of weights[:, j] * MLP_experts[:, j](x).

    The pairs, aligned by expert in runs of ROW_TILE rows (padding reads a zero row), go
    through one grouped GEMM per projection: a GEMM per expert hit, looped in ATen, each over
    its own contiguous rows (the bytes of `torch.mm` on them), the experts not hit skipped. On a
    GPU every shape is the upper bound's, so the call captures in a graph; on the CPU the
    entries are cut to those used, and small experts go through `blocked_mm`. Either stack may
    be block FP8 (`fp8_linear`'s math per expert; off the CPU by blocks, `blocked_mm`)."""
    check_fp8_experts("routed_moe", "w13", w13)
    check_fp8_experts("routed_moe", "w2", w2)
    rows, top_k = experts.shape
    aligned = align(experts, w13.shape[0], ROW_TILE)
    on_cpu = x.device.type == "cpu"
    if on_cpu:
        aligned = _trimmed(aligned, ROW_TILE)
    expert_mm = _cpu_expert_mm if on_cpu else _device_expert_mm
    source = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row P: the padding's zero row
    sorted_x = source.index_select(0, aligned.pairs // top_k)  # [entries, H]
    gate_up = expert_mm(sorted_x, w13, aligned)
    inner = w2.shape[1]
    act = silu(gate_up)[:, :inner] * gate_up[:, inner:]
    scale = torch.cat([weights.reshape(-1), weights.new_zeros(1)])  # [P k + 1]
    y = expert_mm(act, w2, aligned) * scale.index_select(0, aligned.pairs)[:, None]
    if not on_cpu:
        # Entries past the last expert's run hold no rows of grouped_mm's: they land with the
        # padding in the spare row P k, which is dropped.
        used = torch.arange(y.shape[0], device=y.device) < aligned.num_used
        y = torch.where(used[:, None], y, 0)
    contributions = x.new_zeros(rows * top_k + 1, x.shape[1])
    contributions.index_copy_(0, aligned.pairs, y)
    return sum_in_expert_order(contributions[:-1].view(rows, top_k, -1))


def dense_moe(
    x: torch.Tensor,
    w13: Experts,
    w2: Experts,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The same sum with every expert run over every row, weighted by zero where it was not
    chosen: what the engine computed before routing, kept as the routed path's byte-exact
    reference. Same arguments as `routed_moe`; a block-FP8 expert multiplies as `fp8_linear`."""
    check_fp8_experts("dense_moe", "w13", w13)
    check_fp8_experts("dense_moe", "w2", w2)
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=x.dtype, device=x.device)
    dense.scatter_(1, experts, weights)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        mlp = expert_mlp(x, expert_weight(w13, e), expert_weight(w2, e))
        out = out + mlp * dense[:, e : e + 1]
    return out
