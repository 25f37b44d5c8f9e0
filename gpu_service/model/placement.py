"""Expert parallelism's routed MoE: each rank holds a contiguous share of the experts whole
(`shard.expert_range`), computes the (row, expert) pairs routed to them, and the pairs' outputs
travel to the rank that adds up their row; the rows' sums are then gathered by every rank.

Under tensor parallelism attention and GDN leave every rank with the same rows, and the router
is replicated, so every rank holds every row and knows every pair's expert, and so every count
of the exchange, without a message: the dispatch is a local read of the rows routed to this
rank's experts (vLLM's EP beside TP attention reads them so too). Only the results travel, in
two collectives:
- an all-to-all (`TpGroup.exchange`): rank r combines rows [r S, (r + 1) S), S = ceil(P / N),
  and receives from every rank the outputs of its pairs among those rows;
- an all-gather of the ranks' S combined rows, so every rank holds all P.

A row's sum is the one-device sum: its k contributions (each its expert's output times its
routing weight, rounded to the activations' dtype, the bytes one device's grouped GEMM gives
that pair whatever other rows share it) added in increasing expert id, in the activations'
dtype, by `kernels.moe.naive.sum_in_expert_order`, the function one device adds them with. It
depends neither on the batch, nor on which rank computed which expert, nor on which rank added
it up. The traffic is a rank's pairs' outputs (P k / N rows on average) and P rows gathered,
against TP's all-reduce of P rows; the GEMMs run each expert's whole width.

A load-balancing placement (vLLM's EPLB: hot experts replicated, placement from measured loads)
is the next step; here expert e lives on rank e // (E / N)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_service.model.ops import padded_rows
from gpu_service.tp.group import TpGroup
from kernels.fp8.naive import BlockFp8
from kernels.moe.naive import sum_in_expert_order

# The ops' routed MoE (`EagerOps.moe`): x, w13, w2, experts [P, k], weights [P, k] -> [P, H]
Moe = Callable[
    [torch.Tensor, torch.Tensor | BlockFp8, torch.Tensor | BlockFp8, torch.Tensor, torch.Tensor],
    torch.Tensor,
]


@dataclass(frozen=True)
class Routes:
    """This rank's part of a call's exchange: the pairs it computes and where their outputs go,
    and what it receives of the rows it adds up (every rank derives its own from the same
    routing)."""

    mine: torch.Tensor  # [n] int64: the pairs (row * k + j) this rank's experts take, ascending
    send: list[int]  # rows of `mine`'s outputs for each rank, in `mine`'s order
    receive: list[int]  # pairs each rank computed of the rows this rank combines
    # [received] int64: those pairs in the order they arrive, less the first pair of those rows
    arrived: torch.Tensor
    span: int  # rows each rank combines


def _even(n: int, size: int) -> list[int]:
    return [n // size + (r < n % size) for r in range(size)]


def routes(experts: torch.Tensor, per_rank: int, group: TpGroup) -> Routes:
    """experts: [P, k] int64, every rank's the same -> this rank's `Routes`, its counts read to
    the host. On `meta` (the memory plan and the kernel report run no router), an even share:
    each rank computes P k / N pairs, and receives as many of each rank."""
    rows, top_k = experts.shape
    size, rank = group.size, group.rank
    span = -(-rows // size)
    first, last = min(rows, rank * span) * top_k, min(rows, (rank + 1) * span) * top_k
    if experts.is_meta:
        mine = torch.empty(-(-rows * top_k // size), dtype=torch.long, device=experts.device)
        arrived = torch.empty(last - first, dtype=torch.long, device=experts.device)
        sends = _even(mine.numel(), size)
        return Routes(mine, sends, _even(last - first, size), arrived, span)
    owner = experts.reshape(-1) // per_rank  # [P k] the rank holding each pair's expert
    combiner = torch.arange(rows * top_k, device=experts.device) // top_k // span
    counts = torch.bincount(owner * size + combiner, minlength=size * size).view(size, size)
    table = counts.tolist()  # [holder][combiner]
    mine = (owner == rank).nonzero()[:, 0]  # ascending, so grouped by combiner
    # The rows this rank combines arrive holder by holder, each holder's pairs ascending.
    arrived = torch.sort(owner[first:last], stable=True).indices
    receive = [table[r][rank] for r in range(size)]
    return Routes(mine, table[rank], receive, arrived, span)


def _computed(
    moe: Moe,
    x: torch.Tensor,
    w13: torch.Tensor | BlockFp8,
    w2: torch.Tensor | BlockFp8,
    pair_experts: torch.Tensor,
    pair_weights: torch.Tensor,
    mine: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """Each of `mine`'s pairs' weighted expert output -> [n, H]: the ops' MoE over one pair a
    row (padded to the row tile with zero rows of weight 0), whose sum of one is the pair's
    contribution as one device rounds it. pair_experts: local expert ids, [P k]."""
    n = mine.numel()
    if n == 0:
        return x.new_empty(0, x.shape[1])
    pad = padded_rows(n) - n
    rows = torch.nn.functional.pad(x.index_select(0, mine // top_k), (0, 0, 0, pad))
    chosen = torch.nn.functional.pad(pair_experts.index_select(0, mine), (0, pad))
    weights = torch.nn.functional.pad(pair_weights.index_select(0, mine), (0, pad))
    return moe(rows, w13, w2, chosen[:, None], weights[:, None])[:n]


def placed_moe(
    moe: Moe,
    x: torch.Tensor,
    w13: torch.Tensor | BlockFp8,
    w2: torch.Tensor | BlockFp8,
    experts: torch.Tensor,
    weights: torch.Tensor,
    held: range,
    group: TpGroup,
) -> torch.Tensor:
    """The routed experts of every row with this rank holding experts `held` (w13: [E/N, H, 2I],
    w2: [E/N, I, H]). x: [P, H], experts: [P, k] int64 (global ids, sorted per row), weights:
    [P, k] in x's dtype, all the same on every rank -> [P, H], the same bytes on every rank and
    those of one device's `moe`."""
    rows, top_k = experts.shape
    plan = routes(experts, len(held), group)
    local = experts.reshape(-1) - held.start
    y = _computed(moe, x, w13, w2, local, weights.reshape(-1), plan.mine, top_k)
    received = group.exchange(y, plan.send, plan.receive)
    contributions = x.new_zeros(plan.span * top_k, x.shape[1])
    contributions.index_copy_(0, plan.arrived, received)
    combined = sum_in_expert_order(contributions.view(plan.span, top_k, -1))
    return torch.cat(group.gather(combined))[:rows]
