"""The weights in the one layout the forward computes with, built as the checkpoint streams in.

Each source tensor is placed into its kept tensor the moment it arrives and dropped before the
next is read, so the engine never holds a checkpoint's tensors beside their packed copies:
- every linear as `[in, out]`, contiguous (`gpu_service/model/ops.py` says why);
- projections that feed one consumer fused and laid out by part: attention's q, k, output gate
  and v (`qkvg`), each SwiGLU's gate and up (`gate_up_proj`), GDN's `in_proj_qkvz` and
  `in_proj_ba` regrouped from per-key-head groups to per part;
- a MoE layer's experts stacked: `experts.w13` `[E, H, 2I]` (gate, then up) and `experts.w2`
  `[E, I, H]`;
- with tied embeddings, only `lm_head` `[H, V]`: the embedding is looked up in its columns;
- the zero-centred norms that only feed linears folded into those linears' rows (`fold_norms`).
Everything else (norms, conv taps, A_log, dt_bias, an untied embedding) is kept as loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from gpu_service.config import ModelConfig

Index = tuple[int | slice, ...]
# (kept tensor's key, its whole shape, where this piece goes in it, the piece as [in, out])
Piece = tuple[str, tuple[int, ...], Index, torch.Tensor]


@dataclass
class Packed:
    linears: dict[str, torch.Tensor] = field(default_factory=dict)  # [in, out] (experts: [E, ..])
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)  # as loaded, by HF name


def pack(cfg: ModelConfig, stream: Iterable[tuple[str, torch.Tensor]]) -> Packed:
    """Source tensors by HF name -> the kept layout (norms not folded yet)."""
    out = Packed()
    for name, t in stream:
        pieces = _pieces(cfg, name, t)
        if pieces is None:
            out.vectors[name] = t
            continue
        for key, shape, index, piece in pieces:
            if key not in out.linears:
                out.linears[key] = torch.empty(shape, dtype=t.dtype, device=t.device)
            out.linears[key][index].copy_(piece)
        del t, pieces
    return out


def _pieces(cfg: ModelConfig, name: str, t: torch.Tensor) -> list[Piece] | None:
    """Where source tensor `name` goes; None: kept as loaded."""
    if name == "model.embed_tokens.weight":
        return _whole("lm_head", t) if cfg.tie_word_embeddings else None
    if name == "lm_head.weight":
        return _whole("lm_head", t)
    if not name.endswith(".weight") or t.dim() != 2:
        return None
    base = name.removesuffix(".weight")
    prefix, _, kind = base.rpartition(".")
    if kind in ("q_proj", "k_proj", "v_proj"):
        return _attention_piece(cfg, prefix, kind, t)
    if kind in ("gate_proj", "up_proj", "down_proj"):
        return _mlp_piece(cfg, prefix, kind, t)
    if kind == "in_proj_qkvz":
        return _whole(base, _gdn_qkvz(cfg, t))
    if kind == "in_proj_ba":
        ratio = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        return _whole(base, _by_group(t, cfg.linear_num_key_heads, [ratio, ratio]))
    return _whole(base, t)


def _whole(key: str, t: torch.Tensor) -> list[Piece]:
    """t: [out, in] -> the kept [in, out]."""
    return [(key, (t.shape[1], t.shape[0]), (), t.t())]


def _attention_piece(cfg: ModelConfig, p: str, kind: str, t: torch.Tensor) -> list[Piece]:
    """Columns of `{p}.qkvg`: [q (Hq d) | k (Hkv d) | gate (Hq d) | v (Hkv d)]; q_proj holds q
    and the gate per head."""
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    shape = (cfg.hidden_size, 2 * (hq + hkv) * d)
    key, q_w, k_w = f"{p}.qkvg", hq * d, hkv * d
    if kind == "q_proj":
        q, gate = _by_group(t, hq, [d, d]).chunk(2)
        return [
            (key, shape, (slice(None), slice(0, q_w)), q.t()),
            (key, shape, (slice(None), slice(q_w + k_w, 2 * q_w + k_w)), gate.t()),
        ]
    start = q_w if kind == "k_proj" else 2 * q_w + k_w
    return [(key, shape, (slice(None), slice(start, start + k_w)), t.t())]


def _mlp_piece(cfg: ModelConfig, p: str, kind: str, t: torch.Tensor) -> list[Piece]:
    """A SwiGLU's gate and up into `{p}.gate_up_proj` [H, 2I]; an expert's into its layer's
    stacked `experts.w13` [E, H, 2I] and `experts.w2` [E, I, H]."""
    layer, _, expert = p.rpartition(".experts.")
    stacked = bool(layer) and expert.isdigit()
    if kind == "down_proj":
        if not stacked:
            return _whole(f"{p}.down_proj", t)
        shape = (cfg.num_experts, t.shape[1], t.shape[0])
        return [(f"{layer}.experts.w2", shape, (int(expert),), t.t())]
    inner = t.shape[0]
    cols = slice(0, inner) if kind == "gate_proj" else slice(inner, 2 * inner)
    if not stacked:
        return [(f"{p}.gate_up_proj", (t.shape[1], 2 * inner), (slice(None), cols), t.t())]
    shape = (cfg.num_experts, t.shape[1], 2 * inner)
    return [(f"{layer}.experts.w13", shape, (int(expert), slice(None), cols), t.t())]


def _by_group(t: torch.Tensor, groups: int, parts: list[int]) -> torch.Tensor:
    """Rows laid out per group [part 0, part 1, ...] -> all groups' part 0, then part 1, ..."""
    split = t.view(groups, sum(parts), -1).split(parts, dim=1)
    return torch.cat([s.reshape(-1, t.shape[-1]) for s in split])


def _gdn_qkvz(cfg: ModelConfig, t: torch.Tensor) -> torch.Tensor:
    """in_proj_qkvz per key-head group [q, k, v-group, z-group] -> [q, k, v, z] by part."""
    dk, ratio = cfg.linear_key_head_dim, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    vg = ratio * cfg.linear_value_head_dim
    return _by_group(t, cfg.linear_num_key_heads, [dk, dk, vg, vg])


# Norms whose output only feeds linears: their (1 + w) is folded into those linears' weights
# (row j of an [in, out] weight scaled by 1 + w_j), one multiplication fewer per norm.
_FOLDED = {
    "input_layernorm": ("self_attn.qkvg", "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"),
    "post_attention_layernorm": (
        "mlp.gate_up_proj",
        "mlp.gate",
        "mlp.shared_expert.gate_up_proj",
        "mlp.shared_expert_gate",
        "mlp.experts.w13",
    ),
}


def fold_norms(
    linears: dict[str, torch.Tensor], norms: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> set[str]:
    """Scale, in place, each foldable norm's consumers in `linears` by its 1 + w; -> the norms
    folded."""
    folded = set()
    for name, (_, one_plus) in norms.items():
        prefix, _, kind = name.rpartition(".")
        if name == "mtp.pre_fc_norm_hidden":
            fc = linears["mtp.fc"]  # its input is [embedding; hidden]
            _scale_rows_(fc[fc.shape[0] // 2 :], one_plus)
            folded.add(name)
            continue
        targets = [f"{prefix}.{c}" for c in _FOLDED.get(kind, ())]
        for key in (k for k in targets if k in linears):
            weight = linears[key]
            # Stacked experts in eighths: the fp32 copy stays a fraction of the tensor.
            for part in weight.chunk(8) if weight.dim() == 3 else [weight]:
                _scale_rows_(part, one_plus)
            folded.add(name)
    return folded


def _scale_rows_(weight_t: torch.Tensor, one_plus: torch.Tensor) -> None:
    """Row j of weight_t [in, out] (or [E, in, out]) times one_plus[j], in fp32, rounded back
    in place."""
    rows = one_plus.to(weight_t.device)[:, None]
    weight_t.copy_((weight_t.float() * rows).to(weight_t.dtype))
