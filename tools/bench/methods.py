"""`met bench`'s in-process sections: every speculation method against plain decoding, and
batched against serial verify, each at several concurrencies, repeats interleaved."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from control_plane.scheduler.seq import SpecStats
from protos.params import DFLASH, MTP, NONE, PROMPT_LOOKUP
from tools.bench.workload import Workload, identical_to_none, median, serve

# label -> (method, scheduler options): the methods under the default options (the K ladder
# sets each step's width), and mtp with the `auto` cost model over the table `met bench`
# measures first (as a service that has measured its costs runs it).
MTP_AUTO = "mtp_auto"
VARIANTS = {
    NONE: (NONE, {}),
    MTP: (MTP, {}),
    MTP_AUTO: (MTP, {"spec_cost_model": "auto"}),
    PROMPT_LOOKUP: (PROMPT_LOOKUP, {}),
}
# With a DFlash drafter served beside the MTP head (the checkpoint's `dflash/`).
DFLASH_VARIANT: dict[str, tuple[str, dict]] = {DFLASH: (DFLASH, {})}


def methods(
    connect,
    work: Workload,
    concurrency: list[int],
    tokens: int,
    repeats: int,
    baselines: dict[int, Callable[[], float]] | None = None,
    dflash: bool = False,
) -> tuple[list, list, dict[int, float]]:
    """Every method at every concurrency, repeats interleaved so that drift spreads over the
    methods alike; `baselines` (by concurrency: tok/s of one outside generate of that batch)
    run in the same rounds at their concurrency; with `dflash`, method dflash too.
    -> (rows, failures, each baseline's median tok/s by concurrency)"""
    rows: list[dict] = []
    failures: list[str] = []
    outside: dict[int, list[float]] = {}
    baselines = baselines or {}
    variants = {**VARIANTS, **(DFLASH_VARIANT if dflash else {})}
    for n in concurrency:
        runs: dict[str, list[dict]] = {label: [] for label in variants}
        for _ in range(repeats):
            for label, (m, options) in variants.items():
                reqs = work.requests(m, n, tokens, label)
                runs[label].append(serve(connect, reqs, work.tokenizer, options))
            if n in baselines:
                outside.setdefault(n, []).append(baselines[n]())
        results = {m: median(r) for m, r in runs.items()}
        identical = identical_to_none(results, n)
        for m, r in results.items():
            same = identical[m]
            if not same:
                failures.append(f"{m} at {n} concurrent differs from none")
            rows.append(
                {
                    "method": m,
                    "concurrency": n,
                    "tok_s": r["tok_s"],
                    "accepted_length": r["accepted_length"],
                    "acceptance_per_position": r["acceptance"],
                    "drafts_per_verify": _drafts_per_verify(r["spec"]),
                    "identical": same,
                }
            )
    return rows, failures, {n: statistics.median(v) for n, v in outside.items()}


def _drafts_per_verify(spec: SpecStats) -> float | None:
    """Drafts verified per verify, over the same verifies as the mean accepted length (plain
    ones included); None when nothing was verified."""
    return spec.drafted / spec.verifies if spec.verifies else None


# Unpipelined: a pipelined step verifies its whole plan at once whatever `batch_verify` says.
VERIFY_ARMS: dict[str, dict] = {
    "batched": {"pipeline": False},
    "serial": {"batch_verify": False, "pipeline": False},
}


def batch_vs_serial(
    connect, work: Workload, concurrency: list[int], tokens: int, repeats: int
) -> list[dict]:
    """mtp with batched and with serial verify, repeats interleaved. Both arms prefill in one
    batched call; `decode_tok_s` counts the tokens after every request's first, over the
    time after it, where only the verify differs."""
    rows = []
    for n in concurrency:
        runs: dict[str, list[dict]] = {label: [] for label in VERIFY_ARMS}
        for _ in range(repeats):
            for label, options in VERIFY_ARMS.items():
                reqs = work.requests(MTP, n, tokens)
                runs[label].append(serve(connect, reqs, work.tokenizer, options))
        for label, r in runs.items():
            m = median(r)
            rows.append(
                {
                    "verify": label,
                    "concurrency": n,
                    "tok_s": m["tok_s"],
                    "decode_tok_s": m["decode_tok_s"],
                    "step_ms": m["step_ms"],
                }
            )
    return rows


def batched_over_serial(rows: list[dict]) -> dict[int, dict[str, float]]:
    """Per concurrency: batched over serial, end to end and in the decode phase."""
    by = {(r["verify"], r["concurrency"]): r for r in rows}
    return {
        n: {
            key: by[("batched", n)][key] / by[("serial", n)][key]
            for key in ("tok_s", "decode_tok_s")
        }
        for (v, n) in by
        if v == "batched"
    }
