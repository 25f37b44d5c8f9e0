"""Each lever on and off, on the default model, in one run:
`python -m tools.bench.levers`.

The same concurrent greedy requests through the scheduler driving an in-process engine (one
torch thread, as the service runs it); prints output tokens per second, mean accepted length
and first-draft acceptance per configuration."""

from __future__ import annotations

import argparse
import time

from control_plane.scheduler.env import Env
from control_plane.scheduler.options import SchedulerOptions
from control_plane.scheduler.scheduler import Scheduler
from control_plane.scheduler.seq import GenRequest
from protos.defaults import DEFAULT_MODEL_DIR
from protos.model import ServingModel
from protos.params import MTP, NONE, PROMPT_LOOKUP
from tools.bench.workload import Workload

CONFIGS: dict[str, tuple[str, dict[str, object], dict[str, object]]] = {
    "none": (NONE, {}, {}),
    "mtp (static ladder)": (MTP, {"adaptive_rung": False, "dcut": False}, {}),
    "mtp + adaptive rung": (MTP, {"dcut": False}, {}),
    "mtp + D-Cut": (MTP, {"adaptive_rung": False}, {}),
    "mtp + draft stop": (
        MTP,
        {"adaptive_rung": False, "dcut": False},
        {"draft_confidence_stop": -2.0},
    ),
    "mtp + prompt lookup": (
        MTP,
        {"adaptive_rung": False, "dcut": False},
        {"prompt_lookup": True},
    ),
    "mtp + cost model": (MTP, {"dcut": False}, {"spec_cost_model": "measured"}),
    "prompt_lookup requests": (PROMPT_LOOKUP, {}, {}),
    "mtp, all levers": (MTP, {}, {"prompt_lookup": True, "draft_confidence_stop": -2.0}),
}


def measure(
    engine: ServingModel,
    work: Workload,
    method: str,
    switches: dict,
    opts: dict,
    n: int,
    tokens: int,
) -> str:
    """One configuration: `n` requests at once through a scheduler, as a line of figures."""
    s = Scheduler(
        lambda: engine,
        work.tokenizer,
        SchedulerOptions(**switches, **opts),
        Env(),  # the configuration alone decides, whatever METRALE_* says
    )
    s.start()
    outs: list[list] = []
    try:
        t0 = time.perf_counter()
        for i in range(n):
            prompt = work.prompts[i % len(work.prompts)]
            out: list = []
            outs.append(out)
            s.submit(
                GenRequest(f"b{i}", prompt, tokens, method=method, ignore_eos=True), out.append
            )
        while sum(1 for o in outs if o and not hasattr(o[-1], "token_ids")) < n:
            time.sleep(0.01)  # waiting on the scheduler thread
        seconds = time.perf_counter() - t0
        spec = s.snapshot()["spec"]
        made = s.snapshot()["counters"].completion_tokens
    finally:
        s.stop()
    first = spec.acceptance_at[0] if spec.acceptance_at else 0.0
    return (
        f"{made / seconds:8.1f} tok/s   accepted length {spec.mean_accepted_length:5.2f}"
        f"   first-draft acceptance {first:5.2f}"
    )


def main() -> None:
    import torch

    from gpu_service.engine.facade import Engine
    from gpu_service.model.config import ServiceConfig

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = Engine(DEFAULT_MODEL_DIR, ServiceConfig())
    work = Workload(DEFAULT_MODEL_DIR)
    engine.measure_costs([1, 2, 4, 8, 16, 32], 3)  # measured once, cached, outside the timing
    print(f"{args.concurrency} requests x {args.tokens} tokens, default model")
    for name, (method, switches, opts) in CONFIGS.items():
        line = measure(engine, work, method, switches, opts, args.concurrency, args.tokens)
        print(f"{name:26} {line}")


if __name__ == "__main__":
    main()
