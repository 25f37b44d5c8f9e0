"""Every environment variable the control plane reads, declared once and typed.

The `METRALE_*` names are the levers' documented switches (`METRALE_NO_MTP_DCUT`, ...): a
deployment's settings keep their meaning whatever the options are called. Each one overrides
one scheduler option by name (`SchedulerOptions.with_env`), over the default and over the
command line, so a switch set in the environment wins. A switch is on when the variable is
set to anything but an empty string or `0`; `METRALE_DFLASH_BATCH_VERIFY` is on by default
and `0` turns it off."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any


def _var(default: bool | None, name: str, option: str, negate: bool = False) -> Any:
    """A field read from variable `name`; when it differs from `default` it sets `option`
    to its value (`negate`: to the opposite, for the `NO_` switches)."""
    return field(default=default, metadata={"var": name, "option": option, "negate": negate})


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "")
    return default if value == "" else value != "0"


@dataclass(frozen=True)
class Env:
    """Field order is the constructor's; callers build it positionally or by name. Each
    variable's meaning is the help of the option it sets (control_plane/scheduler/options.py)."""

    k_ladder: str | None = _var(None, "METRALE_MTP_K_LADDER", "k_ladder")
    no_k_ladder: bool = _var(False, "METRALE_NO_MTP_K_LADDER", "fixed_width")
    no_batch_bootstrap: bool = _var(
        False, "METRALE_NO_MTP_BATCH_BOOTSTRAP", "batch_bootstrap", negate=True
    )
    no_batch_verify: bool = _var(False, "METRALE_NO_MTP_BATCH_VERIFY", "batch_verify", negate=True)
    no_dcut: bool = _var(False, "METRALE_NO_MTP_DCUT", "dcut", negate=True)
    no_adaptive_rung: bool = _var(
        False, "METRALE_NO_MTP_ADAPTIVE_RUNG", "adaptive_rung", negate=True
    )
    dflash_static_gamma: bool = _var(False, "METRALE_DFLASH_STATIC_GAMMA", "dflash_static_gamma")
    dflash_batch_verify: bool = _var(True, "METRALE_DFLASH_BATCH_VERIFY", "dflash_batch_verify")
    no_fused_step: bool = _var(False, "METRALE_NO_FUSED_STEP", "fused_step", negate=True)

    @classmethod
    def read(cls) -> Env:
        values: dict[str, Any] = {}  # each value has its field's type: str | None or bool
        for f in fields(cls):
            name = f.metadata["var"]
            if f.default is None:
                values[f.name] = os.environ.get(name) or None
            else:
                assert isinstance(f.default, bool)
                values[f.name] = _flag(name, f.default)
        return cls(**values)

    def overrides(self) -> dict[str, object]:
        """Option name -> value, for each variable that is set."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out[f.metadata["option"]] = not value if f.metadata["negate"] else value
        return out

    @classmethod
    def note(cls, option: str) -> str:
        """How a variable overrides `option`, for the option's help ("" when none does)."""
        for f in fields(cls):
            if f.metadata["option"] != option:
                continue
            var = f.metadata["var"]
            if f.default is None:
                return f"; env {var} overrides it"
            if f.default:
                return f"; env {var}=0 turns it off"
            return f"; env {var} turns it {'off' if f.metadata['negate'] else 'on'}"
        return ""
