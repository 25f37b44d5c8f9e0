"""`met bench`'s draft-depth section: what drafting deeper than 3 buys, and what choosing each
step's depth from measured costs buys, on an engine whose deepest verify slots hold DEEP
drafts (`DEEP_TIERS`).

Arms, at each concurrency, repeats interleaved, every one against plain decoding's tokens:
- `fixed_d` for d in `fixed`: d drafts at every verify (the ladder and D-Cut stand aside);
- `measured_3`: the measured cost model, at most 3 drafts, as `--spec-cost-model measured`
  runs on the default tiers;
- `measured_deep`: the measured cost model up to DEEP drafts (`--num-drafts DEEP`).
The cost model's table is measured on this engine before the first arm (depths 0 to DEEP),
into a scratch cache, so no table of the user's changes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from unittest import mock

from control_plane.scheduler.widths import cost_widths
from protos.params import MTP, NONE
from tools.bench.workload import (
    FIXED_DRAFTS,
    Workload,
    identical_to_none,
    median,
    serve,
)

DEEP = 7
# The default tiers' 32 slots, four of them deepened to DEEP drafts.
DEEP_TIERS = f"4:{DEEP},4:3,8:2,16:1"


def arms(fixed: list[int]) -> dict[str, tuple[str, dict]]:
    """label -> (method, scheduler options)"""
    out: dict[str, tuple[str, dict]] = {NONE: (NONE, {})}
    for d in fixed:
        out[f"fixed_{d}"] = (MTP, {**FIXED_DRAFTS, "num_drafts": d})
    out["measured_3"] = (MTP, {"spec_cost_model": "measured"})
    out["measured_deep"] = (MTP, {"spec_cost_model": "measured", "num_drafts": DEEP})
    return out


def depth(
    model_dir: Path, work: Workload, concurrency: list[int], tokens: int, repeats: int, quick: bool
) -> dict:
    """The section's report: the tiers, and per concurrency and arm the median tokens per
    second, its ratio to plain decoding, the mean accepted length and drafts per verify."""
    from gpu_service.engine.facade import Engine
    from gpu_service.model.config import ServiceConfig

    engine = Engine(model_dir, ServiceConfig(verify_tiers=DEEP_TIERS))
    labels = arms([3, DEEP] if quick else list(range(1, DEEP + 1)))
    rows, failures = [], []
    with (
        tempfile.TemporaryDirectory() as scratch,
        mock.patch.dict(os.environ, {"XDG_CACHE_HOME": scratch}),
    ):
        widths = cost_widths(engine.svc.num_slots)
        engine.measure_costs(widths, DEEP, repeats=3 if quick else 10)
        for n in concurrency:
            runs: dict[str, list[dict]] = {label: [] for label in labels}
            for _ in range(repeats):
                for label, (method, options) in labels.items():
                    reqs = work.requests(method, n, tokens, label)
                    runs[label].append(serve(lambda: engine, reqs, work.tokenizer, options))
            results = {label: median(r) for label, r in runs.items()}
            identical = identical_to_none(results, n)
            for label, r in results.items():
                same = identical[label]
                if not same:
                    failures.append(f"depth arm {label} at {n} concurrent differs from none")
                spec = r["spec"]
                rows.append(
                    {
                        "arm": label,
                        "concurrency": n,
                        "tok_s": r["tok_s"],
                        "over_none": r["tok_s"] / results[NONE]["tok_s"],
                        "accepted_length": r["accepted_length"],
                        "drafts_per_verify": spec.drafted / spec.verifies
                        if spec.verifies
                        else None,
                        "identical": same,
                    }
                )
    return {"tiers": DEEP_TIERS, "deep": DEEP, "rows": rows, "failures": failures}


def depth_lines(section: dict | None) -> list[str]:
    """The printed lines: each arm's tokens per second over plain decoding's."""
    if not section:
        return []
    lines = [f"draft depth (tiers {section['tiers']}):"]
    for r in section["rows"]:
        if r["arm"] == NONE:
            continue
        per = r["drafts_per_verify"]
        lines.append(
            f"  {r['arm']:14} at {r['concurrency']:2d}: {r['tok_s']:7.1f} tok/s, "
            f"{r['over_none']:.2f}x none, accepted length {r['accepted_length']:.2f}, "
            f"{'-' if per is None else f'{per:.2f}'} drafts per verify"
        )
    return lines


def depth_table(section: dict | None) -> list[str]:
    """The markdown table of docs/benchmarks.md."""
    if not section:
        return []
    out = [
        "",
        f"Draft depth, tiers `{section['tiers']}`:",
        "",
        "| arm | concurrent | tok/s | over none | mean accepted length | drafts per verify "
        "| identical to none |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in section["rows"]:
        per = r["drafts_per_verify"]
        out.append(
            f"| {r['arm']} | {r['concurrency']} | {r['tok_s']:.1f} | {r['over_none']:.2f} | "
            f"{r['accepted_length']:.2f} | {'-' if per is None else f'{per:.2f}'} | "
            f"{'yes' if r['identical'] else 'NO'} |"
        )
    return out
