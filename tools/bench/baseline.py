"""`met bench`'s outside baseline: transformers' own `generate` on the same checkpoint, one
request and a static batch."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from protos.params import MTP, NONE
from tools.bench.workload import Workload


def transformers_baselines(
    model_dir: Path, work: Workload, tokens: int, batches: list[int]
) -> dict[int, Callable[[], float]]:
    """transformers' own greedy generate on the same checkpoint (no speculation: it offers
    none for this model), for each batch size in `batches`: a callable that runs it once and
    returns its tok/s over every generated token of the batch; empty when transformers is not
    installed. A batch is the workload's first prompts (cycled, as `Workload.requests` takes
    them), left-padded to the longest."""
    try:
        import torch
        from transformers import Qwen3NextForCausalLM
    except ImportError:
        return {}
    # fp32, as our engine computes on a CPU (bf16 weights widen exactly).
    model = Qwen3NextForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return {n: _generate(model, work, tokens, n) for n in batches}


def _generate(model, work: Workload, tokens: int, n: int) -> Callable[[], float]:
    import torch

    prompts = [list(work.prompts[i % len(work.prompts)]) for i in range(n)]
    width = max(map(len, prompts))
    pad = model.config.eos_token_id  # masked out: any id would do, and the config has no pad
    # ids, mask: [n, width], the prompts flush right
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run(new: int) -> int:
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad,
        )
        return n * (out.shape[1] - width)

    def once() -> float:
        with torch.no_grad():
            t0 = time.perf_counter()
            made = run(tokens)
            return made / (time.perf_counter() - t0)

    with torch.no_grad():
        run(2)
    return once


def against_transformers(rows: list[dict], outside: float) -> dict:
    """Our in-process tok/s at one request over transformers' generate, per method."""
    ours = {r["method"]: r["tok_s"] for r in rows if r["concurrency"] == 1}
    return {
        "tok_s": outside,
        "threads": 1,
        "in_process": {m: v / outside for m, v in ours.items()},
    }


def same_rounds(grpc_tok_s: list[float], outside_tok_s: list[float]) -> dict:
    """Our runs over gRPC against transformers' generate run in the same rounds, repeat by
    repeat: its median tok/s, and the median of each repeat's ratio (the machine's speed
    drifts between sections, so a ratio against a baseline measured elsewhere in the run
    carries that drift)."""
    return {
        "transformers_tok_s": statistics.median(outside_tok_s),
        "grpc_over_transformers": statistics.median(
            a / b for a, b in zip(grpc_tok_s, outside_tok_s, strict=True)
        ),
    }


def _grpc_ratios(rows: list[dict], outside: float) -> dict[str, float]:
    """Each row's gRPC tok/s over transformers': from its own rounds where it ran them."""
    return {r["method"]: r.get("grpc_over_transformers", r["grpc_tok_s"] / outside) for r in rows}


def grpc_against_transformers(against: dict, split_rows: list[dict]) -> dict:
    """`against` with our pipelined tok/s over gRPC at one request (the split's), each with
    its ratio to transformers' generate (measured again in the split's rounds where it was,
    `grpc_transformers_tok_s`)."""
    rows = [r for r in split_rows if r["concurrency"] == 1]
    return {
        **against,
        "grpc_tok_s": {r["method"]: r["grpc_tok_s"] for r in rows},
        "grpc": _grpc_ratios(rows, against["tok_s"]),
        "grpc_transformers_tok_s": next(
            (r["transformers_tok_s"] for r in rows if "transformers_tok_s" in r), None
        ),
    }


def batch_against_transformers(
    rows: list[dict], split_rows: list[dict], outside: float, n: int
) -> dict:
    """`none` and `mtp` at `n` concurrent requests against transformers' generate over a static
    batch of `n`: ours in process (the methods section's), and over gRPC where the split
    measured `n`; each with its tok/s and its ratio to transformers'."""
    at_n = lambda r: r["concurrency"] == n and r["method"] in (NONE, MTP)  # noqa: E731
    ours = {r["method"]: r["tok_s"] for r in rows if at_n(r)}
    remote = [r for r in split_rows if at_n(r)]
    return {
        "batch": n,
        "tok_s": outside,
        "threads": 1,
        "in_process_tok_s": ours,
        "in_process": {m: v / outside for m, v in ours.items()},
        "grpc_tok_s": {r["method"]: r["grpc_tok_s"] for r in remote},
        "grpc": _grpc_ratios(remote, outside),
        "grpc_transformers_tok_s": next(
            (r["transformers_tok_s"] for r in remote if "transformers_tok_s" in r), None
        ),
    }
