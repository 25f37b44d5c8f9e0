"""What penalties cost, and what they do to speculation:
`python -m tools.bench.penalties`.

`--requests` greedy requests sent at once, each a distinct window of `--prompt` tokens of the
checkpoint's prompts and `--tokens` tokens out (EOS ignored), through a scheduler over an
in-process engine, once with `none` and once with `mtp`, for each set of penalties: none, then
Qwen3's advice against endless repetition (presence 1.5), frequency 0.5, repetition 1.1, and a
logit bias. Per set and method: output tokens per second; for `mtp` the mean accepted length
and its speedup over `none`; whether `mtp` made the tokens `none` made (the lossless rule: the
drafts are judged with the penalties of their place, `gpu_service/engine/penalties.py`); and whether
the set changed any token from the run without penalties."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from control_plane.scheduler.seq import GenRequest
from protos.model import Penalties, ServingModel
from protos.params import MTP, NONE
from tools.bench.workload import Windows, Workload, load_parser, parse_load, serve

SETS = {
    "off": None,
    "presence 1.5": Penalties(presence=1.5),
    "frequency 0.5": Penalties(frequency=0.5),
    "repetition 1.1": Penalties(repetition=1.1),
    "bias +3 on 10 ids": Penalties(bias_ids=tuple(range(10, 20)), bias_values=(3.0,) * 10),
}


def requests(prompts: list[tuple[int, ...]], tokens: int, method: str, pen: Penalties | None):
    return [
        GenRequest(
            f"r{i}",
            p,
            tokens,
            ignore_eos=True,
            method=method,
            penalties=None if pen is None else dataclasses.replace(pen, prompt_tokens=len(p)),
        )
        for i, p in enumerate(prompts)
    ]


def run(model_dir: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Each set's figures: tok/s of `none` and `mtp`, `mtp`'s accepted length, and whether the
    two made the same tokens."""
    from gpu_service.engine.facade import Engine
    from gpu_service.model.config import ServiceConfig

    work = Workload(model_dir)
    text = Windows(work)
    prompts = [text.take(args.prompt) for _ in range(args.requests)]
    engine: ServingModel = Engine(model_dir, ServiceConfig())
    out: dict[str, dict] = {}
    for name, pen in SETS.items():
        runs = {
            m: serve(lambda: engine, requests(prompts, args.tokens, m, pen), work.tokenizer)
            for m in (NONE, MTP)
        }
        out[name] = {
            "none_tok_s": runs[NONE]["tok_s"],
            "mtp_tok_s": runs[MTP]["tok_s"],
            "accepted_length": runs[MTP]["accepted_length"],
            "same_tokens": runs[NONE]["tokens"] == runs[MTP]["tokens"],
            "changed": runs[NONE]["tokens"] != out["off"]["tokens"] if out else False,
            "tokens": runs[NONE]["tokens"],
        }
    for r in out.values():
        del r["tokens"]
    return out


def lines(report: dict[str, dict]) -> list[str]:
    off = report["off"]
    out = [
        "penalties          none tok/s  x off   mtp tok/s  x none  accepted  mtp = none  changed",
    ]
    for name, r in report.items():
        out.append(
            f"  {name:17s}  {r['none_tok_s']:10.1f}  {r['none_tok_s'] / off['none_tok_s']:5.2f}  "
            f"{r['mtp_tok_s']:10.1f}  {r['mtp_tok_s'] / r['none_tok_s']:6.2f}  "
            f"{r['accepted_length']:8.2f}  {'yes' if r['same_tokens'] else 'NO':>10}  "
            f"{'yes' if r['changed'] else 'no':>7}"
        )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_load(load_parser("tools.bench.penalties", __doc__), argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(1)  # as the GPU service runs its engine
    report = run(args.model, args)
    print("\n".join(lines(report)))
    return 0 if all(r["same_tokens"] for r in report.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
