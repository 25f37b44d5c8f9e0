"""The forward of the hybrid GDN/attention decoder and its MTP head over a batch of sequences,
each contributing consecutive rows (`Segment`), with the call's metadata in a `Batch`.

Every layer runs over all rows at once: the number of operations does not grow with the batch,
and a row's bytes do not depend on the rows beside it (row tiles, fixed tiles and key blocks,
padding that adds exact zeros). The per-layer parts that differ by backend (norms, attention,
the GDN mix, argmax, fold) sit behind an ops object (`gpu_service.model.backend`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from gpu_service.model.backend import EAGER, Cache, Ops
from gpu_service.model.batch import Batch, Layout, Segment, build
from gpu_service.model.config import FULL, ModelConfig
from gpu_service.model.mrope import ImageRows, rope_rows, streams
from gpu_service.model.ops import ROW_TILE, apply_rope, pad_rows, rope_table
from gpu_service.model.packing import fold_norms, head_norms, norm_weights, pack
from gpu_service.model.placement import placed_moe
from gpu_service.model.shard import Shard, expert_range, vocab_range
from gpu_service.model.state import DeviceState
from gpu_service.model.vision import VISION_PREFIX, VisionTower
from gpu_service.tp.group import TpGroup
from kernels.attention.naive import KEY_BLOCK, pool_index
from kernels.common import sigmoid, silu, softplus
from kernels.moe.naive import route

__all__ = ["PREFILL", "VERIFY", "HybridModel", "Segment"]

PREFILL, VERIFY = "prefill", "verify"
# Query rows per attention tile: a verify's or a draft's rows fit one; a prefill's go in
# larger tiles, so that a long prompt reads its keys fewer times.
QUERY_TILE = {PREFILL: 64, VERIFY: 4}
GDN_CHUNK = 64
_MTP_EMBED_NORM = "mtp.pre_fc_norm_embedding"


class HybridModel:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        max_context: int,
        tp: TpGroup | None = None,
    ):
        """`weights`: the checkpoint's tensors by HF name, best as a stream (`stream_weights`),
        so that each is dropped once packed (`gpu_service/model/packing.py`). Under tensor
        parallelism (`tp`), `cfg` and `weights` are this rank's (`gpu_service/model/shard.py`):
        each row-parallel output is summed over the ranks, and the embedding and LM head hold
        this rank's token ids; under expert parallelism (`tp.expert_parallel`) the rank holds
        its share of the routed experts whole (`self.experts`), their rows exchanged
        (`gpu_service/model/placement.py`). The vision tower's tensors (`model.visual.*`)
        go to the tower (`self.vision`), whole on every rank."""
        weights, tower = _diverted(weights)
        shard = None if tp is None else Shard(tp.rank, tp.size, tp.expert_parallel)
        # The routed experts held, by id: stacked from index 0 in `experts.w13` and `.w2`.
        self.experts = expert_range(cfg.num_experts, shard)
        packed = pack(cfg, weights, self.experts)
        self.tp = tp
        self.vocab = (0, cfg.vocab_size) if shard is None else vocab_range(cfg.vocab_size, shard)
        self.cfg, self.wt, self.vectors = cfg, packed.linears, packed.vectors
        # Untied: the embedding as loaded, [V, H]; tied: None, looked up in lm_head's columns.
        self.embed = self.vectors.pop("model.embed_tokens.weight", None)
        table = self.embed if self.embed is not None else self.wt["lm_head"]  # [V, H] / [H, V]
        if not isinstance(table, torch.Tensor):
            raise ValueError("lm_head is FP8 and tied to the embedding, which is looked up in it")
        # The activations' dtype: the embedding's, whatever the linears are held in.
        self.dtype, self.device = table.dtype, table.device
        self.rope = _rope_table(cfg, max_context).to(self.device)
        v = cfg.vision
        self.vision = None if v is None else VisionTower(v, tower, self.dtype, self.device)
        self.linear_index = {n: i for i, n in enumerate(cfg.linear_layers)}
        self.full_index = {n: i for i, n in enumerate(cfg.full_layers)}
        norms = norm_weights(self.vectors)
        folded = fold_norms(self.wt, norms)
        # A folded norm keeps zeros as its weight (1 + 0 for a kernel that applies 1 + w) and
        # no multiplier.
        self.norms: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
            n: (torch.zeros_like(w), None) if n in folded else (w, one_plus)
            for n, (w, one_plus) in norms.items()
        }
        self.head_norms = head_norms(cfg, self.vectors)
        self.neg_a = {  # -exp(A_log) per GDN layer, fp32
            n: -self.vectors.pop(f"model.layers.{n}.linear_attn.A_log").float().exp()
            for n in cfg.linear_layers
        }
        self.ba_bias = {  # [b, a] columns: 0 for b, dt_bias for a
            n: torch.cat([torch.zeros_like(b), b]).float()
            for n in cfg.linear_layers
            for b in [self.vectors.pop(f"model.layers.{n}.linear_attn.dt_bias")]
        }
        self.ops: Ops = EAGER
        # A DFlash drafter's context (`attach_taps`): these layers' outputs, concatenated in
        # this order, go to `tap_sink` after the last of them, in every prefill and verify.
        self.taps: tuple[int, ...] = ()
        self.tap_sink: Callable[[torch.Tensor, Batch, DeviceState], None] | None = None

    def attach_taps(
        self, taps: tuple[int, ...], sink: Callable[[torch.Tensor, Batch, DeviceState], None]
    ) -> None:
        """Id i is the residual stream after decoder layer i, before the final norm (z-lab's
        `extract_context_feature`: `hidden_states[i + 1]`)."""
        self.taps, self.tap_sink = taps, sink

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [R] -> their embeddings [R, H], contiguous: a transposed view would reach
        the GEMMs in a layout whose kernel depends on the row count. Vocab-parallel: each rank
        looks up the ids it holds, zeros elsewhere, and the sum over ranks adds exact zeros."""
        if self.tp is None:
            return self._lookup(tokens)
        start, stop = self.vocab
        local = tokens - start
        held = (local >= 0) & (local < stop - start)
        rows = self._lookup(torch.where(held, local, 0))
        return self.tp.reduce(torch.where(held[:, None], rows, 0))

    def embed_padded(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [R] -> `embed_rows` padded to [P, H]. Compiled, the tokens are padded
        (padding rows embed token 0, never read) rather than the rows: inductor fuses the
        lookup into the first norm, and a concatenation of zero rows, present or not by the row
        count, changed which axis that norm's sum ran along, and so its bytes."""
        if torch.compiler.is_compiling():
            return self.embed_rows(pad_rows(tokens, ROW_TILE))
        return pad_rows(self.embed_rows(tokens), ROW_TILE)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return self.embed.index_select(0, ids)
        lm_head = self.wt["lm_head"]
        assert isinstance(lm_head, torch.Tensor)  # HybridModel refuses a tied FP8 lm_head
        return lm_head.index_select(1, ids).t().contiguous()

    def _reduced(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel output summed over the ranks (`TpGroup.reduce`)."""
        return x if self.tp is None else self.tp.reduce(x)

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor the model holds for its weights (norms, tables and biases included),
        each storage once: what a memory plan and the load test count."""
        return list(self.named_held().values())

    def named_held(self) -> dict[str, torch.Tensor]:
        """`held_tensors` by where the model keeps each (`wt.<name>`, `norms.<name>.1`, ...):
        the first place a storage is reached names it."""
        found: dict[int, tuple[str, torch.Tensor]] = {}

        def visit(path: str, v: object) -> None:
            if isinstance(v, torch.Tensor):
                found.setdefault(_storage_key(v), (path, v))
            elif isinstance(v, dict):
                for k, x in v.items():
                    visit(f"{path}.{k}", x)
            elif isinstance(v, (tuple, list)):
                for i, x in enumerate(v):
                    visit(f"{path}.{i}", x)

        for name, value in vars(self).items():
            if name not in ("rope", "tp", "vision"):
                visit(name, value)
        if self.vision is not None:
            visit("vision", self.vision.held())
        return dict(found.values())

    def ops_norm(self, x: torch.Tensor, name: str, ops: Ops) -> torch.Tensor:
        raw, one_plus = self.norms[name]
        return ops.rms_norm(x, raw, one_plus, self.cfg.rms_norm_eps)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.ops_norm(x, name, self.ops)

    def layout(self, state: DeviceState, mode: str) -> Layout:
        """A call's shape parameters; in a verify, the pad slot's rows start at `pad_vrow`."""
        return Layout(
            query_tile=QUERY_TILE[mode],
            key_block=KEY_BLOCK,
            conv_width=self.cfg.linear_conv_kernel_dim,
            chunk=GDN_CHUNK if mode == PREFILL else 0,
            verify_offset=(*state.verify_offset, state.pad_vrow) if mode == VERIFY else (),
            pad_vrow=state.pad_vrow,
        )

    def batch(self, segs: list[Segment], state: DeviceState, mode: str) -> Batch:
        return build(segs, self.layout(state, mode), ROW_TILE, self.device)

    # -- target model ------------------------------------------------------------------

    def forward(
        self,
        tokens: torch.Tensor,
        segs: list[Segment] | Batch,
        state: DeviceState,
        mode: str,
        write_live: bool = True,
        images: ImageRows | None = None,
    ) -> torch.Tensor:
        """tokens: [R] -> final hidden after the model's norm: [P, H] (P = R padded).

        PREFILL runs GDN in chunked form and leaves the final state live; VERIFY runs it row
        by row, keeping every row's state in the slot's verify buffer, and advances the live
        state only when `write_live`. `images`: a prefill's image rows and every row's RoPE
        (a chunk holding image tokens, or following them: `gpu_service/model/mrope.py`)."""
        batch = segs if isinstance(segs, Batch) else self.batch(segs, state, mode)
        x = self.embed_padded(tokens)
        if images is not None and images.rows is not None and images.embeds is not None:
            x = x.index_copy(0, images.rows, images.embeds.to(x.dtype))
        rope = self.row_rope(batch, state) if images is None else images.rope
        writes, reads = self._kv_rows(batch, state)
        tapped: dict[int, torch.Tensor] = {}
        for n, kind in enumerate(self.cfg.layer_types):
            p = f"model.layers.{n}"
            h = self._norm(x, f"{p}.input_layernorm")
            if kind == FULL:
                i = self.full_index[n]
                k, v = state.k_cache[i], state.v_cache[i]
                stack = (state.k_cache, state.v_cache)
                cache = Cache(k, v, None, state.block_table, writes, reads, stack, i)
                h = self._attention(f"{p}.self_attn", h, batch, rope, cache)
            else:
                h = self._gdn(n, h, batch, state, mode, write_live)
            x = x + h
            x = x + self._mlp(f"{p}.mlp", self._norm(x, f"{p}.post_attention_layernorm"))
            if n in self.taps:
                tapped[n] = x
                if len(tapped) == len(self.taps) and self.tap_sink is not None:
                    self.tap_sink(torch.cat([tapped[i] for i in self.taps], -1), batch, state)
        return self._norm(x, "model.norm")

    def row_rope(self, batch: Batch, state: DeviceState) -> torch.Tensor:
        """Each row's RoPE [P, 2, rot] at its position; with a vision tower, at its position
        plus its sequence's shift (`DeviceState.rope_shift`: 0 for text alone, the text after
        images goes on from where they left off)."""
        index = batch.row_pos
        if self.vision is not None:
            shift = state.rope_shift.index_select(0, batch.row_slot)
            index = index + torch.nn.functional.pad(shift, (0, index.shape[0] - shift.shape[0]))
        return self.rope.index_select(0, index)

    def image_rope(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: [3, R] (time, height, width) -> RoPE [P, 2, rot], padding rows at 0."""
        assert self.cfg.vision is not None
        padded = pad_rows(positions.t(), ROW_TILE).t()
        columns = streams(self.cfg.vision.mrope_section, self.cfg.rotary_dim)
        return rope_rows(self.rope, padded.to(self.device), columns)

    def _kv_rows(
        self, batch: Batch, state: DeviceState
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where a call's rows write their keys and values in the pools, and where its tiles
        read theirs (`Cache`): once a call, for every layer."""
        table = state.block_table
        writes = pool_index(table, batch.row_slot, batch.row_pos[: batch.rows])
        return writes, self.ops.key_rows(batch, table)

    def logits(self, hidden: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
        """hidden: [R, H] -> [R, vocab], in tiles of `tile` rows. Vocab-parallel, only this
        rank's token ids' columns (`self.vocab`): `argmax_logprob` and `draft_argmax` combine
        the ranks' without any rank holding every column, and `full_logits` gathers them where
        a caller needs them all (sampling, reading them back)."""
        return self.ops.linear(pad_rows(hidden, tile), self.wt["lm_head"], tile)[: hidden.shape[0]]

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` columns of every token id: the ranks' gathered in rank order."""
        if self.tp is None:
            return logits
        widths = [
            b - a
            for a, b in (
                vocab_range(self.cfg.vocab_size, Shard(r, self.tp.size))
                for r in range(self.tp.size)
            )
        ]
        return self.tp.gather_columns(logits, widths)

    def held_columns(self, allowed: torch.Tensor) -> torch.Tensor:
        """A mask over every token id -> over the ids whose logits this rank holds."""
        return allowed[self.vocab[0] : self.vocab[1]]

    def argmax_logprob(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`Ops.argmax_logprob` of `logits` (this rank's columns under tensor parallelism)."""
        if self.tp is None:
            return self.ops.argmax_logprob(logits)
        top, normaliser = self._combined(logits)
        return top, -torch.log(normaliser)

    def draft_argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`Ops.draft_argmax` of `logits` (this rank's columns under tensor parallelism)."""
        if self.tp is None:
            return self.ops.draft_argmax(logits)
        top, normaliser = self._combined(logits)
        return top, normaliser.reciprocal()

    def _combined(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's argmax over every rank's columns and its softmax normaliser
        sum(exp(l - max)), fp32, from each rank's (max, first index, normaliser) gathered and
        combined in rank order: the first rank holding the maximum wins a tie, as the lowest id
        does on one device."""
        assert self.tp is not None
        x = logits.float()
        high, index = x.max(-1)
        # A row this rank masked out whole has max -inf: it adds nothing.
        empty = torch.isneginf(high)
        local = torch.where(empty, 0.0, torch.exp(x - high.masked_fill(empty, 0)[:, None]).sum(-1))
        stats = torch.stack([high.double(), local.double(), (index + self.vocab[0]).double()], 1)
        parts = self.tp.gather(stats)
        best = torch.stack([p[:, 0] for p in parts]).amax(0)
        top = torch.full_like(index, -1)
        normaliser = torch.zeros_like(high)
        for p in parts:
            first = (top < 0) & (p[:, 0] == best)
            top = torch.where(first, p[:, 2].long(), top)
            normaliser = normaliser + p[:, 1].float() * torch.exp((p[:, 0] - best).float())
        return top, normaliser

    # -- MTP head ----------------------------------------------------------------------

    def mtp_forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        segs: list[Segment] | Batch,
        state: DeviceState,
        kv_only: bool = False,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One drafter pass: row r pairs token r with hidden r (the hidden of the position
        before it) at its segment's positions, writing the drafter's KV there.
        tokens: [R], hidden: [R, H] -> the drafter's hidden after its norm: [P, H]; with
        `kv_only` (priming from a prompt) it stops once the KV is written. `rope`: the rows'
        RoPE where a prompt's images place them (`image_rope` of the hidden rows' positions)."""
        batch = segs if isinstance(segs, Batch) else self.batch(segs, state, VERIFY)
        # norm_e(embed(t)) of each row's token: a row-wise norm, so the same bytes as a table.
        emb = self.ops_norm(self.embed_padded(tokens), _MTP_EMBED_NORM, EAGER)
        hid = self._norm(pad_rows(hidden, ROW_TILE), "mtp.pre_fc_norm_hidden")
        x = self.ops.linear(torch.cat([emb, hid], dim=-1), self.wt["mtp.fc"])
        p = "mtp.layers.0"
        kv = (state.mtp_k, state.mtp_v, state.mtp_valid, state.block_table)
        cache = Cache(*kv, *self._kv_rows(batch, state))
        h = self._norm(x, f"{p}.input_layernorm")
        rope = self.row_rope(batch, state) if rope is None else rope
        if kv_only:
            self._project_kv(f"{p}.self_attn", h, batch, rope, cache)
            return None
        x = x + self._attention(f"{p}.self_attn", h, batch, rope, cache)
        x = x + self._mlp(f"{p}.mlp", self._norm(x, f"{p}.post_attention_layernorm"))
        return self._norm(x, "mtp.norm")

    # -- layers ------------------------------------------------------------------------

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        if f"{p}.gate" not in self.wt:
            return self._reduced(self._swiglu(p, x))
        routed, shared = self._moe(p, x), self._shared_expert(p, x)
        if self.placed:  # the routed sum is whole already; the shared expert is split
            return routed if shared is None else routed + self._reduced(shared)
        return self._reduced(routed if shared is None else routed + shared)

    @property
    def placed(self) -> bool:
        """Whether the routed experts are placed on ranks (expert parallelism)."""
        return self.tp is not None and self.tp.expert_parallel

    def _swiglu(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """A SwiGLU MLP; under tensor parallelism, this rank's part of the sum."""
        gate_up = self.ops.linear(x, self.wt[f"{p}.gate_up_proj"])  # [P, 2I]: gate, then up
        inner = gate_up.shape[1] // 2
        act = silu(gate_up)[:, :inner] * gate_up[:, inner:]
        return self.ops.linear(act, self.wt[f"{p}.down_proj"])

    def _moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's routed experts: softmax router, top-k experts (renormalised when
        `norm_topk_prob`), each expert over only the rows routed to it, a row's outputs added
        in expert-index order (batch invariant). Under tensor parallelism every expert's
        intermediate is split: this rank's part of the sum; under expert parallelism the rows
        go to their experts' ranks and back: the whole sum."""
        cfg = self.cfg
        logits = self.ops.linear(x, self.wt[f"{p}.gate"]).float()  # [P, E]
        weights, experts = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        w13, w2 = self.wt[f"{p}.experts.w13"], self.wt[f"{p}.experts.w2"]
        if self.placed:
            assert self.tp is not None
            moe, held = self.ops.moe, self.experts
            return placed_moe(moe, x, w13, w2, experts, weights.to(x.dtype), held, self.tp)
        return self.ops.moe(x, w13, w2, experts, weights.to(x.dtype))

    def _shared_expert(self, p: str, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert gated by sigmoid (this rank's part under tensor parallelism), or
        None where the layer has none."""
        if f"{p}.shared_expert_gate" not in self.wt:
            return None
        gate = sigmoid(self.ops.linear(x, self.wt[f"{p}.shared_expert_gate"]))
        return gate * self._swiglu(f"{p}.shared_expert", x)

    def _qkv(
        self, p: str, x: torch.Tensor, rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q [P, Hq, d] (scaled by d ** -0.5), gate [P, Hq * d], k, v [P, Hkv, d]"""
        cfg, rows = self.cfg, x.shape[0]
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        out = self.ops.linear(
            x, self.wt[f"{p}.qkvg"]
        )  # [P, (Hq + Hkv) d | Hq d | Hkv d]: q, k, gate, v
        qk_w = (hq + hkv) * d
        qk = self.ops.head_norm(
            out[:, :qk_w].view(rows, hq + hkv, d), *self.head_norms[p], cfg.rms_norm_eps
        )
        qk = apply_rope(qk, rope)
        q, k = qk[:, :hq], qk[:, hq:]
        gate = out[:, qk_w : qk_w + hq * d]
        v = out[:, qk_w + hq * d :].view(rows, hkv, d)
        return q, gate, k, v

    def _project_kv(
        self,
        p: str,
        x: torch.Tensor,
        batch: Batch,
        rope: torch.Tensor,
        cache: Cache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, gate, k, v = self._qkv(p, x, rope)
        cache.write(k[: batch.rows], v[: batch.rows])
        return q, gate

    def _attention(
        self,
        p: str,
        x: torch.Tensor,
        batch: Batch,
        rope: torch.Tensor,
        cache: Cache,
    ) -> torch.Tensor:
        q, gate = self._project_kv(p, x, batch, rope, cache)
        out = self.ops.attend(q, cache, batch)
        out = out.reshape(x.shape[0], -1) * sigmoid(gate)
        return self._reduced(self.ops.linear(out, self.wt[f"{p}.o_proj"]))

    def _gdn(
        self,
        n: int,
        x: torch.Tensor,
        batch: Batch,
        state: DeviceState,
        mode: str,
        write_live: bool,
    ) -> torch.Tensor:
        cfg, rows, p = self.cfg, x.shape[0], f"model.layers.{n}.linear_attn"
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        qkvz = self.ops.linear(
            x, self.wt[f"{p}.in_proj_qkvz"]
        )  # [P, conv_dim | value_dim]: q, k, v, z
        ba = self.ops.linear(x, self.wt[f"{p}.in_proj_ba"]).float()  # [P, 2 Hv]: b, a
        beta = sigmoid(ba)[:, :hv]
        g = softplus(ba + self.ba_bias[n])[:, hv:] * self.neg_a[n]
        mixed, z = qkvz[:, : cfg.conv_dim], qkvz[:, cfg.conv_dim :]
        weight = self.vectors[f"{p}.conv1d.weight"][:, 0]
        out = self.ops.mix_gdn(
            cfg, mixed, g, beta, batch, state, self.linear_index[n], weight, mode, write_live
        )
        normed = self.ops.gated_rms_norm(
            out.to(x.dtype),
            z.reshape(rows, hv, dv),
            self.vectors[f"{p}.norm.weight"],
            cfg.rms_norm_eps,
        )
        return self._reduced(
            self.ops.linear(normed.reshape(rows, hv * dv), self.wt[f"{p}.out_proj"])
        )


def _rope_table(cfg: ModelConfig, max_context: int) -> torch.Tensor:
    """[ctx, 2, rot]: cos, and sin signed for rotate-half (x2, x1) order."""
    cos, sin = rope_table(cfg, max_context)
    half = cfg.rotary_dim // 2
    sign = torch.cat([-torch.ones(half), torch.ones(half)])
    return torch.stack([cos, sin * sign], 1)


def _diverted(
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(the stream without the vision tower's tensors, the dict they go to as they pass)."""
    tower: dict[str, torch.Tensor] = {}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights.items() if isinstance(weights, Mapping) else weights:
            if name.startswith(VISION_PREFIX):
                tower[name] = t
            else:
                yield name, t

    return stream(), tower


def _storage_key(t: torch.Tensor) -> int:
    """One key per storage; meta tensors have no address, so each counts alone."""
    return id(t) if t.is_meta else t.untyped_storage().data_ptr()


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors` (a meta tensor: its own size)."""
    return sum(
        t.numel() * t.element_size() if t.is_meta else t.untyped_storage().nbytes() for t in tensors
    )
