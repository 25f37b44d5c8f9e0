"""What routing over GPU-service replicas costs: `met bench --replicas N`'s section, and alone
as `python -m tools.bench.replicas`.

The same greedy `mtp` requests (the default method) three ways, interleaved over repeats so
that the machine's drift falls on all alike:
- `single`: one GPU service child under a plain scheduler, the single-service path;
- `router_1`: the same child through a `Router` that lists only it;
- `router_n`: N children, that one among them, through a `Router` listing them all.
Prints tokens per second of each, router_1 over single (what the multi-replica path costs;
the target is at least 0.95x), router_n over router_1, the requests each replica took, and
whether every arm produced the same tokens. The children share this machine's cores and its
device, so router_n over router_1 measures routing, not scaling, unless the machine has
room for N services at once."""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from control_plane.cli.launch import set_admin_key, start_gpu_service, stop
from control_plane.cli.server import grpc_router
from control_plane.cli.up import start_all
from control_plane.replicas.client import GrpcModel
from control_plane.replicas.router import Router, parse_targets
from control_plane.scheduler.env import Env
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from protos.defaults import DEFAULT_MODEL_DIR
from protos.params import MTP
from tools.bench.workload import Workload, drive, median, options_for

ARMS = ("single", "router_1", "router_n")


def replicas(
    model_dir: Path,
    work: Workload,
    concurrency: list[int],
    tokens: int,
    repeats: int,
    count: int = 2,
) -> list[dict]:
    """`count` GPU service children on `model_dir`; a row per concurrency: each arm's median
    tokens per second and their ratios."""
    set_admin_key()  # before the threads, so that every child inherits the same key
    children = start_all(count, lambda: start_gpu_service(model_dir), stop)
    targets = [target for _, target in children]
    try:
        # Untimed: each child's first batch pays for warming its allocator and caches.
        warm = work.requests(MTP, max(concurrency) * count, tokens)
        drive(_router(targets, work, warm), warm)
        return [_at(targets, work, n, tokens, repeats) for n in concurrency]
    finally:
        for proc, _ in children:
            stop(proc)


def _at(targets: list[str], work: Workload, n: int, tokens: int, repeats: int) -> dict:
    """One concurrency: every arm `repeats` times, interleaved, each repeat starting with the
    next arm so that none is always first."""
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for i in range(repeats):
        for arm in (*ARMS[i % len(ARMS) :], *ARMS[: i % len(ARMS)]):
            reqs = work.requests(MTP, n, tokens)
            if arm == "single":
                got = drive(_single(targets[0], work, reqs), reqs)
            else:
                listed = targets[:1] if arm == "router_1" else targets
                got = drive(_router(listed, work, reqs), reqs)
            got["outputs"] = [got["tokens"][r.request_id] for r in reqs]
            runs[arm].append(got)
    return _row(runs, n, len(targets))


def _single(target: str, work: Workload, reqs: list[GenRequest]) -> Scheduler:
    """A plain scheduler over the service, connected before the clock starts, as a router's
    replicas are in its `start`."""
    sched = Scheduler(lambda: GrpcModel(target), work.tokenizer, options_for(reqs), Env())
    sched.capabilities()
    return sched


def _router(targets: list[str], work: Workload, reqs: list[GenRequest]) -> Router:
    """A router over `targets`, a scheduler per replica as the control plane builds them."""
    return grpc_router(
        parse_targets(",".join(targets)), work.tokenizer, options_for(reqs), env=Env()
    )


def _row(runs: dict[str, list[dict]], n: int, count: int) -> dict:
    """Each arm's medians, the ratios, router_n's split of the requests (its first run's) and
    whether every run of every arm made the same tokens. A ratio is the median of each
    repeat's own: arms a repeat apart see more of the machine's drift than arms side by side."""
    arm = {name: median(runs[name]) for name in ARMS}
    outputs = [r["outputs"] for name in ARMS for r in runs[name]]
    row: dict = {"method": MTP, "concurrency": n, "replicas": count, "cores": os.cpu_count()}
    for name in ARMS:
        row[f"{name}_tok_s"] = arm[name]["tok_s"]
    for name in ("single", "router_1"):  # what placing a request costs, the rule included
        row[f"{name}_submit_us"] = statistics.median(r["submit_s"] for r in runs[name]) / n * 1e6
    # The rule's share of a run: the only code the router adds on the way of a request.
    extra = (row["router_1_submit_us"] - row["single_submit_us"]) * n / 1e6
    row["routing_share"] = extra / statistics.median(r["seconds"] for r in runs["router_1"])
    row["router_1_over_single"] = _paired(runs["router_1"], runs["single"])
    row["router_n_over_router_1"] = _paired(runs["router_n"], runs["router_1"])
    row["requests_by_replica"] = list(runs["router_n"][0]["by_replica"].values())
    row["accepted_length"] = arm["single"]["accepted_length"]
    row["identical"] = all(o == outputs[0] for o in outputs)
    return row


def _paired(over: list[dict], under: list[dict]) -> float:
    return statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(over, under, strict=True))


def main() -> None:
    from tools.bench.report import replicas_lines

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--replicas", type=int, default=2, help="GPU services in router_n")
    args = parser.parse_args()
    work = Workload(args.model)
    rows = replicas(args.model, work, args.concurrency, args.tokens, args.repeats, args.replicas)
    print("\n".join(replicas_lines(rows)))


if __name__ == "__main__":
    main()
