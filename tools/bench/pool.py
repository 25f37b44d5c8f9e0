"""What a KV pool smaller than the load costs: `python -m tools.bench.pool`.

`--requests` greedy `mtp` requests sent at once, each a distinct window of `--prompt` tokens
of the checkpoint's prompts and `--tokens` tokens out (EOS ignored), through a scheduler over
an in-process engine (the service's default slots). Their contexts need `need` blocks of the pool at
most; each of `--fractions` of that is one run, with a pool of that many blocks (`--kv-blocks`),
after a run with a pool of every slot's context. Per run: requests finished and failed,
preemptions, output tokens per second, the median time to first token and the wall time, and
whether every request made the tokens of the full pool's run. The control plane shares a full
pool out (`control_plane/scheduler/pressure.py`); before it did, every request whose step the
pool refused failed."""

from __future__ import annotations

import argparse
from pathlib import Path

from control_plane.scheduler.env import Env
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from protos.model import ServingModel
from protos.params import MTP
from tools.bench.workload import (
    Windows,
    Workload,
    drive,
    load_parser,
    options_for,
    parse_load,
)

BLOCK = 64  # positions a KV block backs (`Capabilities.kv_block_size`)


def requests(work: Workload, n: int, prompt: int, tokens: int) -> list[GenRequest]:
    text = Windows(work)
    return [
        GenRequest(f"r{i}", text.take(prompt), tokens, ignore_eos=True, method=MTP)
        for i in range(n)
    ]


def needed_blocks(reqs: list[GenRequest]) -> int:
    """The blocks the requests' contexts take at their longest: prompt and tokens out."""
    return sum(-(-(len(r.prompt_ids) + r.max_new_tokens) // BLOCK) for r in reqs)


def run(model_dir: Path, args: argparse.Namespace) -> dict:
    """Each pool's figures (blocks -> figures; 0: every slot's context), and the blocks the
    requests need."""
    from gpu_service.engine.facade import Engine
    from gpu_service.model.config import ServiceConfig

    work = Workload(model_dir)
    reqs = requests(work, args.requests, args.prompt, args.tokens)
    need = needed_blocks(reqs)
    context = -(-(args.prompt + args.tokens + BLOCK) // BLOCK) * BLOCK
    pools = [0, *(max(1, round(f * need)) for f in args.fractions)]
    runs: dict[int, dict] = {}
    for blocks in pools:
        r = _served(
            Engine(model_dir, ServiceConfig(max_context=context, kv_blocks=blocks)), work, reqs
        )
        runs[blocks] = {
            "finished": len(reqs) - len(r["failed"]),
            "failed": len(r["failed"]),
            "preemptions": r["preemptions"],
            "tok_s": r["tok_s"],
            "ttft_median_s": r["ttft_median_s"],
            "seconds": r["seconds"],
            "same_tokens": r["tokens"] == runs[0]["tokens"] if runs else True,
            "tokens": r["tokens"],
        }
    for r in runs.values():
        del r["tokens"]
    return {"need": need, "runs": runs}


def _served(engine: ServingModel, work: Workload, reqs: list[GenRequest]) -> dict:
    """`drive`'s figures for the requests through a scheduler over `engine`."""
    return drive(Scheduler(lambda: engine, work.tokenizer, options_for(reqs), Env()), reqs)


def lines(report: dict) -> list[str]:
    need = report["need"]
    out = [
        f"KV pool under load: the requests need {need} blocks of {BLOCK} positions at most",
        "    pool  finished  failed  preempted    tok/s  TTFT p50 s  wall s  same tokens",
    ]
    for blocks, r in report["runs"].items():
        pool = f"{blocks} ({blocks / need:.0%})" if blocks else "full"
        out.append(
            f"  {pool:>10}  {r['finished']:8d}  {r['failed']:6d}  {r['preemptions']:9d}  "
            f"{r['tok_s']:7.1f}  {r['ttft_median_s']:10.3f}  {r['seconds']:6.2f}  "
            f"{'yes' if r['same_tokens'] else 'NO'}"
        )
    return out


def _fractions(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, not {text!r}"
        ) from None
    if not values or not all(0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected fractions between 0 and 1, not {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = load_parser("tools.bench.pool", __doc__)
    parser.add_argument(
        "--fractions",
        type=_fractions,
        default=[0.75, 0.5, 0.3],
        help="pools as fractions of the blocks the requests need (default: 0.75,0.5,0.3)",
    )
    return parse_load(parser, argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(1)  # as the GPU service runs its engine
    report = run(args.model, args)
    print("\n".join(lines(report)))
    # Preempted requests' tokens may differ where two logits all but tie (README); a failure
    # is a request the pool could hold that did not finish.
    return 1 if any(r["failed"] for r in report["runs"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
