"""The hybrid model's forward for training: batched equal-length windows from a zero state,
differentiable, over the same HF-named tensors the service loads. It computes what
`HybridModel` computes (tests compare the two); it is not batch invariant and keeps no cache,
so it runs on stock torch ops (F.linear, SDPA, conv1d) that have fast backwards.

Losses, as Qwen3-Next and DeepSeek-V3 train the MTP head: the main model predicts token t+1
from position t; the MTP head, from the main hidden at t and the embedding of t+1, predicts
t+2 (`mtp`). The drafter is also run once more on its own output, as it runs when proposing a
second draft (hidden of the MTP pass at t, embedding of t+2, predicts t+3: `mtp2`), seeing
what the service's drafter cache would hold then: the first pass's entries up to t and
itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_service.model.config import FULL, ModelConfig
from gpu_service.model.ops import rope_table
from kernels.gated_delta_rule.train import chunk_gated_delta_rule_batched


class TrainForward:
    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], max_len: int):
        self.cfg, self.p = cfg, params
        self.cos, self.sin = rope_table(cfg, max_len + 2)

    @property
    def lm_head(self) -> torch.Tensor:
        return self.p.get("lm_head.weight", self.p["model.embed_tokens.weight"])

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.p[f"{name}.weight"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * (1 + w)

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        if f"{p}.gate.weight" in self.p:
            raise NotImplementedError("training covers dense MLPs only")
        gate = F.linear(x, self.p[f"{p}.gate_proj.weight"])
        up = F.linear(x, self.p[f"{p}.up_proj.weight"])
        return F.linear(F.silu(gate) * up, self.p[f"{p}.down_proj.weight"])

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [B, T, H, d]; rotate-half over the first rotary dims
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        rot = cos.shape[-1]
        xr, rest = x[..., :rot], x[..., rot:]
        half = rot // 2
        rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
        return torch.cat([xr * cos + rotated * sin, rest], dim=-1)

    def qkv(
        self, p: str, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q [B, Hq, T, d], gate [B, T, Hq * d], k, v [B, Hkv, T, d]"""
        cfg = self.cfg
        b, t, _ = x.shape
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q, gate = F.linear(x, self.p[f"{p}.q_proj.weight"]).view(b, t, hq, 2 * d).split(d, -1)
        k = F.linear(x, self.p[f"{p}.k_proj.weight"]).view(b, t, hkv, d)
        v = F.linear(x, self.p[f"{p}.v_proj.weight"]).view(b, t, hkv, d)
        q, k = self.norm(q, f"{p}.q_norm"), self.norm(k, f"{p}.k_norm")
        q, k = self._rope(q, positions), self._rope(k, positions)
        return (
            q.transpose(1, 2),
            gate.reshape(b, t, hq * d),
            k.transpose(1, 2),
            v.transpose(1, 2),
        )

    def attend(
        self,
        p: str,
        q: torch.Tensor,
        gate: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        group = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate)
        return F.linear(out, self.p[f"{p}.o_proj.weight"])

    def gdn(self, p: str, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, ratio = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
        qkvz = F.linear(x, self.p[f"{p}.in_proj_qkvz.weight"]).view(b, t, hk, -1)
        q, k, v, z = qkvz.split([dk, dk, ratio * dv, ratio * dv], dim=-1)
        ba = F.linear(x, self.p[f"{p}.in_proj_ba.weight"]).view(b, t, hk, -1)
        beta_in, a = ba.split(ratio, dim=-1)
        mixed = torch.cat([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], -1)
        weight = self.p[f"{p}.conv1d.weight"]
        width = weight.shape[-1]
        conv = F.conv1d(mixed.transpose(1, 2), weight, padding=width - 1, groups=weight.shape[0])
        y = F.silu(conv[..., :t]).transpose(1, 2)
        yq, yk, yv = y.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        beta = torch.sigmoid(beta_in.reshape(b, t, hv))
        g = -self.p[f"{p}.A_log"].exp() * F.softplus(a.reshape(b, t, hv) + self.p[f"{p}.dt_bias"])
        out = chunk_gated_delta_rule_batched(
            yq.reshape(b, t, hk, dk), yk.reshape(b, t, hk, dk), yv.reshape(b, t, hv, dv), g, beta
        )
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        normed = self.p[f"{p}.norm.weight"] * normed * F.silu(z.reshape(b, t, hv, dv))
        return F.linear(normed.reshape(b, t, hv * dv), self.p[f"{p}.out_proj.weight"])

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] -> the final hidden after the model's norm: [B, T, H]"""
        return self.norm(self.residuals(tokens)[-1], "model.norm")

    def taps(self, tokens: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
        """A DFlash drafter's context: the outputs of decoder layers `layer_ids` (id i is the
        residual stream after layer i, before the final norm), concatenated in that order:
        [B, T, K * H]."""
        outs = self.residuals(tokens, max(layer_ids) + 1)
        return torch.cat([outs[i] for i in layer_ids], -1)

    def residuals(self, tokens: torch.Tensor, layers: int | None = None) -> list[torch.Tensor]:
        """tokens: [B, T] -> the residual stream after each of the first `layers` decoder
        layers (all by default): each [B, T, H]."""
        x = self.p["model.embed_tokens.weight"][tokens]
        positions = torch.arange(tokens.shape[1])
        outs = []
        for n, kind in enumerate(self.cfg.layer_types[:layers]):
            p = f"model.layers.{n}"
            h = self.norm(x, f"{p}.input_layernorm")
            if kind == FULL:
                h = self.attend(f"{p}.self_attn", *self.qkv(f"{p}.self_attn", h, positions), None)
            else:
                h = self.gdn(f"{p}.linear_attn", h)
            x = x + h
            x = x + self.mlp(f"{p}.mlp", self.norm(x, f"{p}.post_attention_layernorm"))
            outs.append(x)
        return outs

    def _mtp_input(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        emb = self.norm(self.p["model.embed_tokens.weight"][tokens], "mtp.pre_fc_norm_embedding")
        hid = self.norm(hidden, "mtp.pre_fc_norm_hidden")
        return F.linear(torch.cat([emb, hid], dim=-1), self.p["mtp.fc.weight"])

    def mtp(
        self, tokens: torch.Tensor, hidden: torch.Tensor, second: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens: [B, T], hidden: [B, T, H] (the main model's). Row t of the first pass pairs
        hidden t with token t + 1 at position t -> [B, T - 1, H]; row t of the second pass
        pairs the first pass's row t with token t + 2 at position t + 1 -> [B, T - 2, H]."""
        p, attn = "mtp.layers.0", "mtp.layers.0.self_attn"
        length = tokens.shape[1]
        x = self._mtp_input(tokens[:, 1:], hidden[:, :-1])
        pos1 = torch.arange(length - 1)
        q, gate, k1, v1 = self.qkv(attn, self.norm(x, f"{p}.input_layernorm"), pos1)
        x = x + self.attend(attn, q, gate, k1, v1, None)
        x = x + self.mlp(f"{p}.mlp", self.norm(x, f"{p}.post_attention_layernorm"))
        first = self.norm(x, "mtp.norm")
        if not second:
            return first, None
        rows = length - 2
        x = self._mtp_input(tokens[:, 2:], first[:, :-1])
        q, gate, k2, v2 = self.qkv(attn, self.norm(x, f"{p}.input_layernorm"), pos1[:rows] + 1)
        # row t sees the first pass's keys at positions <= t, and its own key
        idx = torch.arange(rows)
        mask = torch.cat([pos1[None, :] <= idx[:, None], idx[:, None] == idx[None, :]], dim=1)
        keys, values = torch.cat([k1, k2], dim=2), torch.cat([v1, v2], dim=2)
        x = x + self.attend(attn, q, gate, keys, values, mask)
        x = x + self.mlp(f"{p}.mlp", self.norm(x, f"{p}.post_attention_layernorm"))
        return first, self.norm(x, "mtp.norm")

    def losses(self, tokens: torch.Tensor, mtp2: bool = True) -> dict[str, torch.Tensor]:
        """Mean cross-entropies: `main` (t+1), `mtp` (t+2), `mtp2` (t+3)."""
        hidden = self.hidden(tokens)
        vocab = self.cfg.vocab_size

        def ce(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            logits = F.linear(h, self.lm_head)
            return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

        out = {"main": ce(hidden[:, :-1], tokens[:, 1:])}
        if self.cfg.has_mtp:
            first, second = self.mtp(tokens, hidden, mtp2)
            out["mtp"] = ce(first[:, :-1], tokens[:, 2:])
            if second is not None:
                out["mtp2"] = ce(second[:, :-1], tokens[:, 3:])
        return out

    def distill_losses(
        self, tokens: torch.Tensor, mtp2: bool = True, hard: float = 0.0
    ) -> dict[str, torch.Tensor]:
        """The MTP head against the target's own distributions (KL, teacher first), the target
        untouched: the first pass's row t against the target at t + 1 (both predict t + 2),
        the second's against the target at t + 2 (both predict t + 3). `hard` weighs a
        cross-entropy on the target's argmax besides: a greedy draft stands when its argmax
        is the target's, whatever the rest of the distribution."""
        with torch.no_grad():
            hidden = self.hidden(tokens)
            teacher = F.log_softmax(F.linear(hidden, self.lm_head).float(), dim=-1)
        vocab = self.cfg.vocab_size

        def loss(h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            student = F.log_softmax(F.linear(h, self.lm_head), dim=-1).reshape(-1, vocab)
            target = target.reshape(-1, vocab)
            kl = F.kl_div(student, target, log_target=True, reduction="batchmean")
            if not hard:
                return kl
            return kl + hard * F.nll_loss(student, target.argmax(-1))

        first, second = self.mtp(tokens, hidden, mtp2)
        out = {"mtp": loss(first[:, :-1], teacher[:, 1:-1])}
        if second is not None:
            out["mtp2"] = loss(second[:, :-1], teacher[:, 2:-1])
        return out
