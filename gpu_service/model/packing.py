"""The weights in the one layout the forward computes with, built as the checkpoint streams in.

Each source tensor is placed into its kept tensor the moment it arrives and dropped before the
next is read, so the engine never holds a checkpoint's tensors beside their packed copies:
- every linear as `[in, out]`, contiguous (`gpu_service/model/ops.py` says why);
- projections that feed one consumer fused and laid out by part: attention's q, k, output gate
  and v (`qkvg`), each SwiGLU's gate and up (`gate_up_proj`), GDN's `in_proj_qkvz` and
  `in_proj_ba` regrouped from per-key-head groups to per part;
- a MoE layer's experts stacked: `experts.w13` `[E, H, 2I]` (gate, then up) and `experts.w2`
  `[E, I, H]`, E the experts held (`experts`: under expert parallelism, a rank's share, its
  first at index 0);
- with tied embeddings, only `lm_head` `[H, V]`: the embedding is looked up in its columns;
- the zero-centred norms that only feed linears folded into those linears' rows (`fold_norms`).
Everything else (norms, conv taps, A_log, dt_bias, an untied embedding) is kept as loaded;
the norms the forward applies itself get their `1 + w` in fp32 beside them (`norm_weights`,
`head_norms`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from gpu_service.model.config import ModelConfig
from gpu_service.model.quantization import SCALE_SUFFIX
from kernels.fp8.naive import BLOCK, FP8, BlockFp8

Index = tuple[int | slice, ...]
# (kept tensor's key, its whole shape, where this piece goes in it, the piece as [in, out])
Piece = tuple[str, tuple[int, ...], Index, torch.Tensor]


@dataclass
class Packed:
    # [in, out] (experts: [E, ..]); a linear stored in FP8 as a BlockFp8 of that layout
    linears: dict[str, torch.Tensor | BlockFp8] = field(default_factory=dict)
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)  # as loaded, by HF name


def pack(
    cfg: ModelConfig, stream: Iterable[tuple[str, torch.Tensor]], experts: range | None = None
) -> Packed:
    """Source tensors by HF name -> the kept layout (norms not folded yet). FP8 weights keep
    their bytes; their scales wait beside them (a 128th of a 128th of the weight) until every
    source of a kept tensor has come, and then become its scale grid (`_Fp8Grids`). `experts`:
    the routed experts the stream holds, by id (default: every one of `cfg`)."""
    held = range(cfg.num_experts) if experts is None else experts
    out = Packed()
    grids = _Fp8Grids(held)
    for stored, t in stream:
        name = cfg.canonical(stored)
        if name.endswith(SCALE_SUFFIX):
            grids.scales[name.removesuffix(SCALE_SUFFIX) + "weight"] = t
            continue
        pieces = _pieces(cfg, name, t, held)
        if pieces is None:
            out.vectors[name] = t
            continue
        for key, shape, index, piece in pieces:
            if key not in out.linears:
                out.linears[key] = torch.empty(shape, dtype=t.dtype, device=t.device)
            kept = out.linears[key]
            assert isinstance(kept, torch.Tensor)  # FP8 ones become BlockFp8 once all is read
            if kept.dtype != t.dtype:
                raise ValueError(f"{name} is {t.dtype}, but {key} fuses it with {kept.dtype}")
            kept[index].copy_(piece)
        if t.dtype == FP8:
            grids.place(cfg, name, t.shape)
        del t, pieces
    grids.finish(out.linears)
    return out


class _Fp8Grids:
    """The scale grids of the kept FP8 linears. A kept column's scale comes from the block of
    its source row in its source weight; the packing's regrouping (q and gate per head, GDN's
    groups) can cut a block's rows apart, so each kept column names its grid column, and the
    grid has a column per run of kept columns from one source block (`BlockFp8`)."""

    def __init__(self, held: range) -> None:
        self.held = held  # the routed experts stacked, by id
        self.scales: dict[str, torch.Tensor] = {}  # weight name -> weight_scale_inv
        # kept key -> per kept column: (source weight name, with an expert's index as {e}), row
        self.columns: dict[str, list[tuple[str, int] | None]] = {}
        self.stacked: set[str] = set()  # kept keys of stacked experts

    def place(self, cfg: ModelConfig, name: str, shape: torch.Size) -> None:
        """Record where each row of source weight `name` [out, in] went: the same packing run
        on its row numbers."""
        source, expert = _expert_template(name)
        if expert is not None and expert != self.held.start:
            return  # every expert's columns land where the first held one's do
        rows = torch.arange(shape[0]).view(-1, 1)
        for key, kept_shape, index, piece in _pieces(cfg, name, rows, self.held) or []:
            if expert is not None:
                self.stacked.add(key)
            columns = self.columns.setdefault(key, [None] * kept_shape[-1])
            cols = index[-1] if index and isinstance(index[-1], slice) else slice(None)
            for c, r in zip(
                range(*cols.indices(len(columns))), piece.reshape(-1).tolist(), strict=True
            ):
                columns[c] = (source, r)

    def finish(self, linears: dict[str, torch.Tensor | BlockFp8]) -> None:
        """Each FP8 kept tensor with its grid [KB, G] ([E, KB, G]) and column groups [N]."""
        for key, columns in self.columns.items():
            if any(c is None for c in columns):
                raise ValueError(f"{key} fuses FP8 weights with weights of another dtype")
            runs: list[tuple[str, int]] = []
            groups = []
            for source, row in columns:  # type: ignore[misc]
                run = (source, row // BLOCK)
                if not runs or runs[-1] != run:
                    runs.append(run)
                groups.append(len(runs) - 1)
            weight = linears[key]
            assert isinstance(weight, torch.Tensor)
            grid = self._grid(runs, key in self.stacked)
            group_t = torch.tensor(groups, dtype=torch.int32, device=weight.device)
            linears[key] = BlockFp8(weight, grid.to(weight.device), group_t)
        if self.scales:
            left = next(iter(self.scales)).removesuffix("weight") + SCALE_SUFFIX
            raise ValueError(f"{left} scales no FP8 weight")

    def _grid(self, runs: list[tuple[str, int]], experts: bool) -> torch.Tensor:
        """[KB, G] ([E, KB, G]): column g is its run's source block row of weight_scale_inv.
        The sources' scales are dropped once read."""
        sources = list(dict.fromkeys(source for source, _ in runs))
        tables: list[torch.Tensor] = []
        start: dict[str, int] = {}
        for source in sources:
            start[source] = sum(t.shape[-2] for t in tables)
            if not experts:
                tables.append(self.scales.pop(source))  # [NB, KB]
            else:
                names = [source.format(e=e) for e in self.held]
                tables.append(torch.stack([self.scales.pop(n) for n in names]))  # [E, NB, KB]
        rows = torch.tensor([start[source] + block for source, block in runs])
        table = torch.cat(tables, -2)
        return table.index_select(-2, rows.to(table.device)).transpose(-1, -2).float().contiguous()


def _expert_template(name: str) -> tuple[str, int | None]:
    """`...experts.7.up_proj.weight` -> (`...experts.{e}.up_proj.weight`, 7); others (name,
    None)."""
    layer, sep, rest = name.partition(".experts.")
    expert, dot, tail = rest.partition(".")
    if not sep or not expert.isdigit():
        return name, None
    return f"{layer}.experts.{{e}}.{tail}", int(expert)


def _pieces(cfg: ModelConfig, name: str, t: torch.Tensor, held: range) -> list[Piece] | None:
    """Where source tensor `name` goes (a routed expert among `held`); None: kept as loaded."""
    if name == "model.embed_tokens.weight":
        return _whole("lm_head", t) if cfg.tie_word_embeddings else None
    if name == "lm_head.weight":
        return _whole("lm_head", t)
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return _stacked_experts(name, t)
    if not name.endswith(".weight") or t.dim() != 2:
        return None
    base = name.removesuffix(".weight")
    prefix, _, kind = base.rpartition(".")
    if kind in ("q_proj", "k_proj", "v_proj"):
        return _attention_piece(cfg, prefix, kind, t)
    if kind in ("gate_proj", "up_proj", "down_proj"):
        return _mlp_piece(prefix, kind, t, held)
    if kind == "in_proj_qkvz":
        return _whole(base, _gdn_qkvz(cfg, t))
    if kind == "in_proj_ba":
        ratio = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        return _whole(base, _by_group(t, cfg.linear_num_key_heads, [ratio, ratio]))
    if kind in _SEPARATE_GDN:
        return _gdn_part(cfg, prefix, kind, t)
    return _whole(base, t)


# Qwen3.5's GDN projections, each already laid out by part: kept key, and where its columns
# start in it (in units of conv_dim, then of value heads).
_SEPARATE_GDN = {
    "in_proj_qkv": ("in_proj_qkvz", 0),
    "in_proj_z": ("in_proj_qkvz", 1),
    "in_proj_b": ("in_proj_ba", 0),
    "in_proj_a": ("in_proj_ba", 1),
}


def _gdn_part(cfg: ModelConfig, p: str, kind: str, t: torch.Tensor) -> list[Piece]:
    """Qwen3.5's `in_proj_qkv` [q, k, v] and `in_proj_z` into `{p}.in_proj_qkvz`'s columns,
    `in_proj_b` and `in_proj_a` into `{p}.in_proj_ba`'s: the kept layout Qwen3-Next's
    regrouping makes."""
    key, second = _SEPARATE_GDN[kind]
    if key == "in_proj_qkvz":
        width, start = cfg.conv_dim + cfg.value_dim, second * cfg.conv_dim
    else:
        width, start = 2 * cfg.linear_num_value_heads, second * cfg.linear_num_value_heads
    cols = slice(start, start + t.shape[0])
    return [(f"{p}.{key}", (t.shape[1], width), (slice(None), cols), t.t())]


def _stacked_experts(name: str, t: torch.Tensor) -> list[Piece]:
    """Stacked experts: `gate_up_proj` [E, 2I, H] (gate rows first) -> `experts.w13`
    [E, H, 2I]; `down_proj` [E, H, I] -> `experts.w2` [E, I, H]."""
    layer, _, kind = name.rpartition(".")
    key = f"{layer}.w13" if kind == "gate_up_proj" else f"{layer}.w2"
    moved = t.transpose(1, 2)
    return [(key, tuple(moved.shape), (), moved)]


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


def _mlp_piece(p: str, kind: str, t: torch.Tensor, held: range) -> list[Piece]:
    """A SwiGLU's gate and up into `{p}.gate_up_proj` [H, 2I]; an expert's (one of `held`)
    into its layer's stacked `experts.w13` [E, H, 2I] and `experts.w2` [E, I, H]."""
    layer, _, expert = p.rpartition(".experts.")
    stacked = bool(layer) and expert.isdigit()
    at = int(expert) - held.start if stacked else 0
    if kind == "down_proj":
        if not stacked:
            return _whole(f"{p}.down_proj", t)
        shape = (len(held), t.shape[1], t.shape[0])
        return [(f"{layer}.experts.w2", shape, (at,), t.t())]
    inner = t.shape[0]
    cols = slice(0, inner) if kind == "gate_proj" else slice(inner, 2 * inner)
    if not stacked:
        return [(f"{p}.gate_up_proj", (t.shape[1], 2 * inner), (slice(None), cols), t.t())]
    shape = (len(held), t.shape[1], 2 * inner)
    return [(f"{layer}.experts.w13", shape, (at, slice(None), cols), t.t())]


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
    linears: dict[str, torch.Tensor | BlockFp8],
    norms: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> set[str]:
    """Scale, in place, each foldable norm's consumers in `linears` by its 1 + w; -> the norms
    folded."""
    folded = set()
    for name, (_, one_plus) in norms.items():
        prefix, _, kind = name.rpartition(".")
        if name == "mtp.pre_fc_norm_hidden":
            fc = linears["mtp.fc"]  # its input is [embedding; hidden]
            if not isinstance(fc, torch.Tensor):
                continue  # FP8: see below
            _scale_rows_(fc[fc.shape[0] // 2 :], one_plus)
            folded.add(name)
            continue
        targets = [k for c in _FOLDED.get(kind, ()) if (k := f"{prefix}.{c}") in linears]
        if any(isinstance(linears[k], BlockFp8) for k in targets):
            continue  # scaling FP8 rows would round them again: the norm keeps its 1 + w
        for key in targets:
            weight = linears[key]
            assert isinstance(weight, torch.Tensor)
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


def norm_weights(w: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Zero-centred norms as (w, 1 + w in fp32)."""
    out = {}
    for name, t in w.items():
        part = name.split(".")[-2] if name.endswith(".weight") else ""
        if "norm" in part and not name.endswith("linear_attn.norm.weight"):
            out[name.removesuffix(".weight")] = (t, 1.0 + t.float())
    return out


def head_norms(
    cfg: ModelConfig, w: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each attention layer's q and k norms as one per-head pair, by layer prefix: the raw
    weights [2, d] and 1 + w per head [Hq + Hkv, d], q's scaled by d ** -0.5 (the attention's
    scale, applied once here)."""
    out = {}
    d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    for name in w:
        if name.endswith("q_norm.weight"):
            p = name.removesuffix(".q_norm.weight")
            qn, kn = w[f"{p}.q_norm.weight"], w[f"{p}.k_norm.weight"]
            per_head = torch.cat(
                [((1.0 + qn.float()) * d**-0.5).expand(hq, d), (1.0 + kn.float()).expand(hkv, d)]
            )
            out[p] = (torch.stack([qn, kn]), per_head.contiguous())
    return out
