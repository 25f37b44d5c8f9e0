"""The block-scaled FP8 GEMM: `x @ W` for a weight held as `BlockFp8` (`[K, N]` float8_e4m3fn,
128 x 128 block scales, a scale column per output column), the Triton form of
`naive.fp8_linear`, batch invariant as `kernels/matmul/triton.py` is.

Activations are quantized as `naive.quantize_rows` quantizes them, to the same bytes: per row and
128 columns, scale = max |x| / 448 and x / scale cast to e4m3, both divisions correctly rounded
(`div_rn`: Triton's `/` on fp32 is `div.approx`) and the cast to nearest even; a maximum does not
depend on the order it is taken in. The K loop then takes one 128-column block at a time, the
scale block: acc += dot(xq, wq) * x_scale[:, None] * w_scale[None, :] in fp32, in naive's order
of multiplications, with w_scale[n] = scales[kb, groups[n]].

Where the activations are quantized depends on M, the bytes do not. While the rows fit one row
tile (decode, verify) the GEMM quantizes its x tile itself, block by block: a launch and a
round trip through memory fewer, where both weigh most next to streaming the weight. Past one
row tile, redoing that (a correctly rounded division per element) for every column tile would
cost more than the FP8 product itself, so a small kernel quantizes x once into bytes and scales
and the GEMM reads those. It is the one compiled GEMM either way, a branch on an argument: the
quantized values are the same, and everything after them the same instructions.

Tiles and the order of the sums over K are those of the bf16 GEMM: one tile shape for every M,
K cut into runs of whole blocks chosen from N and K alone, each run summed from zero in block
order and the runs added in order, by the program itself past one row tile and by the bf16
GEMM's split-summing kernel (from a fp32 workspace) within one.

The product runs on the FP8 tensor cores where there are some (sm_89 and later; also on `meta`
tensors, which `tools.kernel_report` compiles for sm_90 and sm_100). sm_80 has neither FP8 MMA nor
e4m3 conversions: there the bytes are decoded by integer arithmetic into fp16, exactly (every
e4m3 value is a normal fp16 one), the activations rounded to e4m3 by fp32 arithmetic, and the
tensor cores multiply fp16. The interpreter does the same in fp32, whose `tl.dot` is exact there
where a low-precision one is not, and whose own e4m3 and bf16 casts do not round to nearest."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.common import interpreted
from kernels.fp8.naive import BLOCK, FP8, FP8_MAX, MIN_AMAX, BlockFp8, blocks
from kernels.matmul import triton as bf16_gemm

# (BM, BN, BK), one shape for every M: the bf16 GEMM's rows and columns, and the scale block of
# K. A K block of a column tile is then 16 KiB of weight, as the bf16 GEMM's is.
TILE = (64, 128, BLOCK)
# Three 64 x 128 fp32 tiles (a K block's product, a run's sum, the total) and x's tile being
# quantized fit 8 warps' registers: at the flagship's shapes 220 registers on sm_90, 234 on
# sm_100 and 246 on sm_80, no spills.
NUM_WARPS = 8
# Rows of a program of the quantizing kernel, with BLOCK columns.
QUANTIZE_ROWS = 64
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# What tl.dot multiplies: e4m3 (sm_89 and later), fp16 (sm_80), fp32 (the interpreter).
DOTS = ("fp8", "fp16", "fp32")
# Enough programs for one row tile to stream the weight at memory speed: the bf16 GEMM's
# reason, and FP8 tiles of its bytes.
TARGET_PROGRAMS = bf16_gemm.TARGET_PROGRAMS

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@dataclass(frozen=True)
class Fp8MatmulPlan:
    """How `fp8_matmul` runs an [M, K] @ [K, N] product. `splits` and `split_blocks` fix the
    arithmetic (from N and K alone); the rest follow from them and M."""

    splits: int  # runs of K blocks, each summed on its own, added in this order
    split_blocks: int  # K blocks in each run (the last run may have fewer)
    fused: bool  # the GEMM quantizes x itself (one row tile); else a kernel does first
    quantize_programs: int  # programs of the quantizing kernel (0: none runs)
    tiles: int  # output tiles, row tiles x column tiles
    programs: int  # programs of the GEMM kernel
    sum_programs: int  # programs of the kernel that adds the splits (0: none runs)
    workspace_bytes: int  # the fp32 sums of the splits, [splits, M, N] (0: none)


def split_k(n: int, k: int) -> tuple[int, int]:
    """(splits, K blocks per split) for an [., K] @ [K, N] product: the fewest splits that
    bring a row tile's programs to TARGET_PROGRAMS, no split empty. Never depends on M."""
    _, bn, bk = TILE
    k_blocks = max(1, triton.cdiv(k, bk))
    want = min(k_blocks, triton.cdiv(TARGET_PROGRAMS, triton.cdiv(n, bn)))
    split_blocks = triton.cdiv(k_blocks, want)
    return triton.cdiv(k_blocks, split_blocks), split_blocks


def plan(m: int, n: int, k: int) -> Fp8MatmulPlan:
    """The launches `fp8_matmul` makes for x: [M, K] and a [K, N] weight, without making them."""
    bm, bn, bk = TILE
    splits, split_blocks = split_k(n, k)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    fused = m <= bm
    quantize = 0 if fused else triton.cdiv(m, QUANTIZE_ROWS) * triton.cdiv(k, bk)
    if not fused or splits == 1:
        return Fp8MatmulPlan(splits, split_blocks, fused, quantize, tiles, tiles, 0, 0)
    sums = triton.cdiv(m * n, bf16_gemm.SUM_BLOCK)
    return Fp8MatmulPlan(
        splits, split_blocks, fused, quantize, tiles, tiles * splits, sums, splits * m * n * 4
    )


def dot_for(capability: tuple[int, int]) -> str:
    """What `tl.dot` multiplies (DOTS) on a GPU of this compute capability: e4m3 needs sm_89."""
    return "fp8" if capability >= (8, 9) else "fp16"


# What a launch binds by the GPU it runs on, for `tools.compiling` to compile a launch caught
# on `meta` for each target: an sm_80 multiplies in fp16.
ARCH_CONSTEXPRS = {"DOT": lambda arch: dot_for(divmod(arch, 10))}


def dot_of(x: torch.Tensor) -> str:
    """What `tl.dot` multiplies for a kernel given `x`: fp32 interpreted, and on `meta` (which
    `tools.kernel_report` compiles for sm_90 and sm_100) what an sm_90 multiplies."""
    if interpreted(x):
        return "fp32"
    if x.device.type == "cuda":
        return dot_for(torch.cuda.get_device_capability(x.device))
    return dot_for((9, 0))


# -- e4m3 by integer and fp32 arithmetic (sm_80 and the interpreter) ---------------------------


@triton.jit
def _e4m3_rounded(b_v):
    """fp32 within +-448 -> the nearest e4m3 value (ties to even) in fp32, sign kept (-0
    included, as torch's cast keeps it). |v| + 2^(e + 20), e the exponent of |v| but at least
    e4m3's least normal one (-6), is |v| rounded to a multiple of 2^(e - 3), e4m3's spacing
    there, to nearest even (fp32 keeps 23 bits below 2^(e + 20)); taking 2^(e + 20) away again
    is exact."""
    b_bits = b_v.to(tl.uint32, bitcast=True)
    b_abs = (b_bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    b_exp = tl.maximum(b_bits & 0x7F800000, 121 << 23)
    b_c = (b_exp + (20 << 23)).to(tl.float32, bitcast=True)
    b_r = ((b_abs + b_c) - b_c).to(tl.uint32, bitcast=True)
    return (b_r | (b_bits >> 31 << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(b_r):
    """An e4m3 value in fp32 (`_e4m3_rounded`'s) -> its byte."""
    b_bits = b_r.to(tl.uint32, bitcast=True)
    b_abs = b_bits & 0x7FFFFFFF
    # A normal value's exponent rebiased (127 -> 7) above its top three mantissa bits; a
    # subnormal one (below 2^-6) is its multiple of 2^-9.
    b_normal = (b_abs >> 20) - (120 << 3)
    b_small = (b_abs.to(tl.float32, bitcast=True) * 512.0).to(tl.uint32)
    b_mag = tl.where(b_abs < (121 << 23), b_small, b_normal)
    return (((b_bits >> 24) & 0x80) | b_mag).to(tl.uint8)


@triton.jit
def _e4m3_half(b_bits):
    """e4m3 bytes (uint8) -> their values in fp16, exactly (the NaN byte reads as 480). Shifted
    into fp16's fields an e4m3 byte reads as its value times 2^-8 (the exponent biases differ by
    8; e4m3's subnormals land on fp16's), and fp16 multiplies by 2^8 exactly, subnormals
    included."""
    b_h = ((b_bits & 0x7F).to(tl.uint16) << 7) | ((b_bits & 0x80).to(tl.uint16) << 8)
    return b_h.to(tl.float16, bitcast=True) * 256.0


# -- quantizing ------------------------------------------------------------------------------


@triton.jit
def _quantized(b_x):
    """x [R, BLOCK] in fp32 (zeros past K) -> (x / scale within +-448 in fp32, before the
    cast; scale [R]), `naive.quantize_rows`'s arithmetic."""
    b_s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(b_x), 1), _MIN_AMAX), _FP8_MAX)
    b_v = tl.math.div_rn(b_x, b_s[:, None])
    return tl.minimum(tl.maximum(b_v, -_FP8_MAX), _FP8_MAX), b_s


@triton.jit
def _activation(b_v, DOT: tl.constexpr):
    """`_quantized`'s values cast to e4m3, as the operand of DOT's `tl.dot`."""
    if DOT == "fp8":
        return b_v.to(tl.float8e4nv)
    elif DOT == "fp16":
        return _e4m3_rounded(b_v).to(tl.float16)
    else:
        return _e4m3_rounded(b_v)


@triton.jit
def _operand(b_bits, DOT: tl.constexpr):
    """e4m3 bytes (uint8) as the operand of DOT's `tl.dot`."""
    if DOT == "fp8":
        return b_bits.to(tl.float8e4nv, bitcast=True)
    elif DOT == "fp16":
        return _e4m3_half(b_bits)
    else:
        return _e4m3_half(b_bits).to(tl.float32)


# M varies with the row count: a value of 1 must not compile a kernel of its own.
@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(
    x_ptr, xq_ptr, sx_ptr, M, K, DOT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr
):
    """x [M, K] -> xq [M, K] e4m3 bytes, sx [M, cdiv(K, BK)] fp32; a program quantizes BM rows
    of one block."""
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_k = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (o_m < M)[:, None] & (o_k < K)[None, :]
    b_x = tl.load(x_ptr + o_m[:, None] * K + o_k[None, :], mask=mask, other=0.0)
    b_v, b_s = _quantized(b_x.to(tl.float32))
    if DOT == "fp8":
        b_q = b_v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        b_q = _e4m3_bits(_e4m3_rounded(b_v))
    tl.store(xq_ptr + o_m[:, None] * K + o_k[None, :], b_q, mask=mask)
    tl.store(sx_ptr + o_m * tl.cdiv(K, BK) + tl.program_id(1), b_s, mask=o_m < M)


# -- the GEMM --------------------------------------------------------------------------------


# M, the splits per program and `fused` vary with the row count: a value of 1 must not compile
# a kernel of its own, whose code could add in another way. A run of one block would too. A
# scale grid of one column compiled on its own takes more registers, and spills.
@triton.jit(do_not_specialize=["M", "G", "split_blocks", "splits_per_program", "fused"])
def _fp8_matmul_kernel(
    x_ptr,
    xq_ptr,
    sx_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    o_ptr,
    ws_ptr,
    M,
    N,
    K,
    G,
    split_blocks,
    splits_per_program,
    fused,
    DOT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # x: [M, K] (fused) or xq: [M, K] bytes and sx: [M, KB]; w: [K, N] bytes, s: [KB, G],
    # g: [N]; o: [M, N], ws: [splits, M, N] fp32 when the splits are programs of their own.
    o_m = tl.program_id(0) * BM + tl.arange(0, BM)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    k_blocks = tl.cdiv(K, BK)
    b_g = tl.load(g_ptr + o_n, mask=m_n, other=0)
    s0 = tl.program_id(2) * splits_per_program
    b_o = tl.zeros([BM, BN], dtype=tl.float32)
    for s in range(s0, s0 + splits_per_program):
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kb in range(s * split_blocks, tl.minimum(s * split_blocks + split_blocks, k_blocks)):
            o_k = kb * BK + tl.arange(0, BK)
            m_k = o_k < K
            m_x = m_m[:, None] & m_k[None, :]
            b_w = tl.load(
                w_ptr + o_k[:, None] * N + o_n[None, :], mask=m_k[:, None] & m_n[None, :], other=0
            )
            b_sw = tl.load(s_ptr + kb * G + b_g, mask=m_n, other=0.0)
            # x's loads sit in the branches, so that only the weight's are pipelined: loading
            # both x tiles before the branch (pipelined too) spills on sm_80 and sm_100.
            if fused:
                b_x = tl.load(x_ptr + o_m[:, None] * K + o_k[None, :], mask=m_x, other=0.0)
                b_v, b_sx = _quantized(b_x.to(tl.float32))
                b_a = _activation(b_v, DOT)
            else:
                b_q = tl.load(xq_ptr + o_m[:, None] * K + o_k[None, :], mask=m_x, other=0)
                b_sx = tl.load(sx_ptr + o_m * k_blocks + kb, mask=m_m, other=0.0)
                b_a = _operand(b_q, DOT)
            b_d = tl.dot(b_a, _operand(b_w, DOT), input_precision="ieee")
            acc += b_d * b_sx[:, None] * b_sw[None, :]
        b_o += acc
    mask = m_m[:, None] & m_n[None, :]
    if tl.num_programs(2) == 1:
        tl.store(o_ptr + o_m[:, None] * N + o_n[None, :], b_o.to(o_ptr.dtype.element_ty), mask=mask)
    else:
        p_ws = ws_ptr + tl.program_id(2) * M * N + o_m[:, None] * N + o_n[None, :]
        tl.store(p_ws, b_o, mask=mask)


def _dims(t: torch.Tensor) -> str:
    return f"[{', '.join(map(str, t.shape))}]"


def _check(x: torch.Tensor, w: BlockFp8, out_dtype: torch.dtype) -> None:
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(
            f"fp8_matmul: x must be [M, K] of {', '.join(map(str, DTYPES))}, not {_dims(x)} "
            f"{x.dtype}"
        )
    if out_dtype not in DTYPES:
        raise ValueError(f"fp8_matmul: out_dtype {out_dtype} is not one of {DTYPES}")
    weight, scales, groups = w
    if weight.dtype != FP8:
        raise ValueError(f"fp8_matmul: weight is {weight.dtype}, not {FP8}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"fp8_matmul: x {_dims(x)} and weight {_dims(weight)} do not multiply ([M, K] @ [K, N])"
        )
    k, n = weight.shape
    if scales.dim() != 2 or scales.shape[0] != blocks(k) or scales.dtype != torch.float32:
        raise ValueError(
            f"fp8_matmul: scales {_dims(scales)} {scales.dtype} must be [{blocks(k)}, G] fp32 "
            f"for K = {k}"
        )
    if groups.shape != (n,) or groups.dtype != torch.int32:
        raise ValueError(
            f"fp8_matmul: groups {_dims(groups)} {groups.dtype} must be [{n}] int32, a scale "
            "column per output column"
        )
    devices = {str(t.device) for t in (x, weight, scales, groups)}
    if len(devices) > 1:
        raise ValueError(f"fp8_matmul: x and the weight's tensors are on {sorted(devices)}")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`naive.quantize_rows` by the kernel `fp8_matmul` runs past one row tile: x [M, K] ->
    (xq [M, K] float8_e4m3fn, scales [M, ceil(K / 128)] fp32), the same bytes."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"quantize_rows: x must be [M, K] of {DTYPES}, not {_dims(x)} {x.dtype}")
    xq, sx = _quantize(x.contiguous(), dot_of(x))
    return xq.view(FP8), sx


def _quantize(x: torch.Tensor, dot: str) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    sx = torch.empty(m, blocks(k), dtype=torch.float32, device=x.device)
    if m and k:
        grid = (triton.cdiv(m, QUANTIZE_ROWS), blocks(k))
        _quantize_kernel[grid](x, xq, sx, m, k, DOT=dot, BM=QUANTIZE_ROWS, BK=BLOCK)
    return xq, sx


def fp8_matmul(x: torch.Tensor, w: BlockFp8, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K] (bf16, fp16 or fp32), w: a [K, N] BlockFp8 -> x @ w: [M, N] in `out_dtype`
    (x's by default), `naive.fp8_linear`'s arithmetic. The groups' values are not checked
    (that would read the device): each must index a column of the scales."""
    out_dtype = out_dtype or x.dtype
    _check(x, w, out_dtype)
    m, k = x.shape
    n = w.weight.shape[1]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bm, bn, bk = TILE
    p = plan(m, n, k)
    dot = dot_of(x)
    x = x.contiguous()
    if p.fused:  # not read, the GEMM quantizing x itself; empty, of the types it reads
        xq = torch.empty(0, dtype=torch.uint8, device=x.device)
        sx = torch.empty(0, dtype=torch.float32, device=x.device)
    else:
        xq, sx = _quantize(x, dot)
    split_programs = p.sum_programs > 0
    # fp32 in both modes, or the two would be different compiled kernels.
    ws = torch.empty(p.splits if split_programs else 0, m, n, dtype=torch.float32, device=x.device)
    scales = w.scales.contiguous()
    _fp8_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), p.splits if split_programs else 1)](
        x,
        xq,
        sx,
        w.weight.contiguous().view(torch.uint8),
        scales,
        w.groups.contiguous(),
        out,
        ws,
        m,
        n,
        k,
        scales.shape[1],
        p.split_blocks,
        1 if split_programs else p.splits,
        int(p.fused),
        DOT=dot,
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=NUM_WARPS,
    )
    if split_programs:
        bf16_gemm._sum_splits_kernel[(p.sum_programs,)](
            ws, out, out, m, n, p.splits, HAS_BIAS=False, BLOCK=bf16_gemm.SUM_BLOCK
        )
    return out
