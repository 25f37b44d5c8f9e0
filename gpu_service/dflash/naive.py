"""The published DFlash algorithm (z-lab's `dflash/model.py`) in plain torch, one sequence at a
time: the reference the engine's batched forward and the training forward are held to.

- Context: the target's tapped layer outputs of every committed token, concatenated in the
  order of `target_layer_ids` ([T, K * H]), projected once: `hidden_norm(fc(taps))` [T, H].
  Every drafter layer turns it into its own keys and values (`k_norm(k_proj(.))` with RoPE at
  the token's position, `v_proj(.)`), kept in a cache that grows as tokens are committed.
- Block: `[last token, MASK x (B - 1)]` at positions `n .. n + B - 1` (n committed tokens).
  Each layer's queries are the block's; its keys and values are the context's followed by the
  block's own, all visible to every row (no causal mask). The block's keys are never cached.
- Rows 1 .. B - 1 through the final norm and the target's LM head give B - 1 drafts.

Norms are Qwen3's (`w * x / rms(x)`, computed in fp32), not the target's `1 + w`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_service.dflash.config import MASK_EMBEDDING, DFlashConfig

Params = dict[str, torch.Tensor]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * normed.to(x.dtype)


def rope(cfg: DFlashConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, head_dim], rotate-half over the whole head, fp32."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, d]; cos, sin: [T, d]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x * cos[:, None].to(x.dtype)) + (rotated * sin[:, None].to(x.dtype))


def project_context(p: Params, cfg: DFlashConfig, taps: torch.Tensor) -> torch.Tensor:
    """taps: [T, K * H] -> the context the layers read: [T, H]"""
    return rms_norm(F.linear(taps, p["fc.weight"]), p["hidden_norm.weight"], cfg.rms_norm_eps)


def keys_values(
    p: Params, cfg: DFlashConfig, layer: int, x: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H] (context, or a block after its input norm) -> k, v: [T, Hkv, d], k roped"""
    a, t, d = f"layers.{layer}.self_attn", x.shape[0], cfg.head_dim
    k = F.linear(x, p[f"{a}.k_proj.weight"]).view(t, -1, d)
    k = rms_norm(k, p[f"{a}.k_norm.weight"], cfg.rms_norm_eps)
    v = F.linear(x, p[f"{a}.v_proj.weight"]).view(t, -1, d)
    return apply_rope(k, *rope(cfg, positions)), v


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q: [R, Hq, d], k, v: [S, Hkv, d], mask: [R, S] bool or None (all visible) -> [R, Hq * d]"""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("rhd,shd->hrs", q.float(), k.float()) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    out = torch.einsum("hrs,shd->rhd", scores.softmax(-1), v.float())
    return out.reshape(q.shape[0], -1).to(q.dtype)


def layer(
    p: Params,
    cfg: DFlashConfig,
    i: int,
    x: torch.Tensor,
    positions: torch.Tensor,
    ctx_kv: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decoder layer over rows x [R, H] at `positions`, reading the context's cached keys
    and values and the rows' own; `mask` [R, S + R] (None: every key visible)."""
    pre, a, eps = f"layers.{i}", f"layers.{i}.self_attn", cfg.rms_norm_eps
    h = rms_norm(x, p[f"{pre}.input_layernorm.weight"], eps)
    q = F.linear(h, p[f"{a}.q_proj.weight"]).view(x.shape[0], -1, cfg.head_dim)
    q = apply_rope(rms_norm(q, p[f"{a}.q_norm.weight"], eps), *rope(cfg, positions))
    k, v = keys_values(p, cfg, i, h, positions)
    keys, values = torch.cat([ctx_kv[0], k]), torch.cat([ctx_kv[1], v])
    x = x + F.linear(attend(q, keys, values, mask), p[f"{a}.o_proj.weight"])
    h = rms_norm(x, p[f"{pre}.post_attention_layernorm.weight"], eps)
    m = f"{pre}.mlp"
    act = F.silu(F.linear(h, p[f"{m}.gate_proj.weight"])) * F.linear(h, p[f"{m}.up_proj.weight"])
    return x + F.linear(act, p[f"{m}.down_proj.weight"])


def block_inputs(p: Params, cfg: DFlashConfig, embed: torch.Tensor, last: int) -> torch.Tensor:
    """[last token, MASK x (B - 1)]'s embeddings: [B, H]; embed: the target's [V, H]."""
    mask = embed[cfg.mask_token_id] if cfg.mask_token_id is not None else p[MASK_EMBEDDING]
    rows = mask.to(embed.dtype).expand(cfg.block_size - 1, -1)
    return torch.cat([embed[last][None], rows])


class NaiveDFlash:
    """One sequence's drafter: its context cache, and a block proposed from it."""

    def __init__(self, p: Params, cfg: DFlashConfig, embed: torch.Tensor, lm_head: torch.Tensor):
        self.p, self.cfg, self.embed, self.lm_head = p, cfg, embed, lm_head
        empty = embed.new_zeros(0, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [empty] * cfg.num_hidden_layers
        self.v = [empty] * cfg.num_hidden_layers

    @property
    def length(self) -> int:
        return self.k[0].shape[0]

    def extend(self, taps: torch.Tensor) -> None:
        """The next committed tokens' taps [T, K * H], at the positions after the cache's."""
        ctx = project_context(self.p, self.cfg, taps)
        pos = torch.arange(self.length, self.length + taps.shape[0])
        for i in range(self.cfg.num_hidden_layers):
            k, v = keys_values(self.p, self.cfg, i, ctx, pos)
            self.k[i], self.v[i] = torch.cat([self.k[i], k]), torch.cat([self.v[i], v])

    def crop(self, length: int) -> None:
        self.k = [k[:length] for k in self.k]
        self.v = [v[:length] for v in self.v]

    def block_hidden(self, last: int) -> torch.Tensor:
        """The block after the final norm: [B, H], its first row at the cache's length."""
        x = block_inputs(self.p, self.cfg, self.embed, last)
        pos = torch.arange(self.length, self.length + self.cfg.block_size)
        for i in range(self.cfg.num_hidden_layers):
            x = layer(self.p, self.cfg, i, x, pos, (self.k[i], self.v[i]))
        return rms_norm(x, self.p["norm.weight"], self.cfg.rms_norm_eps)

    def logits(self, last: int) -> torch.Tensor:
        """Rows 1 .. B - 1 through the target's LM head ([V, H]): [B - 1, V]"""
        return F.linear(self.block_hidden(last)[1:], self.lm_head)

    def propose(self, last: int, drafts: int) -> list[int]:
        return self.logits(last)[:drafts].argmax(-1).tolist()
