"""The eager forward of the hybrid GDN/attention decoder and its MTP head, over a batch of
sequences, each contributing consecutive rows (`Segment`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_service.config import FULL, ModelConfig
from gpu_service.model.ops import ROW_TILE, apply_rope, linear, pad_rows, rope_table
from gpu_service.state import DeviceState
from kernels.attention.naive import KEY_BLOCK, tiled_attention
from kernels.causal_conv1d.naive import causal_conv1d, causal_conv1d_update
from kernels.common import exp, sigmoid, silu, softplus
from kernels.gated_delta_rule.naive import chunk_gated_delta_rule, recurrent_gated_delta_rule
from kernels.rmsnorm.naive import gated_rms_norm, rms_norm


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a batched call: rows `row .. row + count - 1` of the batch sit at
    positions `start .. start + count - 1` of the sequence on `slot`."""

    slot: int
    start: int
    count: int
    row: int

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.count)

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.count)


PREFILL, VERIFY = "prefill", "verify"
# The drafter's LM head runs in tiles of this many rows: it proposes for a few sequences at a
# time, and the vocabulary-wide matmul of a 16-row tile costs 5x that of one row (4096 x 128:
# 0.19 ms against 0.04 on a CPU core); 4 rows cost 0.09. Fixed, so drafts stay batch invariant.
DRAFT_LOGITS_TILE = 4


class HybridModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_context: int):
        self.cfg, self.w = cfg, weights
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.device = weights["model.embed_tokens.weight"].device
        cos, sin = rope_table(cfg.rotary_dim, cfg.rope_theta, max_context)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        self.linear_index = {n: i for i, n in enumerate(cfg.linear_layers)}
        self.triton = False  # the `triton` forwards: per-sequence parts as Triton kernels
        self.full_index = {n: i for i, n in enumerate(cfg.full_layers)}

    # -- target model ------------------------------------------------------------------

    def forward(
        self,
        tokens: torch.Tensor,
        segs: list[Segment],
        state: DeviceState,
        mode: str,
        write_live: bool = True,
    ) -> torch.Tensor:
        """tokens: [R] -> final hidden after the model's norm: [P, H] (P = R padded).

        PREFILL runs GDN in chunked form and leaves the final state live; VERIFY runs it row
        by row, keeping every row's state in the slot's verify buffer, and advances the live
        state only when `write_live`."""
        x = pad_rows(self.w["model.embed_tokens.weight"][tokens])
        positions = self._positions(segs, x.shape[0])
        for n, kind in enumerate(self.cfg.layer_types):
            p = f"model.layers.{n}"
            h = self._norm(x, f"{p}.input_layernorm")
            if kind == FULL:
                i = self.full_index[n]
                cache = (state.k_cache[i], state.v_cache[i], None)
                h = self._attention(f"{p}.self_attn", h, segs, positions, cache)
            else:
                h = self._gdn(
                    f"{p}.linear_attn", self.linear_index[n], h, segs, state, mode, write_live
                )
            x = x + h
            x = x + self._mlp(f"{p}.mlp", self._norm(x, f"{p}.post_attention_layernorm"))
        return self._norm(x, "model.norm")

    def logits(self, hidden: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
        """hidden: [R, H] -> [R, vocab], in tiles of `tile` rows."""
        return linear(pad_rows(hidden, tile), self.lm_head, tile)[: hidden.shape[0]]

    # -- MTP head ----------------------------------------------------------------------

    def mtp_forward(
        self, tokens: torch.Tensor, hidden: torch.Tensor, segs: list[Segment], state: DeviceState
    ) -> torch.Tensor:
        """One drafter pass: row r pairs token r with hidden r (the hidden of the position
        before it) at its segment's positions, writing the drafter's KV there.
        tokens: [R], hidden: [R, H] -> the drafter's hidden after its norm: [P, H]"""
        emb = self._norm(
            pad_rows(self.w["model.embed_tokens.weight"][tokens]), "mtp.pre_fc_norm_embedding"
        )
        hid = self._norm(pad_rows(hidden), "mtp.pre_fc_norm_hidden")
        x = linear(torch.cat([emb, hid], dim=-1), self.w["mtp.fc.weight"])
        positions = self._positions(segs, x.shape[0])
        p = "mtp.layers.0"
        cache = (state.mtp_k, state.mtp_v, state.mtp_valid)
        x = x + self._attention(
            f"{p}.self_attn", self._norm(x, f"{p}.input_layernorm"), segs, positions, cache
        )
        x = x + self._mlp(f"{p}.mlp", self._norm(x, f"{p}.post_attention_layernorm"))
        return self._norm(x, "mtp.norm")

    # -- layers ------------------------------------------------------------------------

    def _positions(self, segs: list[Segment], padded: int) -> torch.Tensor:
        pos = torch.zeros(padded, dtype=torch.long, device=self.device)
        for s in segs:
            pos[s.rows] = s.positions.to(self.device)
        return pos

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self._rms_norm(x, self.w[f"{name}.weight"])

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.triton:
            from gpu_service.model import triton_forward

            return triton_forward.rms_norm(x, w, self.cfg.rms_norm_eps)
        return rms_norm(x, w, self.cfg.rms_norm_eps)

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        if f"{p}.gate.weight" in self.w:
            return self._moe(p, x)
        gate = linear(x, self.w[f"{p}.gate_proj.weight"])
        up = linear(x, self.w[f"{p}.up_proj.weight"])
        return linear(silu(gate) * up, self.w[f"{p}.down_proj.weight"])

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's sparse block: softmax router, top-k experts (renormalised when
        `norm_topk_prob`), each expert over the rows routed to it, plus the shared expert
        gated by sigmoid. A row's sum runs over experts in index order: batch invariant."""
        cfg = self.cfg
        logits = linear(x, self.w[f"{p}.gate.weight"]).float()  # [P, E]
        probs = exp(logits - logits.amax(-1, keepdim=True))
        probs = probs / probs.sum(-1, keepdim=True)
        weights, chosen = probs.topk(cfg.num_experts_per_tok, dim=-1)  # [P, k]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(cfg.num_experts):
            rows, rank = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                y = self._mlp(f"{p}.experts.{e}", pad_rows(x[rows]))[: rows.numel()]
                out.index_add_(0, rows, y * weights[rows, rank, None])
        if f"{p}.shared_expert_gate.weight" in self.w:
            gate = sigmoid(linear(x, self.w[f"{p}.shared_expert_gate.weight"]))
            out = out + gate * self._mlp(f"{p}.shared_expert", x)
        return out

    def _attention(
        self,
        p: str,
        x: torch.Tensor,
        segs: list[Segment],
        positions: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    ) -> torch.Tensor:
        cfg, rows = self.cfg, x.shape[0]
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q, gate = linear(x, self.w[f"{p}.q_proj.weight"]).view(rows, hq, 2 * d).split(d, dim=-1)
        k = linear(x, self.w[f"{p}.k_proj.weight"]).view(rows, hkv, d)
        v = linear(x, self.w[f"{p}.v_proj.weight"]).view(rows, hkv, d)
        q = self._rms_norm(q, self.w[f"{p}.q_norm.weight"])
        k = self._rms_norm(k, self.w[f"{p}.k_norm.weight"])
        cos, sin = self.cos[positions], self.sin[positions]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        _write_kv(k, v, segs, cache)
        if self.triton:
            from gpu_service.model import triton_forward

            out = triton_forward.attend(q, segs, cache)
        else:
            out = self._attend(q, segs, cache)
        out = out.reshape(rows, hq * d) * sigmoid(gate.reshape(rows, hq * d))
        return linear(out, self.w[f"{p}.o_proj.weight"])

    def _attend(
        self,
        q: torch.Tensor,
        segs: list[Segment],
        cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    ) -> torch.Tensor:
        """q: [P, Hq, d] over the cached keys and values -> [P, Hq, d], a segment at a time."""
        k_cache, v_cache, valid = cache
        out = q.new_zeros(q.shape)
        for s in segs:
            pos = s.positions.to(q.device)
            end = _key_blocks(s.start + s.count)
            seen = None if valid is None else valid[s.slot, :end]
            out[s.rows] = tiled_attention(
                q[s.rows], k_cache[s.slot, :end], v_cache[s.slot, :end], pos, seen
            )
        return out

    def _gdn(
        self,
        p: str,
        layer: int,
        x: torch.Tensor,
        segs: list[Segment],
        state: DeviceState,
        mode: str,
        write_live: bool,
    ) -> torch.Tensor:
        cfg, rows = self.cfg, x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, ratio = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
        # in_proj_qkvz is laid out per key head [q, k, v-group, z-group]; in_proj_ba [b, a].
        qkvz = linear(x, self.w[f"{p}.in_proj_qkvz.weight"]).view(rows, hk, -1)
        q, k, v, z = qkvz.split([dk, dk, ratio * dv, ratio * dv], dim=-1)
        b, a = linear(x, self.w[f"{p}.in_proj_ba.weight"]).view(rows, hk, -1).split(ratio, dim=-1)
        mixed = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], -1)
        beta = sigmoid(b.reshape(rows, hv).float())
        g = -exp(self.w[f"{p}.A_log"].float()) * softplus(
            a.reshape(rows, hv).float() + self.w[f"{p}.dt_bias"].float()
        )
        weight = self.w[f"{p}.conv1d.weight"][:, 0]
        if self.triton:
            from gpu_service.model import triton_forward

            out = triton_forward.mix_gdn(
                cfg, mixed, g, beta, segs, state, layer, weight, mode == PREFILL, write_live
            )
            normed = triton_forward.gated_rms_norm(
                out.to(x.dtype),
                z.reshape(rows, hv, dv).contiguous(),
                self.w[f"{p}.norm.weight"],
                cfg.rms_norm_eps,
            )
            return linear(normed.reshape(rows, hv * dv), self.w[f"{p}.out_proj.weight"])
        out = torch.zeros(rows, hv, dv, device=self.device)
        for s in segs:
            conv_in = mixed[s.rows]
            if mode == PREFILL:
                y, state.conv[layer, s.slot] = causal_conv1d(
                    conv_in, state.conv[layer, s.slot], weight
                )
            else:
                y, windows = causal_conv1d_update(conv_in, state.conv[layer, s.slot], weight)
                state.verify_conv[layer, state.verify_slice(s.slot, s.count)] = windows
                if write_live:
                    state.conv[layer, s.slot] = windows[-1]
            yq, yk, yv = y.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            args = (
                yq.reshape(-1, hk, dk),
                yk.reshape(-1, hk, dk),
                yv.reshape(-1, hv, dv),
                g[s.rows],
                beta[s.rows],
                state.gdn[layer, s.slot],
            )
            if mode == PREFILL:
                out[s.rows], state.gdn[layer, s.slot] = chunk_gated_delta_rule(*args)
            else:
                out[s.rows], states = recurrent_gated_delta_rule(*args)
                state.verify_gdn[layer, state.verify_slice(s.slot, s.count)] = states
                if write_live:
                    state.gdn[layer, s.slot] = states[-1]
        normed = gated_rms_norm(
            out.to(x.dtype), z.reshape(rows, hv, dv), self.w[f"{p}.norm.weight"], cfg.rms_norm_eps
        )
        return linear(normed.reshape(rows, hv * dv), self.w[f"{p}.out_proj.weight"])


def _write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    segs: list[Segment],
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
) -> None:
    """The new rows' keys and values into their slots at their positions (marked valid in the
    drafter's cache), before any row attends."""
    k_cache, v_cache, valid = cache
    for s in segs:
        pos = s.positions.to(k.device)
        k_cache[s.slot, pos] = k[s.rows]
        v_cache[s.slot, pos] = v[s.rows]
        if valid is not None:
            valid[s.slot, pos] = True


def _key_blocks(length: int) -> int:
    return -(-length // KEY_BLOCK) * KEY_BLOCK
