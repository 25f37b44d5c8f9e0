"""The forward's backends as ops objects, chosen once by `set_forward`: `EagerOps` here (plain
torch, the references in `kernels/*/naive.py`) and `TritonOps` in `triton_forward.py` (the
Triton kernels, imported only when a triton forward is chosen). Linears and other row-wise
parts are shared."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from gpu_service.model.batch import Batch
from gpu_service.model.config import ModelConfig
from gpu_service.model.ops import ROW_TILE, linear
from gpu_service.model.state import DeviceState, put_rows
from kernels.attention.naive import KEY_BLOCK, key_rows, varlen_attention
from kernels.causal_conv1d.naive import varlen_causal_conv1d
from kernels.common import rms_scaled
from kernels.fp8.naive import BlockFp8
from kernels.gated_delta_rule.naive import (
    prepare_qk_pair,
    varlen_chunk_gated_delta_rule,
    varlen_recurrent_gated_delta_rule,
)
from kernels.moe.naive import routed_moe
from kernels.rmsnorm.naive import gated_rms_norm


class Cache(NamedTuple):
    """One attention layer's paged KV (target or drafter): pools [blocks, KEY_BLOCK, Hkv, d],
    the drafter's validity marks [blocks, KEY_BLOCK] (None: every written key is valid), and
    the block table [slots, blocks a sequence] int32 (`DeviceState`)."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor | None
    table: torch.Tensor
    writes: torch.Tensor  # [R] where the call's rows go in the pool viewed as [blocks * KB, ..]
    reads: torch.Tensor | None  # the ops' `key_rows` of the call: where its tiles' keys lie
    # The stacked pools [layer, ...] that k and v are layer `layer` of, where writes go
    # (`put_rows`); None: k and v are whole pools.
    stack: tuple[torch.Tensor, torch.Tensor] | None = None
    layer: int = 0

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The call's rows' keys and values [R, Hkv, d] at `writes` (marked valid in the
        drafter's cache), before any row attends: one indexed write each."""
        if torch.compiler.is_compiling():  # each write names its pool (`put_rows`)
            at = (self.writes // KEY_BLOCK, self.writes % KEY_BLOCK)
            for pool, rows in zip(self.stack or (self.k, self.v), (k, v), strict=True):
                if self.stack is None:
                    pool.index_put_(at, rows)
                else:
                    put_rows(pool, self.layer, at, rows)
            if self.valid is not None:
                self.valid.index_put_(at, torch.ones((), dtype=torch.bool, device=k.device))
            return
        self.k.view(-1, *self.k.shape[2:]).index_put_((self.writes,), k)
        self.v.view(-1, *self.v.shape[2:]).index_put_((self.writes,), v)
        if self.valid is not None:
            self.valid.view(-1).index_fill_(0, self.writes, True)


class EagerOps:
    name = "eager"

    def linear(
        self, x: torch.Tensor, weight_t: torch.Tensor | BlockFp8, tile: int = ROW_TILE
    ) -> torch.Tensor:
        """x: [P, K] (P a multiple of `tile`), weight_t: [K, N] -> [P, N]: `ops.linear`."""
        return linear(x, weight_t, tile)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, one_plus: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        """Zero-centred `(1 + w) * rmsnorm(x)`; `one_plus` is 1 + w in fp32, or None where the
        model folded it into the linears that read the norm. x: [..., D]"""
        scaled = rms_scaled(x.float(), eps)
        return (scaled if one_plus is None else scaled * one_plus).to(x.dtype)

    def head_norm(
        self, x: torch.Tensor, weight: torch.Tensor, per_head: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Each head with its own zero-centred weight. x: [P, H, d], per_head: [H, d]
        (the plain torch form on every backend: a few elements a row)"""
        return EagerOps.rms_norm(self, x, weight, per_head, eps)

    def gated_rms_norm(
        self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return gated_rms_norm(x, z, weight, eps)

    def moe(
        self,
        x: torch.Tensor,
        w13: torch.Tensor | BlockFp8,
        w2: torch.Tensor | BlockFp8,
        experts: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts of every row, summed in expert-index order. x: [P, H],
        w13: [E, H, 2I], w2: [E, I, H], experts: [P, k] (sorted per row), weights: [P, k] in
        x's dtype -> [P, H]"""
        return routed_moe(x, w13, w2, experts, weights)

    def key_rows(self, batch: Batch, table: torch.Tensor) -> torch.Tensor | None:
        """Where the call's attention tiles find their keys in the pool, once for every layer
        (None where `attend` reads the table itself)."""
        return key_rows(table, batch.tile_slot, batch.key_len)

    def attend(self, q: torch.Tensor, cache: Cache, batch: Batch) -> torch.Tensor:
        """q: [P, Hq, d], already scaled, over the cached keys and values (the rows' own
        already in) -> [P, Hq, d]"""
        tiles = (batch.tile_row, batch.tile_pos, batch.tile_slot, batch.row_tile)
        return varlen_attention(
            q, cache.k, cache.v, tiles, batch.key_len, cache.valid, rows=cache.reads
        )

    def mix_gdn(
        self,
        cfg: ModelConfig,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        batch: Batch,
        state: DeviceState,
        layer: int,
        weight: torch.Tensor,
        mode: str,
        write_live: bool,
    ) -> torch.Tensor:
        """Conv + gated delta rule of every sequence. mixed: [P, conv_dim], g, beta: [P, Hv]
        -> [P, Hv, dv] fp32"""
        prefill = mode == "prefill"
        y, after = varlen_causal_conv1d(
            mixed, state.conv[layer].index_select(0, batch.seq_slot), weight, batch.conv_src
        )
        if not prefill:
            put_rows(state.verify_conv, layer, (batch.row_vrow,), after[: batch.rows])
        if prefill or write_live:
            put_rows(state.conv, layer, (batch.seq_slot,), after.index_select(0, batch.last_row))
        b, t = batch.num_seqs, batch.steps
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        yg = y.index_select(0, batch.grid_row)  # [T * B, conv_dim], time-major
        q, k = prepare_qk_pair(yg[:, : 2 * cfg.key_dim].view(t * b, 2 * hk, dk), hv)
        q, k = q.view(t, b, hv, dk), k.view(t, b, hv, dk)
        v = yg[:, 2 * cfg.key_dim :].view(t, b, hv, dv)
        gb = torch.stack([g, beta]).index_select(1, batch.grid_row).view(2, t, b, hv)
        live = state.gdn[layer]
        if prefill:
            gb = gb * batch.grid_valid.view(1, t, b, 1)  # padding leaves the state as it was
            o, final = varlen_chunk_gated_delta_rule(
                q, k, v, gb[0], gb[1], live.index_select(0, batch.seq_slot), batch.chunk
            )
            put_rows(state.gdn, layer, (batch.seq_slot,), final)
        else:
            o, states = varlen_recurrent_gated_delta_rule(
                q, k, v, gb[0], gb[1], live.index_select(0, batch.seq_slot)
            )
            states = states.flatten(0, 1)
            put_rows(state.verify_gdn, layer, (batch.grid_vrow,), states)
            if write_live:
                put_rows(
                    state.gdn, layer, (batch.seq_slot,), states.index_select(0, batch.grid_last)
                )
        return o.flatten(0, 1).index_select(0, batch.row_grid)

    def argmax_logprob(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's argmax (first on ties) and its log-probability, fp32.
        logits: [n, V] -> (argmax [n] int64, log-probability [n])"""
        _, top = logits.max(-1)  # first on ties, as argmax, and faster on the CPU
        logprob = torch.log_softmax(logits, -1, dtype=torch.float32)
        return top, logprob.gather(-1, top[:, None])[:, 0]

    def draft_argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft and its softmax probability per row. A draft only proposes, so a near tie
        that rounds two probabilities to one value may pick either of them; the verify's
        argmax (`argmax_logprob`) is exact on logits. -> (draft [n] int64, probability [n])"""
        conf, top = torch.softmax(logits, -1, dtype=torch.float32).max(-1)
        return top, conf

    def fold(
        self, live: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, picks: torch.Tensor
    ) -> None:
        """live: [L, slots, ...], rows: [L, pool, ...]; live[:, slots[i]] = rows[:, picks[i]]
        (by `index_copy_`: half the time of the same assignment by advanced indexing at one
        sequence, 19 against 37 us for the default model's recurrent state)"""
        live.index_copy_(1, slots, rows.index_select(1, picks))


Ops = EagerOps
EAGER = EagerOps()


def upload(device: torch.device, *lists: Sequence[int]) -> list[torch.Tensor]:
    """Host lists of ints -> int64 tensors on the device, in one copy."""
    flat = torch.tensor([x for v in lists for x in v], dtype=torch.long, device=device)
    return list(flat.split([len(v) for v in lists]))


def download(*tensors: torch.Tensor) -> list[list[float]]:
    """Device tensors -> host lists, in one transfer: the only device-to-host copy an
    operation makes. Token ids come back as floats; `ints` turns them."""
    if not tensors:
        return []
    # One cat, promoted to the widest dtype given (fp32 for ids and fp32 values: ids below
    # 2 ** 24 are exact), then the copy.
    flat = torch.cat([t.reshape(-1) for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()])
        at += t.numel()
    return out


def ints(values: list[float]) -> list[int]:
    return [int(v) for v in values]
