"""What the memory plan (`plan.py`) sizes from the settings alone, since only a call
allocates it: one forward's live activations, the split kernels' fp32 partials, and the
captured graphs' buffers and pool, each graph captured once on the `meta` device by the graphs'
own code."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_service.engine.graphs import Graphs, buckets, key_bucket
from gpu_service.model.batch import Segment
from gpu_service.model.config import ModelConfig, ServiceConfig
from gpu_service.model.hybrid import HybridModel, held_bytes
from gpu_service.model.ops import padded_rows
from gpu_service.model.state import DeviceState
from kernels.attention.naive import KEY_BLOCK
from kernels.fp8.naive import BlockFp8

META = torch.device("meta")


# -- activations ---------------------------------------------------------------------------


def widest_linear(cfg: ModelConfig) -> int:
    """The widest output of a layer's linears (the LM head aside: a prefill runs it on one row
    per sequence, and a verify's logits are counted as such)."""
    attention = 2 * (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.head_dim
    gdn = 2 * (cfg.key_dim + cfg.value_dim)
    inner = max(cfg.intermediate_size, cfg.moe_intermediate_size)
    return max(attention, gdn, 2 * inner, 2 * cfg.shared_expert_intermediate_size, cfg.num_experts)


def activation_bytes(cfg: ModelConfig, rows: int, itemsize: int) -> int:
    """An estimate of one forward's live activations at its widest layer, for `rows` rows:
    rows * ((2 H + 2 W) * itemsize + 4 F), where H is the hidden size (the residual and its
    norm), W the widest linear's output (it, and as much again made from it: the conv output,
    the gated norm's) and F the widest fp32 intermediates (the GDN mix's output, allocated
    and then filled by the kernel's, so 2 x value_dim; or the router's logits, probabilities
    and weights, 3 x experts). The Triton kernels allocate only their outputs, so nothing per
    key or per chunk is counted; the eager forward's per-row verify states are not either."""
    f = max(2 * cfg.value_dim, 3 * cfg.num_experts)
    return rows * ((2 * cfg.hidden_size + 2 * widest_linear(cfg)) * itemsize + 4 * f)


def exchange_bytes(cfg: ModelConfig, rows: int, itemsize: int) -> int:
    """Expert parallelism's buffers beside a MoE layer of `rows` rows, at their most (every
    pair routed to this rank's experts): the pairs' rows, gate and up, activation and outputs,
    rows * k * (2 H + 3 I), and the rows this rank adds up and then gathers, 2 rows * H
    (`gpu_service/model/placement.py`)."""
    pairs = rows * cfg.num_experts_per_tok
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return (pairs * (2 * h + 3 * i) + 2 * rows * h) * itemsize


def split_workspace_bytes(model: HybridModel, rows: int) -> int:
    """The fp32 partials the split kernels of a verify, decode or drafter call of `rows` rows
    allocate on a GPU, each live only during its own kernel pair, so the larger counts:
    attention's split of the keys, or the GEMM's split of K at the linear that needs most
    (`kernels/attention/splits.py`, `kernels/matmul/triton.py`, `kernels/fp8/triton.py`). A
    prefill splits neither."""
    from kernels.attention.splits import workspace_bytes
    from kernels.fp8.triton import plan as fp8_plan
    from kernels.matmul.triton import plan as gemm_plan

    cfg = model.cfg
    attention = workspace_bytes(rows, cfg.num_attention_heads, cfg.head_dim)
    gemm = 0
    for w in model.wt.values():
        if isinstance(w, BlockFp8) and w.weight.dim() == 2:
            gemm = max(gemm, fp8_plan(rows, w.shape[1], w.shape[0]).workspace_bytes)
        elif isinstance(w, torch.Tensor) and w.dim() == 2:
            gemm = max(gemm, gemm_plan(rows, w.shape[1], w.shape[0]).workspace_bytes)
    return max(attention, gemm)


# -- captured graphs -----------------------------------------------------------------------


class _Recorder:
    """A capture that keeps each function it is given and replays nothing: the graphs build
    their persistent buffers as on a GPU, and no forward runs."""

    def __init__(self) -> None:
        self.runs: list[Callable[[], None]] = []

    def __call__(self, run: Callable[[], None]) -> Callable[[], None]:
        self.runs.append(run)
        return lambda: None


def key_lengths(max_context: int) -> list[int]:
    """Every key length graphs are captured at."""
    doublings = range(max_context.bit_length())
    return sorted({key_bucket(KEY_BLOCK << i, max_context) for i in doublings})


def _buckets(svc: ServiceConfig) -> tuple[int, ...]:
    """The buckets a call can run in: it has at most max_batch sequences, one a slot."""
    return buckets(min(svc.max_batch, svc.num_slots))


def verify_shapes(svc: ServiceConfig) -> list[tuple[int, int]]:
    """(bucket, rows per sequence) of every verify graph a service can capture: the fewest
    sequences that run in a bucket must fit the row budget at that many rows each, and be
    that many slots deep enough."""
    sizes, caps = _buckets(svc), svc.slot_verify_drafts
    fewest = [1, *(b + 1 for b in sizes[:-1])]
    deep = {k: sum(c + 1 >= k for c in caps) for k in range(1, max(caps) + 2)}
    return [
        (b, k)
        for b, n in zip(sizes, fewest, strict=True)
        for k, slots in deep.items()
        if n * k <= svc.max_rows and n <= slots
    ]


def chain_shapes(cfg: ModelConfig, svc: ServiceConfig) -> list[tuple[int, int]]:
    """(bucket, drafts) of every chain graph; none without a drafter."""
    deepest = max(svc.slot_verify_drafts) + 1
    sizes = _buckets(svc) if cfg.has_mtp else ()
    return [(b, nd) for b in sizes for nd in range(1, deepest + 1)]


def _kept_bytes(graphs: Graphs, run: Callable[[], None]) -> int:
    """Bytes of what the newest graph keeps: its inputs, outputs and every tensor its function
    holds (a view counted as its base, each base once)."""
    graph = next(reversed(graphs.graphs.values()))
    cells = [c.cell_contents for c in getattr(run, "__closure__", None) or ()]
    tensors = [t for t in [*graph.inputs, *graph.outputs, *cells] if isinstance(t, torch.Tensor)]
    bases = {id(b): b for b in (t if t._base is None else t._base for t in tensors)}
    return held_bytes(list(bases.values()))


def graph_parts(model: HybridModel, state: DeviceState, svc: ServiceConfig) -> tuple[int, int]:
    """-> (graphs, bytes). Each verify and chain shape is captured once, on the meta device,
    by the graphs' own code; a shape's buffers do not depend on its key length (nor, for a
    verify, on whether the live state advances), so they count once per such key. Captures
    share one memory pool and replay one at a time: on top, the pool holds about one
    capture's intermediates, estimated as the widest capture's rows through the widest layer
    (`activation_bytes`) plus, for the chain, its logits and their fp32 softmax."""
    recorder, cfg, size = _Recorder(), model.cfg, model.dtype.itemsize
    graphs = Graphs(model, state, svc.max_batch, svc.max_context, recorder)
    keys = len(key_lengths(svc.max_context))
    verify, chain = verify_shapes(svc), chain_shapes(cfg, svc)
    buffers = 0
    for b, k in verify:
        graphs.verify([Segment(0, 0, k, i * k) for i in range(b)], [0] * (b * k), True)
        buffers += 2 * keys * _kept_bytes(graphs, recorder.runs[-1])
    for b, nd in chain:
        zeros = torch.zeros(b, dtype=torch.long, device=META)
        hidden = torch.zeros(b, cfg.hidden_size, dtype=model.dtype, device=META)
        graphs.chain(zeros, hidden, zeros, zeros, 0, nd)
        buffers += keys * _kept_bytes(graphs, recorder.runs[-1])
    rows = max((padded_rows(b * k) for b, k in verify), default=0)
    widest_chain = max((b for b, _ in chain), default=0)
    pool = activation_bytes(cfg, max(rows, widest_chain), size)
    pool += split_workspace_bytes(model, max(rows, widest_chain))
    pool += widest_chain * cfg.vocab_size * (size + 4)
    return (2 * len(verify) + len(chain)) * keys, buffers + pool
