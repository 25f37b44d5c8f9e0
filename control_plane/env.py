"""Every environment variable the control plane reads, declared once and typed.

The `METRALE_*` names are the seed's; a switch is on when the variable is set to anything
but an empty string or `0`."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


@dataclass(frozen=True)
class Env:
    k_ladder: str | None  # METRALE_MTP_K_LADDER: "N:DRAFTS,..." in place of the default ladder
    no_k_ladder: bool  # METRALE_NO_MTP_K_LADDER: every step drafts num_drafts
    no_batch_bootstrap: bool  # METRALE_NO_MTP_BATCH_BOOTSTRAP: bootstrap one sequence at a time
    no_batch_verify: bool  # METRALE_NO_MTP_BATCH_VERIFY: verify one sequence at a time
    no_dcut: bool = False  # METRALE_NO_MTP_DCUT: every batched sequence verifies ladder_nd
    no_adaptive_rung: bool = False  # METRALE_NO_MTP_ADAPTIVE_RUNG: the static ladder only
    dflash_static_gamma: bool = False  # METRALE_DFLASH_STATIC_GAMMA: pin the DFlash gamma
    dflash_batch_verify: bool = True  # METRALE_DFLASH_BATCH_VERIFY=0 turns it off
    no_fused_step: bool = False  # METRALE_NO_FUSED_STEP: greedy steps as verify + verdict calls

    @classmethod
    def read(cls) -> Env:
        return cls(
            k_ladder=os.environ.get("METRALE_MTP_K_LADDER") or None,
            no_k_ladder=_flag("METRALE_NO_MTP_K_LADDER"),
            no_batch_bootstrap=_flag("METRALE_NO_MTP_BATCH_BOOTSTRAP"),
            no_batch_verify=_flag("METRALE_NO_MTP_BATCH_VERIFY"),
            no_dcut=_flag("METRALE_NO_MTP_DCUT"),
            no_adaptive_rung=_flag("METRALE_NO_MTP_ADAPTIVE_RUNG"),
            dflash_static_gamma=_flag("METRALE_DFLASH_STATIC_GAMMA"),
            dflash_batch_verify=os.environ.get("METRALE_DFLASH_BATCH_VERIFY", "1") != "0",
            no_fused_step=_flag("METRALE_NO_FUSED_STEP"),
        )
