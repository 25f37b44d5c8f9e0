"""The fold: each slot's state after its accepted row becomes its live state."""

from __future__ import annotations

import torch


def fold(live: torch.Tensor, rows: torch.Tensor, slots: list[int], picks: list[int]) -> None:
    """live: [L, slots, ...], rows: [L, pool, ...]; live[:, slots[i]] = rows[:, picks[i]]."""
    for slot, pick in zip(slots, picks, strict=True):
        live[:, slot] = rows[:, pick]
