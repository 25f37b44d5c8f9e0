"""`met bench`'s outside baseline: transformers' own `generate` on the same checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from control_plane.benchmarks.workload import Workload


def transformers_baseline(
    model_dir: Path, work: Workload, tokens: int
) -> Callable[[], float] | None:
    """transformers' own greedy generate on the same checkpoint (no speculation: it offers
    none for this model), one request: a callable that runs it once and returns its tok/s;
    None when transformers is not installed."""
    try:
        import torch
        from transformers import Qwen3NextForCausalLM
    except ImportError:
        return None
    # fp32, as our engine computes on a CPU (bf16 weights widen exactly).
    model = Qwen3NextForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([list(work.prompts[0])])

    def once() -> float:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)

    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
    return once


def against_transformers(rows: list[dict], outside: float) -> dict:
    """Our in-process tok/s at one request over transformers' generate, per method."""
    ours = {r["method"]: r["tok_s"] for r in rows if r["concurrency"] == 1}
    return {
        "tok_s": outside,
        "threads": 1,
        "in_process": {m: v / outside for m, v in ours.items()},
    }


def grpc_against_transformers(against: dict, split_rows: list[dict]) -> dict:
    """`against` with our pipelined tok/s over gRPC at one request (the split's), each with
    its ratio to transformers' generate."""
    ours = {r["method"]: r["grpc_tok_s"] for r in split_rows if r["concurrency"] == 1}
    return {
        **against,
        "grpc_tok_s": ours,
        "grpc": {m: v / against["tok_s"] for m, v in ours.items()},
    }
