"""What one `step_mtp` needs besides the sequences: the levers, the ladder, the service's
shape."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from control_plane.env import Env
from control_plane.scheduler.adaptive import AdaptiveRung
from control_plane.scheduler.cost_model import Calibration, CostTable
from control_plane.scheduler.dflash import DFlashRung
from control_plane.scheduler.ladder import DEFAULT_LADDER, Ladder
from protos.model import Capabilities


@dataclass(frozen=True)
class Levers:
    mtp_max_seqs: int = 32  # --mtp-max-seqs: batched verify needs more than 1
    batch_bootstrap: bool = True  # off: METRALE_NO_MTP_BATCH_BOOTSTRAP
    batch_verify: bool = True  # off: METRALE_NO_MTP_BATCH_VERIFY
    dcut: bool = True  # off: METRALE_NO_MTP_DCUT
    dcut_threshold: float = 0.3  # --dcut-threshold: the chain probability a draft must keep
    dcut_width_cap: int = 8  # --dcut-width-cap: wider batches are not cut
    draft_stop: float | None = None  # --draft-confidence-stop, a log-probability
    prompt_lookup: bool = False  # --prompt-lookup-decoding: copies replace MTP chains
    spec_cost_slack: float = 0.05  # --spec-cost-slack
    dflash: bool = False  # the drafter is DFlash: gamma drafts at once, raw-argmax verify
    dflash_gamma: int | None = None  # --dflash-gamma: pins gamma
    dflash_batch_verify: bool = True  # off: METRALE_DFLASH_BATCH_VERIFY=0

    @classmethod
    def from_env(cls, env: Env, mtp_max_seqs: int = 32, **options) -> Levers:
        return cls(
            mtp_max_seqs,
            not env.no_batch_bootstrap,
            not env.no_batch_verify,
            not env.no_dcut,
            **options,
        )


@dataclass(frozen=True)
class StepContext:
    levers: Levers
    ladder: Ladder
    caps: Capabilities
    rung: AdaptiveRung
    # --spec-cost-model measured: the table and the acceptance it is weighed with.
    costs: CostTable | None = None
    calibration: Calibration = field(default_factory=Calibration)
    dflash_rung: DFlashRung = field(default_factory=DFlashRung)

    @classmethod
    def build(
        cls,
        caps: Capabilities,
        env: Env,
        mtp_max_seqs: int = 32,
        costs: CostTable | None = None,
        **options,
    ) -> StepContext:
        ladder = Ladder.parse(env.k_ladder or DEFAULT_LADDER, enabled=not env.no_k_ladder)
        rung = AdaptiveRung(ladder, enabled=not env.no_adaptive_rung)
        levers = Levers.from_env(env, mtp_max_seqs, **options)
        if not env.dflash_batch_verify:
            levers = replace(levers, dflash_batch_verify=False)
        pinned = levers.dflash_gamma is not None or env.dflash_static_gamma
        return cls(levers, ladder, caps, rung, costs, dflash_rung=DFlashRung(pinned))

    def capacity(self, slot: int) -> int:
        return self.caps.slot_verify_drafts[slot]
