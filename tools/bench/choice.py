"""What the server's choice buys: `met bench`'s choice section, and alone as
`python -m tools.bench.choice`.

Through both processes as a user runs them: a GPU service child with the checkpoint's DFlash
drafter, a control plane child over it, and concurrent gRPC `Generate` calls. At each
concurrency, rounds of requests naming each fixed method and requests naming none (`unnamed`:
the server's default, its choice unless started with another `--method`), interleaved so that
the machine's drift falls on all alike; greedy, a fixed token count; the first round warms both
processes (and the choice's measurements) and is not counted. Each arm's tok/s is the median
over the rounds, its ratios to none and to the best fixed method the medians of the per-round
ratios; every arm's texts must equal none's. Then 8 concurrent JSON-schema requests, none and
mtp against the unnamed. `--load N` runs it all again beside N busy processes."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from control_plane.cli.launch import start_control_plane, start_gpu_service, stop
from protos.defaults import DEFAULT_MODEL_DIR, DRAFTER_DIR
from protos.met.v1 import generate_pb2 as pb
from protos.met.v1 import generate_pb2_grpc as pb_grpc
from tools.bench.workload import Workload, busy

ARMS = {  # label -> the wire's method
    "none": pb.SPECULATIVE_METHOD_NONE,
    "mtp": pb.SPECULATIVE_METHOD_MTP,
    "dflash": pb.SPECULATIVE_METHOD_DFLASH,
    "unnamed": pb.SPECULATIVE_METHOD_UNSPECIFIED,
}
FIXED = ("none", "mtp", "dflash")
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["name", "count"],
    }
)
SCHEMA_REQUESTS = 8


def _round(
    stub, prompts: list[tuple[int, ...]], method: pb.SpeculativeMethod, tokens: int, fmt=None
) -> dict:
    """`prompts` as concurrent calls -> tok/s over the round's wall time, and each one's ids."""

    def one(prompt: tuple[int, ...]) -> list[int]:
        request = pb.GenerateRequest(
            prompt_token_ids=prompt,
            max_new_tokens=tokens,
            speculative_method=method,
            ignore_eos=fmt is None,
            response_format=fmt,
        )
        out: list[int] = []
        by: list = []
        for msg in stub.Generate(request, timeout=600):
            out += msg.token_ids
            if msg.HasField("speculative_stats"):
                by = list(msg.speculative_stats.by_method)
        ran[len(ran)] = {m.method: m.verifies for m in by}
        return out

    ran: dict[int, dict[str, int]] = {}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        ids = list(pool.map(one, prompts))
    seconds = time.perf_counter() - t0
    ran_total: dict[str, int] = {}
    for r in ran.values():
        for m, v in r.items():
            ran_total[m] = ran_total.get(m, 0) + v
    return {"tok_s": sum(map(len, ids)) / seconds, "ids": ids, "ran": ran_total}


def _rows(stub, work: Workload, n: int, tokens: int, repeats: int, arms: dict) -> list[dict]:
    prompts = [work.prompts[i % len(work.prompts)] for i in range(n)]
    runs: dict[str, list[dict]] = {label: [] for label in arms}
    for r in range(repeats + 1):
        for label in _rotated(list(arms), r):
            got = _round(stub, prompts, arms[label], tokens)
            if r:
                runs[label].append(got)
    base = runs["none"][0]["ids"]
    tok_s = {label: statistics.median(r["tok_s"] for r in rs) for label, rs in runs.items()}
    best = max((label for label in FIXED if label in tok_s), key=tok_s.__getitem__)
    return [
        {
            "concurrency": n,
            "method": label,
            "tok_s": tok_s[label],
            "over_none": _ratio(rs, runs["none"]),
            "over_best_fixed": _ratio(rs, runs[best]),
            "identical": all(r["ids"] == base for r in rs),
            "ran": rs[-1]["ran"],
        }
        for label, rs in runs.items()
    ]


def _rotated(labels: list[str], r: int) -> list[str]:
    """Round `r`'s order of the arms, rotated each round so that no arm always follows the same
    one (none's round right after DFlash's measured 2% slower than its first)."""
    return labels[r % len(labels) :] + labels[: r % len(labels)]


def _ratio(mine: list[dict], theirs: list[dict]) -> float:
    """The median over the rounds of each round's tok/s over the other arm's in the same round:
    the machine's drift between rounds (beside busy processes, a quarter) falls on both."""
    return statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(mine, theirs, strict=True))


def _schema_rows(stub, work: Workload, tokens: int, repeats: int) -> list[dict]:
    fmt = pb.ResponseFormat(json_schema=SCHEMA)
    prompts = [work.prompts[i % len(work.prompts)] for i in range(SCHEMA_REQUESTS)]
    runs: dict[str, list[dict]] = {"none": [], "mtp": [], "unnamed": []}
    for r in range(repeats + 1):
        for label in _rotated(list(runs), r):
            got = _round(stub, prompts, ARMS[label], tokens, fmt)
            if r:
                runs[label].append(got)
    tok_s = {label: statistics.median(r["tok_s"] for r in rs) for label, rs in runs.items()}
    return [
        {
            "concurrency": SCHEMA_REQUESTS,
            "method": f"json_schema/{label}",
            "tok_s": tok_s[label],
            "over_none": _ratio(rs, runs["none"]),
            "identical": all(r["ids"] == runs["none"][0]["ids"] for r in rs),
            "ran": rs[-1]["ran"],
        }
        for label, rs in runs.items()
    ]


def choice(
    model_dir: Path,
    work: Workload,
    concurrency: list[int],
    tokens: int,
    repeats: int,
    service: tuple[str, ...] = (),
) -> list[dict]:
    """The arms at each concurrency, then the JSON-schema pair, through both processes;
    `service`: the GPU service's further flags (`--no-compile`)."""
    drafter = model_dir / DRAFTER_DIR
    arms = (
        ARMS if (drafter / "config.json").is_file() else {k: ARMS[k] for k in ARMS if k != "dflash"}
    )
    extra = ("--drafter", str(drafter)) if "dflash" in arms else ()
    gpu, target = start_gpu_service(model_dir, *extra, *service)
    try:
        cp, address = start_control_plane(target)
        try:
            with grpc.insecure_channel(address) as channel:
                stub = pb_grpc.GenerationServiceStub(channel)
                rows = [r for n in concurrency for r in _rows(stub, work, n, tokens, repeats, arms)]
                return rows + _schema_rows(stub, work, tokens, repeats)
        finally:
            stop(cp)
    finally:
        stop(gpu)


def choice_failures(rows: list[dict], speed: bool = True) -> list[str]:
    """An arm whose texts differ from none's; with `speed`, the default below none, or
    below 0.95x the best fixed method, at a concurrency (a quick run's single round is noise)."""
    out = []
    for r in rows:
        at = f"{r['method']} at {r['concurrency']} concurrent"
        if not r["identical"]:
            out.append(f"{at} differs from none")
        if not speed:
            continue
        if r["method"].endswith("unnamed") and r["over_none"] < 1.0:
            out.append(f"{at} is {r['over_none']:.2f}x none")
        if r["method"] == "unnamed" and r["over_best_fixed"] < 0.95:
            out.append(f"{at} is {r['over_best_fixed']:.2f}x the best fixed method")
    return out


def lines(rows: list[dict]) -> list[str]:
    out = [f"{'concurrent':>10} {'method':>18} {'tok/s':>8} {'/none':>6} {'/best':>6}  same  ran"]
    for r in rows:
        best = f"{r['over_best_fixed']:6.2f}" if "over_best_fixed" in r else " " * 6
        ran = ", ".join(f"{m} {v}" for m, v in sorted(r["ran"].items()))
        same = "yes" if r["identical"] else "NO"
        out.append(
            f"{r['concurrency']:>10} {r['method']:>18} {r['tok_s']:8.1f} "
            f"{r['over_none']:6.2f} {best}  {same:>4}  {ran}"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--load", type=int, default=0, help="then again beside N busy processes")
    parser.add_argument("--service", default="", help="the GPU service's further flags")
    args = parser.parse_args(argv)
    work = Workload(args.model)
    run = lambda: choice(  # noqa: E731
        args.model, work, args.concurrency, args.tokens, args.repeats, tuple(args.service.split())
    )
    print("quiet machine:")
    print("\n".join(lines(run())))
    if args.load:
        with busy(args.load):
            rows = run()
            print(f"beside {args.load} busy processes (load {os.getloadavg()[0]:.2f}):")
            print("\n".join(lines(rows)))


if __name__ == "__main__":
    main()
