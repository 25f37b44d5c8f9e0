"""A sequence as the service holds it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protos.model import MTP_HEAD, Penalties

if TYPE_CHECKING:
    import torch

    from gpu_service.model.mrope import SeqImage

IDLE, VERIFIED, FOLDED = "idle", "verified", "folded"


@dataclass
class Counts:
    """A penalized sequence's tokens as its penalties read them (`gpu_service/engine/penalties.py`),
    over the held columns."""

    synced: int  # the sequence's first tokens counted here
    out: torch.Tensor  # [W] fp32: times the output holds each id
    seen: torch.Tensor  # [W] bool: the prompt or the output holds it
    bias: torch.Tensor  # [W] fp32


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
    # [nd, V] the distributions its last sampled drafts came from
    draft_probs: torch.Tensor | None = None
    # The rows its last `decode_step` leaves to verify next (its bonus token, then the drafts
    # it proposed), for a step plan that continues it; any other call naming it drops them.
    continuation: list[int] | None = None
    # Applied to its rows in the logits pipeline's order (`gpu_service/engine/logits.py`).
    penalties: Penalties | None = None
    counts: Counts | None = None  # what its penalties read, kept on the device
    drafter: str = MTP_HEAD  # what proposes its drafts (`protos.model.DRAFTERS`)
    # Its prompt's images, in order (`gpu_service/engine/images.py`): where their tokens sit,
    # their RoPE positions, and the embeddings of one whose tokens are not all in yet.
    images: tuple[SeqImage, ...] = ()

    @property
    def seq_len(self) -> int:
        return len(self.tokens)
