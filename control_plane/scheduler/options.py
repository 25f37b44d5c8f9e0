"""Every scheduler option, once: its default and its help text. The command line of
`met control-plane serve` is built from these fields (`add_arguments`, `from_args`) and the
environment's `METRALE_*` switches override them by name (`with_env`)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from control_plane.scheduler.env import Env
from control_plane.scheduler.widths import Ladder
from protos.steps import MAX_PLAN_REPEAT


def _option(default: object, help: str, **cli: Any) -> Any:
    """A field with its help; `cli` holds the argparse keywords that the default does not
    imply: `flag` (a command-line name other than the field's), `choices`, `metavar`, and
    `type` when the default is None or the value needs a check of its own."""
    return field(default=default, metadata={"help": help, **cli})


def _seconds(text: str) -> float:
    """A flag's parser: a finite number of seconds above 0, else a sentence saying so."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


@dataclass(frozen=True)
class SchedulerOptions:
    num_drafts: int = _option(3, "longest draft chain (0: no drafting)")
    mtp_max_seqs: int = _option(
        32,
        "with more active sequences than this, steps decode plainly (no drafts) whatever "
        "sets the width; batched verify needs more than 1",
    )
    max_queue: int = _option(256, "requests waiting for a slot before RESOURCE_EXHAUSTED")
    slot_wait: float = _option(
        10.0,
        "seconds a request may wait for a slot while this control plane holds none and the GPU "
        "service has none free (other sessions hold them all); then RESOURCE_EXHAUSTED",
        type=_seconds,
        metavar="SECONDS",
    )
    prefill_chunk: int = _option(512, "prompt tokens per sequence per iteration")
    prefix_cache: bool = _option(
        True,
        "go on from cached prompt prefixes: snapshots the GPU service holds (as many as its "
        "--prefix-snapshots), taken where prompts diverge and at each prompt's last whole block",
    )
    k_ladder: str = _option(
        "4:3,8:3,16:1,32:1",
        "draft width by active sequences, ACTIVE:DRAFTS rungs in ascending order",
        metavar="LADDER",
    )
    fixed_width: bool = _option(
        False,
        "every step drafts --num-drafts: the K ladder, the adaptive rung and the cost model "
        "stand aside",
    )
    adaptive_rung: bool = _option(
        True,
        "raise 9..16 active sequences to 2 drafts while first drafts stand",
    )
    batch_bootstrap: bool = _option(True, "bootstrap sequences without drafts in one call")
    batch_verify: bool = _option(True, "verify sequences with drafts in batched calls")
    fused_step: bool = _option(
        True,
        "greedy rows take one decode_step call, not a verify call and a verdict call",
    )
    pipeline: bool = _option(
        True,
        "greedy none and mtp steps run ahead: step N + 1 is sent before step N's result is back",
    )
    plan_steps: int = _option(
        2,
        "pipelined greedy steps per plan, one message each way for all of them (1: a plan "
        "per step); more steps make fewer messages, and later admissions and statistics",
        choices=range(1, MAX_PLAN_REPEAT + 1),
        metavar=f"1..{MAX_PLAN_REPEAT}",
    )
    # Off by default: at the widths D-Cut may cut (`dcut_width_cap`) a verified row costs a
    # few percent of a step, so a cut draft saves less than the tokens it would have added
    # (docs/benchmarks.md, "D-Cut and the cost model").
    dcut: bool = _option(False, "D-Cut: batched verify depths from draft confidences")
    dcut_threshold: float = _option(
        0.3, "D-Cut keeps drafts while their chain probability is at least this"
    )
    dcut_width_cap: int = _option(8, "batches wider than this are not cut")
    prompt_lookup: bool = _option(
        False,
        "copies from a repeating history replace MTP chains",
        flag="prompt_lookup_decoding",
    )
    draft_confidence_stop: float | None = _option(
        None,
        "end a draft chain at the first draft below this log-probability",
        type=float,
        metavar="LOGPROB",
    )
    # The ladder by default: on the bundled model the measured model was as fast or slower
    # in every `met bench` run (docs/benchmarks.md, "D-Cut and the cost model").
    spec_cost_model: str = _option(
        "static",
        "draft depth from the K ladder (static), from measured step costs (measured: the "
        "service measures them once if it has no table), or from the table the service has "
        "for its model, forward and tiers, else the ladder (auto)",
        choices=["static", "measured", "auto"],
    )
    spec_cost_slack: float = _option(
        0.05, "take the shallowest depth within this fraction of the best rate"
    )
    dflash: bool = _option(
        False, "plan for a DFlash drafter: gamma drafts at once, raw-argmax verify"
    )
    dflash_gamma: int | None = _option(
        None,
        "pin the DFlash gamma: the resolver stands aside and steps draft --num-drafts",
        type=int,
        metavar="GAMMA",
    )
    dflash_static_gamma: bool = _option(False, "pin the DFlash gamma, as --dflash-gamma does")
    dflash_batch_verify: bool = _option(True, "batched DFlash verify")

    def __post_init__(self) -> None:
        Ladder.parse(self.k_ladder)  # a bad ladder is refused when the options are made
        if not 0 < self.slot_wait < math.inf:
            raise ValueError(f"slot_wait must be above 0 seconds, not {self.slot_wait}")
        if not 1 <= self.plan_steps <= MAX_PLAN_REPEAT:
            raise ValueError(f"plan_steps must be 1 to {MAX_PLAN_REPEAT}, not {self.plan_steps}")

    @property
    def ladder(self) -> Ladder:
        return Ladder.parse(self.k_ladder, enabled=not self.fixed_width)

    @property
    def dflash_pinned(self) -> bool:
        return self.dflash_gamma is not None or self.dflash_static_gamma

    def with_env(self, env: Env) -> SchedulerOptions:
        """These options with the environment's switches applied over them."""
        overrides: dict[str, Any] = env.overrides()  # each value has its option's type
        return replace(self, **overrides)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("scheduler")
        for f in fields(cls):
            cli = dict(f.metadata)
            flag = "--" + cli.pop("flag", f.name).replace("_", "-")
            help = cli.pop("help") + Env.note(f.name)
            if isinstance(f.default, bool):
                cli["action"] = argparse.BooleanOptionalAction
                help += f" (default: {'on' if f.default else 'off'})"
            else:
                cli.setdefault("type", type(f.default))
                help += " (default: %(default)s)"
            group.add_argument(flag, dest=f.name, default=f.default, help=help, **cli)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SchedulerOptions:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
