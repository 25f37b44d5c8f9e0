"""The DFlash drafter in the engine: `naive.py`'s algorithm over a batch of sequences, with the
target's ops (so eager and triton forwards serve it alike), its context in the paged pool.

- `write_context`: after the target's last tapped layer, in every prefill and verify, the rows'
  taps become each drafter layer's context keys and values at the rows' positions, through the
  slot's block table (the target's own KV rule: rows past the committed length are rewritten
  before any block reads them, so a rejected row's entry is never seen).
- `block`: one batched forward of `[last, MASK x (B - 1)]` per sequence at positions
  `seq_len .. seq_len + B - 1`, non-causal inside the block (`Layout.causal` False), reading
  the committed context; its own keys go to those positions and are overwritten by the verify.

Weights are held transposed `[in, out]` as the target's linears are; Qwen3 norms (`w * x / rms`)
run through the target's zero-centred norm op with `w` as its multiplier."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_service.dflash.config import MASK_EMBEDDING, DFlashConfig
from gpu_service.model.backend import EAGER, Cache
from gpu_service.model.batch import Batch
from gpu_service.model.ops import ROW_TILE, apply_rope, pad_rows
from gpu_service.model.state import DeviceState
from kernels.attention.naive import pool_index


@dataclass(frozen=True)
class LayerWeights:
    q: torch.Tensor  # [H, Hq d]
    kv: torch.Tensor  # [H, 2 Hkv d]: k, v (the block's, and the context's projection)
    o: torch.Tensor
    gate_up: torch.Tensor  # [H, 2 I]: gate, then up
    down: torch.Tensor
    input: tuple[torch.Tensor, torch.Tensor]  # (raw - 1, multiplier) of each norm
    post: tuple[torch.Tensor, torch.Tensor]
    heads: torch.Tensor  # [Hq + Hkv, d] fp32: q's norm (times d ** -0.5), then k's, per head
    k_heads: torch.Tensor  # [Hkv, d] fp32

    def tensors(self) -> list[torch.Tensor]:
        return [
            self.q,
            self.kv,
            self.o,
            self.gate_up,
            self.down,
            *self.input,
            *self.post,
            self.heads,
            self.k_heads,
        ]


class DFlashModel:
    def __init__(
        self,
        cfg: DFlashConfig,
        weights: dict[str, torch.Tensor],
        embed_rows: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_context: int,
    ) -> None:
        """`weights` by published name; `embed_rows(tokens)`: the target's embedding lookup."""
        self.cfg, self.embed_rows, self.ops = cfg, embed_rows, EAGER

        def t(*names: str) -> torch.Tensor:
            return torch.cat([weights[n] for n in names]).to(device, dtype).t().contiguous()

        def norm(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            w = weights[name].to(device)
            # (raw, multiplier): the triton kernel applies 1 + raw, eager the multiplier.
            return (w.float() - 1).to(dtype), w.float()

        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.fc = t("fc.weight")
        self.hidden_norm, self.norm = norm("hidden_norm.weight"), norm("norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}"
            a, m = f"{p}.self_attn", f"{p}.mlp"
            qn, kn = weights[f"{a}.q_norm.weight"].float(), weights[f"{a}.k_norm.weight"].float()
            self.layers.append(
                LayerWeights(
                    q=t(f"{a}.q_proj.weight"),
                    kv=t(f"{a}.k_proj.weight", f"{a}.v_proj.weight"),
                    o=t(f"{a}.o_proj.weight"),
                    gate_up=t(f"{m}.gate_proj.weight", f"{m}.up_proj.weight"),
                    down=t(f"{m}.down_proj.weight"),
                    input=norm(f"{p}.input_layernorm.weight"),
                    post=norm(f"{p}.post_attention_layernorm.weight"),
                    # q scaled by d ** -0.5 here: the attention takes it scaled, as the target's.
                    heads=torch.cat([(qn * d**-0.5).expand(hq, d), kn.expand(hkv, d)])
                    .contiguous()
                    .to(device),
                    k_heads=kn.expand(hkv, d).contiguous().to(device),
                )
            )
        if cfg.mask_token_id is None:
            self.mask_row = weights[MASK_EMBEDDING].to(device, dtype)
        else:
            ids = torch.tensor([cfg.mask_token_id], device=device)
            self.mask_row = embed_rows(ids)[0]
        self.rope = _rope(cfg, max_context + cfg.block_size).to(device)
        self.held = [self.fc, *self.hidden_norm, *self.norm, self.mask_row]
        for w in self.layers:
            self.held += w.tensors()

    # -- context -------------------------------------------------------------------------

    def write_context(self, taps: torch.Tensor, batch: Batch, state: DeviceState) -> None:
        """taps: [P, K * H], the rows' concatenated tapped outputs -> each layer's context keys
        and values at the rows' positions."""
        ops, cfg = self.ops, self.cfg
        ctx = self._norm(ops.linear(taps, self.fc), self.hidden_norm)
        rope = self.rope.index_select(0, batch.row_pos)
        writes = pool_index(state.block_table, batch.row_slot, batch.row_pos[: batch.rows])
        hkv, d = cfg.num_key_value_heads, cfg.head_dim
        for i, w in enumerate(self.layers):
            kv = ops.linear(ctx, w.kv)
            k = kv[:, : hkv * d].reshape(-1, hkv, d)
            k = apply_rope(ops.head_norm(k, w.k_heads, w.k_heads, cfg.rms_norm_eps), rope)
            v = kv[:, hkv * d :].reshape(-1, hkv, d)
            _write(state.dflash_k[i], state.dflash_v[i], writes, k, v, batch.rows)

    # -- block ---------------------------------------------------------------------------

    def block_inputs(self, last: torch.Tensor) -> torch.Tensor:
        """last: [n] -> [n * B, H]: each sequence's `[last, MASK x (B - 1)]`"""
        b = self.cfg.block_size
        rows = self.mask_row.expand(last.shape[0], b, -1).clone()
        rows[:, 0] = self.embed_rows(last)
        return rows.reshape(-1, rows.shape[-1])

    def block(self, last: torch.Tensor, batch: Batch, state: DeviceState) -> torch.Tensor:
        """One block per sequence (`batch`: non-causal segments of B rows at `seq_len ..`)
        -> the rows after the final norm: [P, H]"""
        ops, cfg = self.ops, self.cfg
        x = pad_rows(self.block_inputs(last), ROW_TILE)
        rope = self.rope.index_select(0, batch.row_pos)
        table = state.block_table
        writes = pool_index(table, batch.row_slot, batch.row_pos[: batch.rows])
        reads = ops.key_rows(batch, table)
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for i, w in enumerate(self.layers):
            h = self._norm(x, w.input)
            kv = ops.linear(h, w.kv)
            qk = torch.cat([ops.linear(h, w.q), kv[:, : hkv * d]], 1).view(-1, hq + hkv, d)
            qk = apply_rope(ops.head_norm(qk, w.heads, w.heads, cfg.rms_norm_eps), rope)
            v = kv[:, hkv * d :].reshape(-1, hkv, d)
            k_pool, v_pool = state.dflash_k[i], state.dflash_v[i]
            _write(k_pool, v_pool, writes, qk[:, hq:], v, batch.rows)
            cache = Cache(k_pool, v_pool, None, table, writes, reads)
            out = ops.attend(qk[:, :hq].contiguous(), cache, batch).reshape(x.shape[0], -1)
            x = x + ops.linear(out, w.o)
            gate_up = ops.linear(self._norm(x, w.post), w.gate_up)
            inner = gate_up.shape[1] // 2
            act = torch.nn.functional.silu(gate_up[:, :inner]) * gate_up[:, inner:]
            x = x + ops.linear(act, w.down)
        return self._norm(x, self.norm)

    def _norm(self, x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.ops.rms_norm(x, w[0], w[1], self.cfg.rms_norm_eps)


def _write(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    writes: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: int,
) -> None:
    k_pool.view(-1, *k_pool.shape[2:]).index_put_((writes,), k[:rows])
    v_pool.view(-1, *v_pool.shape[2:]).index_put_((writes,), v[:rows])


def _rope(cfg: DFlashConfig, length: int) -> torch.Tensor:
    """[length, 2, d]: cos and sin signed for rotate-half (x2, x1) order, as the target's."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    sign = torch.cat([-torch.ones(d // 2), torch.ones(d // 2)])
    return torch.stack([emb.cos(), emb.sin() * sign], 1)
