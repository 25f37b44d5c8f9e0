"""Device state: every tensor a sequence's slot owns, the tiered verify buffers, the stash and
the logits buffer. Plain storage; the engine decides what goes where."""

from __future__ import annotations

import torch

from gpu_service.model.config import ModelConfig, ServiceConfig
from kernels.attention.format import KEY_BLOCK
from kernels.attention.naive import pool_index


def put_rows(
    stack: torch.Tensor, layer: int, index: tuple[torch.Tensor, ...], values: torch.Tensor
) -> None:
    """stack[layer][index] = values for a per-layer buffer [layer, ...]. Compiled, one indexed
    write of the whole buffer: a compiled forward writes a buffer in place only when every
    write names the buffer itself; one through a view (`stack[layer]`, or `stack.view(...)`
    for a second time) copies all of it at every call."""
    if torch.compiler.is_compiling():
        stack.index_put_((torch.full_like(index[0], layer), *index), values)
    else:  # the same write in one op fewer
        stack[layer].index_put_(index, values)


class DeviceState:
    def __init__(
        self,
        cfg: ModelConfig,
        svc: ServiceConfig,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        slots = svc.num_slots
        n_lin = len(cfg.linear_layers)
        # One more slot than sequences can own: the pad slot, where the rows a batched call
        # carries for no sequence write (a draft without room, a captured graph's padding),
        # so that no host decision picks which rows run.
        self.pad_slot = slots
        self._kv_pool(cfg, svc, dtype, device)
        gdn = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        window = (cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
        # Live GDN state per linear layer: [layer, slot, Hv, dk, dv] fp32; conv window
        # [layer, slot, W-1, conv_dim], oldest input first.
        self.gdn = torch.zeros(n_lin, slots + 1, *gdn, dtype=torch.float32, device=device)
        self.conv = torch.zeros(n_lin, slots + 1, *window, dtype=dtype, device=device)
        # Prefix snapshots, as the live state's layout: [layer, snapshot, ...], and the carry
        # each pairs with the token after its prefix.
        snaps = svc.prefix_snapshots
        self.snap_gdn = torch.zeros(n_lin, snaps, *gdn, dtype=torch.float32, device=device)
        self.snap_conv = torch.zeros(n_lin, snaps, *window, dtype=dtype, device=device)
        self.snap_carry = torch.zeros(snaps, cfg.hidden_size, dtype=dtype, device=device)
        # Verify buffers: slot s owns rows offset[s] .. offset[s] + capacity + 1 of the pool,
        # one per verified row; the tiers give low slots the deep rows.
        caps = svc.slot_verify_drafts
        self.verify_offset = [sum(c + 1 for c in caps[:s]) for s in range(slots)]
        self.verify_rows = [c + 1 for c in caps]
        self.verify_offset_t = torch.tensor(self.verify_offset, device=device)
        # Rows no slot owns, from `pad_vrow` on: where a batched call's padding entries write,
        # and the pad slot's verify rows (as many as the deepest slot's).
        self.pad_vrow = sum(self.verify_rows)
        pool = self.pad_vrow + max(self.verify_rows)
        self.verify_gdn = torch.zeros(n_lin, pool, *gdn, dtype=torch.float32, device=device)
        self.verify_conv = torch.zeros(n_lin, pool, *window, dtype=dtype, device=device)
        # RoPE position minus sequence position of each slot's next text token (0 for text
        # alone; negative after images: `gpu_service/model/mrope.py`), read on the device by
        # every verify and draft; the pad slot's stays 0.
        self.rope_shift = torch.zeros(slots + 1, dtype=torch.long, device=device)
        # The last prefill row's hidden per slot, which the drafter pairs with the next token.
        self.mtp_carry = torch.zeros(slots, cfg.hidden_size, dtype=dtype, device=device)
        self.mtp_carry_valid = [False] * slots
        # Final hiddens of the last verify's rows, and the stash taken from them.
        self.verify_hidden = torch.zeros(0, cfg.hidden_size, dtype=dtype, device=device)
        self.stash = torch.zeros(svc.max_batch, cfg.hidden_size, dtype=dtype, device=device)
        self.stash_valid = [False] * svc.max_batch
        # Logits of the last prefill, verify or propose: [rows, vocab] in the model's dtype.
        self.logits = torch.zeros(0, cfg.vocab_size, dtype=dtype, device=device)

    def _kv_pool(
        self,
        cfg: ModelConfig,
        svc: ServiceConfig,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        # The attention KV pool, target and drafter alike: blocks of KEY_BLOCK positions, a block
        # table per slot mapping its position p to block table[slot, p // KEY_BLOCK]. Entries no
        # block backs, and every entry of the pad slot, name the pad block, the last: what is
        # written there is never read unmasked.
        self.num_blocks = svc.num_kv_blocks
        self.pad_block = self.num_blocks
        tables = (svc.num_slots + 1, svc.blocks_per_sequence)
        self.block_table = torch.full(tables, self.pad_block, dtype=torch.int32, device=device)
        kv = (self.num_blocks + 1, KEY_BLOCK, cfg.num_key_value_heads, cfg.head_dim)
        n_full = len(cfg.full_layers)
        # Attention KV per full-attention layer: [layer, block, offset, kv_head, head_dim]
        self.k_cache = torch.zeros(n_full, *kv, dtype=dtype, device=device)
        self.v_cache = torch.zeros(n_full, *kv, dtype=dtype, device=device)
        # Drafter KV: [block, offset, kv_head, head_dim], the same blocks as the target's; a
        # position is valid once an entry was written there and not trimmed (a block's marks
        # are cleared as it is taken).
        self.mtp_k = torch.zeros(kv, dtype=dtype, device=device)
        self.mtp_v = torch.zeros(kv, dtype=dtype, device=device)
        self.mtp_valid = torch.zeros(kv[:2], dtype=torch.bool, device=device)
        # A DFlash drafter's context KV (`add_dflash_pool`): none until one is loaded.
        self.dflash_k = torch.zeros(0, dtype=dtype, device=device)
        self.dflash_v = torch.zeros(0, dtype=dtype, device=device)

    def add_dflash_pool(self, layers: int, kv_heads: int, head_dim: int) -> None:
        """A DFlash drafter's context KV per drafter layer: [layer, block, offset, kv_head,
        head_dim], the target's blocks: entry p of a slot is committed token p's context (and,
        past the committed length, whatever the last verify or block wrote, never read)."""
        kv = (layers, self.num_blocks + 1, KEY_BLOCK, kv_heads, head_dim)
        like = self.mtp_k
        self.dflash_k = torch.zeros(kv, dtype=like.dtype, device=like.device)
        self.dflash_v = torch.zeros(kv, dtype=like.dtype, device=like.device)

    def verify_slice(self, slot: int, rows: int) -> slice:
        start = self.verify_offset[slot]
        return slice(start, start + rows)

    def reset_slot(self, slot: int) -> None:
        """A fresh sequence: zero state, no drafter carry (it holds no KV block yet)."""
        self.gdn[:, slot].zero_()
        self.conv[:, slot].zero_()
        self.rope_shift[slot] = 0
        self.mtp_carry_valid[slot] = False

    def kv_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Where positions of slots lie in a pool viewed as [blocks * KEY_BLOCK, ...]: int64,
        the shape of `positions` (slots broadcast against it)."""
        return pool_index(self.block_table, slots, positions)
