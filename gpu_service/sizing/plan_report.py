"""How a memory plan (`gpu_service/sizing/plan.py`) reads: `met gpu-service plan`'s report and JSON,
and the summary and the refusal `serve` prints before it loads a weight."""

from __future__ import annotations

import argparse
import json
import os
import sys

from gpu_service.engine import compiled
from gpu_service.engine.device import DeviceError, resolve_device
from gpu_service.engine.graphs import NO_GRAPHS_ENV
from gpu_service.engine.verifier import SCORE_ROWS
from gpu_service.sizing.plan import PARTS, Memory, MemoryPlan, from_args
from gpu_service.tp import SIZES
from kernels.attention.format import KEY_BLOCK


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _slots(n: int) -> str:
    return f"{n} slot" if n == 1 else f"{n} slots"


def _per_rank(plan: MemoryPlan) -> str:
    """What follows a byte count under tensor parallelism: every byte of the plan is one
    rank's."""
    return "" if plan.tensor_parallel_size == 1 else " per rank"


def _settings(plan: MemoryPlan) -> str:
    svc, n = plan.svc, plan.tensor_parallel_size
    dtype = str(plan.dtype).removeprefix("torch.")
    if plan.quantization:
        dtype += f", linears in {plan.quantization}"
    if n > 1:
        dtype += f", per rank x {n} ranks (a device each)"
    if plan.expert_parallel:
        dtype += f", experts placed ({plan.experts_per_rank} a rank)"
    return (
        f"{plan.model} in {dtype}: {_slots(svc.num_slots)} (verify tiers {svc.verify_tiers}), "
        f"max context {svc.max_context}{_lowered(plan)}, max prefill {svc.max_prefill_tokens} "
        "tokens, "
        f"graphs {'counted' if plan.graphs else 'off'}"
    )


def _lowered(plan: MemoryPlan) -> str:
    if not plan.model_context:
        return ""
    return f" (the model's {plan.model_context}, lowered to what the memory holds)"


def _notes(plan: MemoryPlan) -> dict[str, str]:
    svc = plan.svc
    weights = ", ".join(f"{k} {human(v)}" for k, v in plan.weights_by_dtype.items())
    positions = svc.num_kv_blocks * KEY_BLOCK
    return {
        "weights_bytes": weights,
        "kv_cache_bytes": f"{svc.num_kv_blocks} blocks of {KEY_BLOCK} positions: {positions} "
        f"positions, {positions / svc.max_context:.2f}x the max context",
        "graphs_bytes": f"{plan.num_graphs} graphs at most, with their capture pool",
        "penalty_bytes": "every slot penalized",
        "score_bytes": f"the larger of {SCORE_ROWS} prompt rows scored at a time (prompt "
        f"logprobs) and {svc.max_rows} verify rows' alternatives (top_logprobs, sampling)",
        "workspace_bytes": f"the most of {svc.max_prefill_tokens} prefill rows, {svc.max_rows} "
        "verify rows with their split partials, or their penalties",
        "vision_bytes": f"one image of {svc.max_image_pixels} pixels through the tower, and the "
        "image embeddings the slots and a call may hold",
    }


def verdict(plan: MemoryPlan, why: bool = True) -> str:
    """Whether the plan fits, and by how much; with `why`, what to lower when it does not."""
    if plan.fits is None:
        return "no device memory to check against (no CUDA device; --device-memory gives one)"
    if plan.fits:
        spare = (plan.memory.bytes or 0) - plan.total
        return f"fits{_per_rank(plan)}: {_memory(plan.memory)}, {human(spare)} to spare"
    return f"does not fit: {refusal(plan)}" if why else f"does not fit: {_memory(plan.memory)}"


def report(plan: MemoryPlan) -> str:
    """The plan as `met gpu-service plan` prints it: a line a part, the total, the verdict."""
    notes = _notes(plan)
    lines = [_settings(plan)]
    for key, label in PARTS.items():
        note = f"  {notes[key]}" if key in notes else ""
        lines.append(f"  {label:<30} {human(plan.parts[key]):>10}{note}")
    lines.append(f"  {'total' + _per_rank(plan):<30} {human(plan.total):>10}")
    if plan.expert_bytes:
        label = "of the weights, routed experts"
        lines.append(f"  {label:<30} {human(plan.expert_bytes):>10}  {_experts(plan)}")
    lines.append(verdict(plan))
    return "\n".join(lines)


def _experts(plan: MemoryPlan) -> str:
    """What a rank holds of the routed experts."""
    n, per = plan.tensor_parallel_size, plan.experts_per_rank
    if plan.expert_parallel:
        return f"{per} experts whole a rank (rank r: ids {per}r to {per}r + {per - 1})"
    if n > 1:
        return f"every one of the {per} experts, 1/{n} of its intermediate"
    return f"{per} experts"


def summary(plan: MemoryPlan) -> str:
    """The few lines `serve` prints before it loads a weight."""
    p = plan.parts
    gdn = p["gdn_state_bytes"] + p["conv_state_bytes"]
    named = p["weights_bytes"] + p["kv_cache_bytes"] + gdn + p["verify_bytes"]
    return (
        f"gpu-service plan: weights {human(p['weights_bytes'])}, KV {human(p['kv_cache_bytes'])}, "
        f"GDN {human(gdn)}, verify {human(p['verify_bytes'])}, other "
        f"{human(plan.total - named)}; total {human(plan.total)}{_per_rank(plan)} for "
        f"{_slots(plan.svc.num_slots)}\n"
        f"gpu-service plan: {verdict(plan, why=False)}"
    )


def refusal(plan: MemoryPlan) -> str:
    """Why the plan does not fit, and what to lower, in one sentence."""
    svc, weights = plan.svc, plan.parts["weights_bytes"]
    head = f"the plan needs {human(plan.total)}{_per_rank(plan)} but {_memory(plan.memory)}"
    bf16 = "serve --dtype bf16" if plan.dtype.itemsize > 2 else None
    if weights > (plan.memory.bytes or 0):
        more = "serve it on devices with more memory, or over more of them (--tensor-parallel-size)"
        advice = bf16 or more
        return f"{head}: the weights alone take {human(weights)}; {advice}"
    slots = f"--num-slots ({svc.num_slots}), " if svc.num_slots > 1 else ""
    lower = f"lower {slots}--kv-blocks ({svc.num_kv_blocks}) or --verify-tiers"
    return f"{head}: the weights take {human(weights)}; {lower}{f', or {bf16}' if bf16 else ''}"


def to_json(plan: MemoryPlan) -> dict:
    svc = plan.svc
    return {
        "model": plan.model,
        "dtype": str(plan.dtype).removeprefix("torch."),
        "quantization": plan.quantization,
        "tensor_parallel_size": plan.tensor_parallel_size,
        "expert_parallel": plan.expert_parallel,
        "experts_per_rank": plan.experts_per_rank,
        "routed_expert_bytes": plan.expert_bytes,
        "num_slots": svc.num_slots,
        "verify_tiers": svc.verify_tiers,
        "max_context": svc.max_context,
        "max_rows": svc.max_rows,
        "max_batch": svc.max_batch,
        "max_prefill_tokens": svc.max_prefill_tokens,
        "graphs": plan.graphs,
        "num_graphs": plan.num_graphs,
        **plan.parts,
        "weights_by_dtype": plan.weights_by_dtype,
        "total_bytes": plan.total,
        "device_memory_bytes": plan.memory.bytes,
        "device_memory_source": plan.memory.source or None,
        "fits": plan.fits,
        "plan_seconds": round(plan.seconds, 3),
    }


def run(args: argparse.Namespace) -> int:
    """`met gpu-service plan`: 0 when the plan fits or there is no memory to check, 1 when it
    does not fit, 2 on a bad flag or config (one sentence on stderr)."""
    graphs = args.cuda_graphs and args.device != "cpu" and NO_GRAPHS_ENV not in os.environ
    try:
        device = resolve_device(args.device)
        # Compiled keys hold buffers as captured graphs do.
        tp = args.tensor_parallel_size
        graphs = graphs or compiled.decide(args.compile, device, tp, os.environ)[0]
        plan = from_args(args, device, graphs)
    except (DeviceError, OSError, ValueError) as e:
        print(f"met gpu-service plan: error: {e}", file=sys.stderr)
        return 2
    found = holding_size(args, plan, graphs) if plan.fits is False else None
    if args.json:
        body = to_json(plan)
        if found is not None:
            body["tensor_parallel_size_that_fits"] = found.tensor_parallel_size
        print(json.dumps(body, indent=2))
    else:
        print(report(plan))
        if found is not None:
            print(f"at --tensor-parallel-size {found.tensor_parallel_size}: {verdict(found)}")
    return 1 if plan.fits is False else 0


def holding_size(args: argparse.Namespace, plan: MemoryPlan, graphs: bool) -> MemoryPlan | None:
    """The plan at the smallest tensor-parallel size above `plan`'s whose every rank fits, with
    the same flags; None when none does or the model splits at none."""
    for size in (n for n in SIZES if n > plan.tensor_parallel_size):
        try:
            split = from_args(
                argparse.Namespace(**{**vars(args), "tensor_parallel_size": size}),
                resolve_device(args.device),
                graphs,
            )
        except ValueError:
            continue  # the size does not split the model, or cuts an FP8 scale block
        if split.fits:
            return split
    return None


def _memory(memory: Memory) -> str:
    amount = human(memory.bytes or 0)
    if memory.source == "--device-memory":
        return f"--device-memory is {amount}"
    return f"{memory.source} has {amount} free"
