"""The vision tower of Qwen3.5 / Qwen3.6 (transformers' `Qwen3_5VisionModel`) in plain torch,
loaded from the checkpoint's `model.visual.*` tensors as published, run at prefill on the
service's device, one image at a time: an image's embeddings depend on that image alone, never
on the images beside it in a call.

An image comes as transformers' processor gives it: `pixels` [t * h * w, patch_dim] (its
patches in spatial-merge-block order) and its grid (t, h, w) in patches. The tower:
- patch embedding: the Conv3d over one temporal patch is a product with its weight flattened,
  [patch_dim, hidden];
- the learned square position grid resampled to the image's (h, w) by bilinear interpolation
  with aligned corners, added to every frame's patches;
- `depth` blocks of LayerNorm, attention over each frame's patches (no mask) with 2D rotary
  positions (a patch's row on half the rotary frequencies, its column on the other half), and a
  GELU MLP;
- the patch merger: LayerNorm, then each block of spatial_merge_size ** 2 patches concatenated
  and projected to the text model's width: one row per image token."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from gpu_service.model.quantization import SCALE_SUFFIX
from gpu_service.model.vision_config import VisionConfig
from kernels.fp8.naive import dequantize_blocks

VISION_PREFIX = "model.visual."
_EPS = 1e-6  # every LayerNorm of the tower


def vision_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower by its checkpoint name."""
    h, i, m = v.hidden_size, v.intermediate_size, v.merge_unit * v.hidden_size
    p = VISION_PREFIX
    patch = (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    shapes: dict[str, tuple[int, ...]] = {
        f"{p}patch_embed.proj.weight": patch,
        f"{p}patch_embed.proj.bias": (h,),
        f"{p}pos_embed.weight": (v.num_position_embeddings, h),
        f"{p}merger.norm.weight": (h,),
        f"{p}merger.norm.bias": (h,),
        f"{p}merger.linear_fc1.weight": (m, m),
        f"{p}merger.linear_fc1.bias": (m,),
        f"{p}merger.linear_fc2.weight": (v.out_hidden_size, m),
        f"{p}merger.linear_fc2.bias": (v.out_hidden_size,),
    }
    for n in range(v.depth):
        b = f"{p}blocks.{n}."
        for norm in ("norm1", "norm2"):
            shapes[f"{b}{norm}.weight"] = shapes[f"{b}{norm}.bias"] = (h,)
        shapes |= {
            f"{b}attn.qkv.weight": (3 * h, h),
            f"{b}attn.qkv.bias": (3 * h,),
            f"{b}attn.proj.weight": (h, h),
            f"{b}attn.proj.bias": (h,),
            f"{b}mlp.linear_fc1.weight": (i, h),
            f"{b}mlp.linear_fc1.bias": (i,),
            f"{b}mlp.linear_fc2.weight": (h, i),
            f"{b}mlp.linear_fc2.bias": (h,),
        }
    return shapes


def grid_problem(v: VisionConfig, grid: tuple[int, ...], rows: int) -> str | None:
    """Why an image of `grid` (t, h, w in patches) with `rows` patch rows is not one the tower
    takes, as a clause; None when it is."""
    if len(grid) != 3 or min(grid) < 1:
        return f"its grid_thw is {list(grid)}; expected three sizes >= 1 (t, h, w in patches)"
    t, h, w = grid
    m = v.spatial_merge_size
    if h % m or w % m:
        return f"its grid_thw is {list(grid)}; h and w must be multiples of {m} (spatial merge)"
    if rows != t * h * w:
        return f"it has {rows} patch rows; grid_thw {list(grid)} has {t * h * w}"
    return None


class VisionTower:
    def __init__(
        self,
        v: VisionConfig,
        tensors: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """`tensors`: the checkpoint's `model.visual.*` by name (a weight stored in FP8 beside
        its `weight_scale_inv` is dequantized: the tower runs in `dtype`)."""
        self.v, self.dtype, self.device = v, dtype, torch.device(device)
        got = {n.removeprefix(VISION_PREFIX): t for n, t in tensors.items()}
        for name, t in tensors.items():
            if name.endswith(SCALE_SUFFIX):
                weight = name.removesuffix(SCALE_SUFFIX) + "weight"
                got[weight.removeprefix(VISION_PREFIX)] = dequantize_blocks(tensors[weight], t)
                del got[name.removeprefix(VISION_PREFIX)]
        # Linears as [in, out], contiguous; vectors as loaded.
        self.wt: dict[str, torch.Tensor] = {}
        for name, t in got.items():
            t = t.to(device=self.device, dtype=dtype)
            if name == "patch_embed.proj.weight":
                t = t.reshape(t.shape[0], -1)
            self.wt[name] = t.t().contiguous() if t.dim() == 2 and "pos_embed" not in name else t
        hd = v.head_dim // 2
        # 1 / theta ** (2j / (head_dim / 2)): a quarter of the head's dims per axis.
        exps = torch.arange(0, hd, 2, dtype=torch.float32) / hd
        self.inv_freq = (1.0 / v.rope_theta**exps).to(self.device)

    def held(self) -> dict[str, torch.Tensor]:
        return dict(self.wt)

    def embed(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """pixels: [t * h * w, patch_dim] of one image, grid (t, h, w) -> its image tokens'
        embeddings [t * h * w / merge_unit, out_hidden_size] in the tower's dtype."""
        v = self.v
        x = self._linear(pixels.to(self.device, self.dtype), "patch_embed.proj")
        x = x + self.position_embeddings(grid).to(x.dtype)
        cos, sin = self.rotary(grid)
        for n in range(v.depth):
            b = f"blocks.{n}."
            x = x + self._attention(self._norm(x, f"{b}norm1"), b, grid, cos, sin)
            y = self._linear(self._norm(x, f"{b}norm2"), f"{b}mlp.linear_fc1")
            approximate = "tanh" if v.hidden_act == "gelu_pytorch_tanh" else "none"
            x = x + self._linear(F.gelu(y, approximate=approximate), f"{b}mlp.linear_fc2")
        merged = self._norm(x, "merger.norm").reshape(-1, v.merge_unit * v.hidden_size)
        merged = F.gelu(self._linear(merged, "merger.linear_fc1"))
        return self._linear(merged, "merger.linear_fc2")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.addmm(self.wt[f"{name}.bias"], x, self.wt[f"{name}.weight"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w, b = self.wt[f"{name}.weight"], self.wt[f"{name}.bias"]
        return F.layer_norm(x, (x.shape[-1],), w, b, _EPS)

    def _attention(
        self,
        x: torch.Tensor,
        b: str,
        grid: tuple[int, int, int],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Each frame's patches attend to that frame's, unmasked. x: [n, hidden]"""
        v, n = self.v, x.shape[0]
        t = grid[0]
        qkv = self._linear(x, f"{b}attn.qkv").view(n, 3, v.num_heads, v.head_dim)
        q, k, val = qkv.unbind(1)  # [n, heads, d] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # [t, heads, h * w, d]: one attention per frame.
        q, k, val = (
            z.view(t, n // t, v.num_heads, v.head_dim).transpose(1, 2) for z in (q, k, val)
        )
        out = F.scaled_dot_product_attention(q, k, val)
        return self._linear(out.transpose(1, 2).reshape(n, -1), f"{b}attn.proj")

    def position_embeddings(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """The learned grid resampled to the image's patches: [t * h * w, hidden] (fp32 where
        the table's dtype is narrower, as transformers' weighted sum promotes it)."""
        index, weight = interpolation(grid, self.v.grid_side, self.v.spatial_merge_size)
        table = self.wt["pos_embed.weight"]
        taps = table[index.to(self.device)]  # [n, 4, hidden]
        return (taps * weight.to(self.device)[..., None]).sum(1)

    def rotary(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [t * h * w, head_dim] fp32: a patch's row on the first quarter of the
        frequencies' angles, its column on the second, the half repeated (rotate-half)."""
        pos = patch_rows_cols(grid, self.v.spatial_merge_size).to(self.device)  # [n, 2]
        freqs = pos[..., None].float() * self.inv_freq  # [n, 2, d / 4]
        half = freqs.flatten(1)  # [row freqs, col freqs]
        angles = torch.cat([half, half], -1)
        return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head, in fp32 (transformers' apply_rotary_pos_emb_vision).
    x: [n, heads, d], cos/sin: [n, d]"""
    xf = x.float()
    x1, x2 = xf.chunk(2, -1)
    rotated = torch.cat([-x2, x1], -1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def patch_rows_cols(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """Each patch's (row, col) in the processor's order: frames, then blocks of merge x merge
    patches row by row, each block's patches row by row. -> [t * h * w, 2] int64"""
    t, h, w = grid
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(1, 2).flatten()
    cols = cols.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([rows, cols], -1).repeat(t, 1)


def interpolation(
    grid: tuple[int, int, int], side: int, merge: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps with aligned corners (F.interpolate's) of a `side` x `side` table for each
    patch of `grid`: indices [n, 4] into the flattened table and their weights [n, 4] fp32."""
    pos = patch_rows_cols(grid, merge)
    _, h, w = grid

    def axis(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.float() * (side - 1) / max(size - 1, 1)
        floor = torch.floor(src)
        offsets = torch.arange(2)
        taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
        weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
        return taps, weights

    h_taps, h_w = axis(pos[:, 0], h)
    w_taps, w_w = axis(pos[:, 1], w)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return index, weight
