"""A sequence as the service holds it, and the per-row argmax helper every operation uses."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.common import exp

IDLE, VERIFIED, FOLDED = "idle", "verified", "folded"


@dataclass
class SeqState:
    seq_id: int
    slot: int
    tokens: list[int] = field(default_factory=list)
    phase: str = IDLE
    pending_k: int = 0  # rows of the last verify, while one is pending
    folded_rows: int = 0
    own_drafts: list[int] = field(default_factory=list)  # drafter positions from its own hidden
    verify_call: int = 0  # which verify call its pending rows came from
    verify_row: int = 0  # its first row in that call

    @property
    def seq_len(self) -> int:
        return len(self.tokens)


def argmax_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the argmax and its softmax probability. logits: [n, V] -> ([n], [n])"""
    lf = logits.float()
    top = lf.argmax(-1)
    peak = lf.amax(-1, keepdim=True)
    return top, 1.0 / exp(lf - peak).sum(-1)
