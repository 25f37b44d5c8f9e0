"""Device state: every tensor a sequence's slot owns, the tiered verify buffers, the stash and
the logits buffer. Plain storage; the engine decides what goes where."""

from __future__ import annotations

import torch

from gpu_service.config import ModelConfig, ServiceConfig


class DeviceState:
    def __init__(
        self,
        cfg: ModelConfig,
        svc: ServiceConfig,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        slots, ctx = svc.num_slots, svc.max_context
        n_full, n_lin = len(cfg.full_layers), len(cfg.linear_layers)
        # One more slot than sequences can own: the pad slot, where the rows a batched call
        # carries for no sequence write (a draft without room, a captured graph's padding),
        # so that no host decision picks which rows run.
        self.pad_slot = slots
        kv = (slots + 1, ctx, cfg.num_key_value_heads, cfg.head_dim)
        gdn = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        window = (cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
        # Attention KV per full-attention layer: [layer, slot, position, kv_head, head_dim]
        self.k_cache = torch.zeros(n_full, *kv, dtype=dtype, device=device)
        self.v_cache = torch.zeros(n_full, *kv, dtype=dtype, device=device)
        # Live GDN state per linear layer: [layer, slot, Hv, dk, dv] fp32; conv window
        # [layer, slot, W-1, conv_dim], oldest input first.
        self.gdn = torch.zeros(n_lin, slots + 1, *gdn, dtype=torch.float32, device=device)
        self.conv = torch.zeros(n_lin, slots + 1, *window, dtype=dtype, device=device)
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
        # Drafter KV: [slot, position, kv_head, head_dim], the pad slot's included; a position
        # is valid once an entry was written there and not trimmed.
        self.mtp_k = torch.zeros(kv, dtype=dtype, device=device)
        self.mtp_v = torch.zeros(kv, dtype=dtype, device=device)
        self.mtp_valid = torch.zeros(slots + 1, ctx, dtype=torch.bool, device=device)
        # The last prefill row's hidden per slot, which the drafter pairs with the next token.
        self.mtp_carry = torch.zeros(slots, cfg.hidden_size, dtype=dtype, device=device)
        self.mtp_carry_valid = [False] * slots
        # Final hiddens of the last verify's rows, and the stash taken from them.
        self.verify_hidden = torch.zeros(0, cfg.hidden_size, dtype=dtype, device=device)
        self.stash = torch.zeros(svc.max_batch, cfg.hidden_size, dtype=dtype, device=device)
        self.stash_valid = [False] * svc.max_batch
        # Logits of the last prefill, verify or propose: [rows, vocab] in the model's dtype.
        self.logits = torch.zeros(0, cfg.vocab_size, dtype=dtype, device=device)

    def verify_slice(self, slot: int, rows: int) -> slice:
        start = self.verify_offset[slot]
        return slice(start, start + rows)

    def reset_slot(self, slot: int) -> None:
        """A fresh sequence: zero state, empty drafter."""
        self.gdn[:, slot].zero_()
        self.conv[:, slot].zero_()
        self.mtp_valid[slot].zero_()
        self.mtp_carry_valid[slot] = False
