"""`met bench`'s prefix-cache section, and alone as `python -m tools.bench.prefix`:
what going on from a cached prompt prefix buys the time to first token.

Two workloads of greedy `mtp` requests through a scheduler driving one in-process engine that
holds prefix snapshots, each with the cache on and off (`--prefix-cache`), the arms on the
same prompts and the same engine:
- `shared system prompt`: a shared system prompt and a distinct suffix per request. The
  first `SEEDS` requests go at once and seed the cache (the first is snapshotted where the
  second parts from it, and the second, which waits for that, goes on from there); they are
  left out of the figures. The measured requests follow `concurrency` at a time, each group
  once the last is done. Time to first token (median, mean), output tokens per second, and
  the hit rate (prompt tokens a snapshot gave over prompt tokens looked up); the target is a
  time to first token with the cache at most `TARGET` times the one without.
- `multi-turn chat`: chats of a few turns, every chat's turn at once; each turn's prompt is
  the last one's, its answer and new user tokens. A turn is sent once the scheduler has
  settled after the last (its users read the answers before they reply), which is when the
  answers are snapshotted. Time to first token over the turns after the first (the first has
  nothing cached) and per turn, and the hit rate.
- `cold burst`: `burst` requests sent at once onto a cold cache, a shared system prompt and
  a distinct suffix each: the first prefills the system prompt, the others wait for its
  snapshot and go on from it. Time to first token and the hit rate.
- `long answers`: requests of short distinct prompts and answers of several blocks,
  `long_concurrency` at a time, each group once the last is done: output tokens per second
  with the cache over without, what snapshotting answers costs a workload that never
  reuses them (it waits for an idle loop).
Prompts are windows of the checkpoint's held-out prompts (else a few generic ones), cycled.
Both arms must produce the same tokens (the run fails otherwise)."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import Delta, Event, Failure, GenRequest
from protos.defaults import DEFAULT_MODEL_DIR
from protos.hub import model_path
from protos.model import ServingModel
from protos.params import MTP
from tools.bench.workload import Windows, Workload

SEEDS = 2  # requests that seed the shared system prompt's snapshots, left out of its figures
TARGET = 0.3  # time to first token with the cache over without, at most
SNAPSHOTS = 16  # the engine's `--prefix-snapshots`: every chat's and the system prompt's
ARMS = {"on": True, "off": False}
WORKLOADS = {
    "system": "shared system prompt",
    "chat": "multi-turn chat",
    "burst": "cold burst",
    "long": "long answers",
}
SETTLE_S = 120  # the longest a chat's answers may take to be snapshotted between its turns


def _size(default: int, help: str) -> int:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Sizes:
    system: int = _size(512, "the shared system prompt's tokens")
    suffix: int = _size(32, "each request's own tokens after the system prompt")
    tokens: int = _size(16, "output tokens of every request")
    requests: int = _size(8, "measured requests after the seeds")
    concurrency: int = _size(1, "measured requests sent at once")
    chats: int = _size(3, "chats, every one's turn at once")
    turns: int = _size(3, "turns of each chat")
    opening: int = _size(256, "tokens of a chat's first prompt")
    user: int = _size(32, "new user tokens of each later turn")
    burst: int = _size(8, "requests of the cold burst, sent at once")
    long_tokens: int = _size(256, "output tokens of each long answer")
    long_requests: int = _size(16, "long-answer requests")
    long_concurrency: int = _size(8, "long-answer requests sent at once")


QUICK = Sizes(requests=4, chats=2, burst=3, long_tokens=70, long_requests=2, long_concurrency=2)


@dataclass
class Served:
    """One request's tokens, and seconds from its submit to its first token."""

    tokens: list[int]
    ttft: float


def prefix(model_dir: Path, work: Workload, sizes: Sizes = Sizes()) -> dict:
    """The section's report: each workload's arms, and failures where the arms' tokens
    differ."""
    from gpu_service.engine.facade import Engine
    from gpu_service.model.config import ServiceConfig

    longest = max(
        sizes.system + sizes.suffix,
        sizes.opening + (sizes.turns - 1) * (sizes.tokens + sizes.user),
        sizes.suffix + sizes.long_tokens,
    )
    context = max(1024, -(-(longest + sizes.tokens) // 64) * 64)  # whole attention key blocks
    engine = Engine(model_dir, ServiceConfig(max_context=context, prefix_snapshots=SNAPSHOTS))
    connect = lambda: engine  # noqa: E731
    system = {arm: shared_system(connect, work, sizes, on) for arm, on in ARMS.items()}
    chat = {arm: chats(connect, work, sizes, on) for arm, on in ARMS.items()}
    burst = {arm: cold_burst(connect, work, sizes, on) for arm, on in ARMS.items()}
    long = {arm: long_answers(connect, work, sizes, on) for arm, on in ARMS.items()}
    shared = _compare(system)
    shared["target"], shared["holds"] = TARGET, shared["ttft_ratio"] <= TARGET
    section: dict = {
        "sizes": asdict(sizes),
        "seeds": SEEDS,
        "snapshots": SNAPSHOTS,
        "system": shared,
        "chat": _compare(chat),
        "burst": _compare(burst),
        "long": _compare(long),
    }
    section["failures"] = [
        f"prefix cache, {name}: tokens with the cache differ from those without"
        for name in WORKLOADS
        if not section[name]["identical"]
    ]
    return section


def _compare(arms: dict[str, dict]) -> dict:
    """Both arms' figures, the ratio of their median times to first token, and whether they
    made the same tokens (the outputs themselves left out of the report)."""
    out: dict = {arm: {k: v for k, v in r.items() if k != "outputs"} for arm, r in arms.items()}
    out["ttft_ratio"] = arms["on"]["ttft_median_s"] / arms["off"]["ttft_median_s"]
    out["tok_s_ratio"] = arms["on"]["tok_s"] / arms["off"]["tok_s"]
    out["identical"] = arms["on"]["outputs"] == arms["off"]["outputs"]
    return out


def _system_requests(work: Workload, sizes: Sizes, name: str, n: int) -> list[GenRequest]:
    """`n` greedy `mtp` requests: one system prompt, then each one's own suffix."""
    text = Windows(work)
    system = text.take(sizes.system)
    return [
        GenRequest(
            f"{name}-{i}",
            system + text.take(sizes.suffix),
            sizes.tokens,
            method=MTP,
            ignore_eos=True,
        )
        for i in range(n)
    ]


def shared_system(
    connect: Callable[[], ServingModel], work: Workload, sizes: Sizes, cache: bool
) -> dict:
    """The shared system prompt's workload, one arm: the seeds at once, then the measured
    requests `sizes.concurrency` at a time."""
    reqs = _system_requests(work, sizes, "system", SEEDS + sizes.requests)
    sched = _scheduler(connect, work, cache)
    try:
        seeded = serve(sched, reqs[:SEEDS])
        before = _counts(sched)
        t0 = time.perf_counter()
        measured: list[Served] = []
        for i in range(SEEDS, len(reqs), sizes.concurrency):
            measured += serve(sched, reqs[i : i + sizes.concurrency])
        seconds = time.perf_counter() - t0
        after = _counts(sched)
    finally:
        sched.stop()
    made = sum(len(s.tokens) for s in measured)
    return {
        **_ttft([s.ttft for s in measured]),
        "seed_ttft_s": [s.ttft for s in seeded],
        "tok_s": made / seconds,
        "hit_rate": _rate(after),
        "measured_hit_rate": _rate((after[0] - before[0], after[1] - before[1])),
        "outputs": [s.tokens for s in seeded + measured],
    }


def chats(connect: Callable[[], ServingModel], work: Workload, sizes: Sizes, cache: bool) -> dict:
    """The multi-turn chats' workload, one arm: each turn of every chat at once."""
    text = Windows(work)
    prompts = [text.take(sizes.opening) for _ in range(sizes.chats)]
    turns: list[list[Served]] = []
    sched = _scheduler(connect, work, cache)
    try:
        t0 = time.perf_counter()
        for turn in range(sizes.turns):
            reqs = [
                GenRequest(f"chat-{c}-{turn}", p, sizes.tokens, method=MTP, ignore_eos=True)
                for c, p in enumerate(prompts)
            ]
            turns.append(serve(sched, reqs))
            if not sched.settle(SETTLE_S):
                raise RuntimeError(f"the scheduler did not settle within {SETTLE_S} s")
            prompts = [
                p + tuple(s.tokens) + text.take(sizes.user)
                for p, s in zip(prompts, turns[-1], strict=True)
            ]
        seconds = time.perf_counter() - t0
        counts = _counts(sched)
    finally:
        sched.stop()
    later = [s.ttft for t in turns[1:] for s in t] or [s.ttft for s in turns[0]]
    return {
        **_ttft(later),
        "turn_ttft_median_s": [statistics.median(s.ttft for s in t) for t in turns],
        "tok_s": sum(len(s.tokens) for t in turns for s in t) / seconds,
        "hit_rate": _rate(counts),
        "outputs": [s.tokens for t in turns for s in t],
    }


def cold_burst(
    connect: Callable[[], ServingModel], work: Workload, sizes: Sizes, cache: bool
) -> dict:
    """The cold burst's workload, one arm: every request at once onto an empty cache."""
    reqs = _system_requests(work, sizes, "burst", sizes.burst)
    return _in_groups(connect, work, cache, reqs, len(reqs))


def long_answers(
    connect: Callable[[], ServingModel], work: Workload, sizes: Sizes, cache: bool
) -> dict:
    """The long answers' workload, one arm: `long_concurrency` requests at a time."""
    text = Windows(work)
    reqs = [
        GenRequest(
            f"long-{i}", text.take(sizes.suffix), sizes.long_tokens, method=MTP, ignore_eos=True
        )
        for i in range(sizes.long_requests)
    ]
    return _in_groups(connect, work, cache, reqs, sizes.long_concurrency)


def _in_groups(
    connect: Callable[[], ServingModel],
    work: Workload,
    cache: bool,
    reqs: list[GenRequest],
    group: int,
) -> dict:
    """One arm: `reqs`, `group` at a time, each group once the last is done."""
    sched = _scheduler(connect, work, cache)
    try:
        t0 = time.perf_counter()
        served: list[Served] = []
        for i in range(0, len(reqs), group):
            served += serve(sched, reqs[i : i + group])
        seconds = time.perf_counter() - t0
        counts = _counts(sched)
    finally:
        sched.stop()
    return {
        **_ttft([s.ttft for s in served]),
        "tok_s": sum(len(s.tokens) for s in served) / seconds,
        "hit_rate": _rate(counts),
        "outputs": [s.tokens for s in served],
    }


def _scheduler(connect: Callable[[], ServingModel], work: Workload, cache: bool) -> Scheduler:
    """A started scheduler, connected before any clock starts (a served control plane is
    before its first request); the `METRALE_*` switches ignored, so an arm is its options."""
    sched = Scheduler(connect, work.tokenizer, SchedulerOptions(prefix_cache=cache), Env())
    sched.start()
    sched.capabilities()
    return sched


def serve(sched: Scheduler, reqs: Sequence[GenRequest]) -> list[Served]:
    """All of `reqs` at once through the running `sched`, until each has finished; raises
    when one failed, which has no time to first token to give."""
    tokens: list[list[int]] = [[] for _ in reqs]
    first = [0.0] * len(reqs)
    failed: list[Failure | None] = [None] * len(reqs)
    done = [threading.Event() for _ in reqs]

    def sink_for(i: int) -> Callable[[Event], None]:
        def sink(ev: Event) -> None:
            if isinstance(ev, Delta):
                tokens[i] += ev.token_ids
                if tokens[i] and not first[i]:
                    first[i] = time.perf_counter()
                return
            if isinstance(ev, Failure):
                failed[i] = ev
            done[i].set()

        return sink

    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        sched.submit(r, sink_for(i))
    for d in done:
        d.wait()
    for r, f in zip(reqs, failed, strict=True):
        if f is not None:
            raise RuntimeError(f"request {r.request_id} failed: {f.code} {f.message}")
    return [Served(t, f - t0) for t, f in zip(tokens, first, strict=True)]


def _counts(sched: Scheduler) -> tuple[int, int]:
    """The cache's (queries, hits) in prompt tokens; none without a cache."""
    return (sched.prefix.queries, sched.prefix.hits) if sched.prefix is not None else (0, 0)


def _rate(counts: tuple[int, int]) -> float:
    queries, hits = counts
    return hits / queries if queries else 0.0


def _ttft(seconds: list[float]) -> dict:
    return {
        "ttft_median_s": statistics.median(seconds),
        "ttft_mean_s": statistics.mean(seconds),
        "requests": len(seconds),
    }


def prefix_lines(section: dict | None) -> list[str]:
    """The printed lines: each workload's arms, the ratio and the target."""
    if not section:
        return []
    z, sys_, chat = section["sizes"], section["system"], section["chat"]
    lines = [
        f"prefix cache, shared system prompt ({z['system']} tokens, then {z['suffix']} of "
        f"each request's own; {z['tokens']} mtp tokens out; the first {section['seeds']} "
        f"requests at once seed the cache and are left out, then {z['requests']} measured, "
        f"{z['concurrency']} at a time):"
    ]
    lines += [_arm_line(arm, sys_[arm]) for arm in ARMS]
    verdict = "holds" if sys_["holds"] else "MISSED"
    lines.append(
        f"  TTFT on / off: {sys_['ttft_ratio']:.2f}x (target <= {sys_['target']}x: {verdict}); "
        f"identical {sys_['identical']}"
    )
    lines.append(
        f"prefix cache, multi-turn chat ({z['chats']} chats of {z['turns']} turns at once, a "
        f"{z['opening']}-token opening, then each turn's answer and {z['user']} user tokens; "
        "TTFT over the turns after the first):"
    )
    for arm in ARMS:
        turns = ", ".join(f"{t * 1e3:.0f}" for t in chat[arm]["turn_ttft_median_s"])
        lines.append(f"{_arm_line(arm, chat[arm])}; per turn {turns} ms")
    lines.append(f"  TTFT on / off: {chat['ttft_ratio']:.2f}x; identical {chat['identical']}")
    lines += _arms_lines(
        f"prefix cache, cold burst ({z['burst']} requests at once onto an empty cache: "
        f"{z['system']} shared tokens, then {z['suffix']} of each one's own):",
        section["burst"],
        "ttft",
    )
    lines += _arms_lines(
        f"prefix cache, long answers ({z['long_requests']} requests of {z['suffix']} distinct "
        f"prompt tokens and {z['long_tokens']} mtp tokens out, {z['long_concurrency']} at a time):",
        section["long"],
        "tok_s",
    )
    return lines


def _arms_lines(title: str, w: dict, ratio: str) -> list[str]:
    """A workload's title, its arms, and the ratio of `ratio` (ttft or tok_s) on over off."""
    label = {"ttft": "TTFT", "tok_s": "tok/s"}[ratio]
    return [
        title,
        *(_arm_line(arm, w[arm]) for arm in ARMS),
        f"  {label} on / off: {w[ratio + '_ratio']:.2f}x; identical {w['identical']}",
    ]


def _arm_line(arm: str, r: dict) -> str:
    measured = r.get("measured_hit_rate")
    after = "" if measured is None else f" ({measured:.2f} after the seeds)"
    return (
        f"  cache {arm:3}: TTFT median {r['ttft_median_s'] * 1e3:7.1f} ms, mean "
        f"{r['ttft_mean_s'] * 1e3:7.1f} ms over {r['requests']}; {r['tok_s']:6.1f} tok/s; "
        f"hit rate {r['hit_rate']:.2f}{after}"
    )


def prefix_table(section: dict | None) -> list[str]:
    """The markdown table of docs/benchmarks.md."""
    if not section:
        return []
    out = [
        "",
        f"Prefix cache (mtp, {section['sizes']['tokens']} tokens out; the shared system "
        f"prompt's first {section['seeds']} requests seed the cache and are left out; chats' "
        "TTFT over the turns after the first):",
        "",
        "| workload | cache | TTFT median ms | TTFT mean ms | tok/s | hit rate | TTFT on / off "
        "| tok/s on / off | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, label in WORKLOADS.items():
        w = section[name]
        for arm in ARMS:
            r = w[arm]
            out.append(
                f"| {label} | {arm} | {r['ttft_median_s'] * 1e3:.1f} | "
                f"{r['ttft_mean_s'] * 1e3:.1f} | {r['tok_s']:.1f} | {r['hit_rate']:.2f} | "
                f"{w['ttft_ratio']:.2f}x | {w['tok_s_ratio']:.2f}x | "
                f"{'yes' if w['identical'] else 'NO'} |"
            )
    return out


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=model_path, default=DEFAULT_MODEL_DIR)
    for f in fields(Sizes):
        parser.add_argument(
            f"--{f.name}",
            type=int,
            default=f.default,
            help=f"{f.metadata['help']} (default: %(default)s)",
        )
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the GPU service runs its engine
    sizes = Sizes(**{f.name: getattr(args, f.name) for f in fields(Sizes)})
    section = prefix(args.model, Workload(args.model), sizes)
    print("\n".join(prefix_lines(section)))
    raise SystemExit(1 if section["failures"] else 0)


if __name__ == "__main__":
    main()
