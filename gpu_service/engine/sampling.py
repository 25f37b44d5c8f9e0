"""Sampling on the service: target distributions with temperature, top-k, min-p and top-p (in
vLLM's order: min-p cuts before top-p sums), and
inverse-CDF draws from uniforms the control plane sends (so a seeded request replays).

For a verify row j of a sampled sequence the service reports what rejection sampling needs:
`p_next` (the target probability of the next row's token, the draft d_{j+1}), `resample` (a
draw from the residual max(0, p_j - q_j), renormalised, where q_j is the distribution the
draft was sampled from) and `sample` (a draw from p_j itself, the bonus token). The control
plane makes the accept decision with its own uniform."""

from __future__ import annotations

import torch

from protos import checks
from protos.handles import RowDraws
from protos.model import InvalidArgument, Sampling


def distribution(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits: [n, V] -> probabilities [n, V] in fp64 (masked tokens at -inf stay at 0)."""
    x = logits.double() / s.temperature
    if 0 < s.top_k < x.shape[-1]:  # 0 or -1: no limit
        kth = x.topk(s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if s.min_p > 0.0:
        p = p.masked_fill(p < s.min_p * p.max(-1, keepdim=True).values, 0.0)
        p = p / p.sum(-1, keepdim=True)
    if 0.0 < s.top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(-1) - sorted_p >= s.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, order, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def draw(p: torch.Tensor, u: float) -> int:
    """The token whose cumulative probability first exceeds u * total. p: [V]"""
    cdf = p.cumsum(0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype)))
    return min(index, p.shape[0] - 1)


def row_draws(
    p: torch.Tensor,
    q: torch.Tensor | None,
    next_token: int | None,
    u: float,
    logp: torch.Tensor | None = None,
) -> RowDraws:
    """p, q: [V] (q: the draft distribution of the next row's token, or None); logp: [V], the
    row's log-softmax the draws' log-probabilities are read from (None: reported as 0)."""
    residual = p if q is None else (p - q).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:
        residual = p
    resample, sample = draw(residual, u), draw(p, u)
    return RowDraws(
        p_next=float(p[next_token]) if next_token is not None else 0.0,
        resample=resample,
        sample=sample,
        resample_logprob=0.0 if logp is None else float(logp[resample]),
        sample_logprob=0.0 if logp is None else float(logp[sample]),
    )


def check_sampling(sampling: dict[int, Sampling], uniforms: dict[int, int], n: int) -> None:
    """Each sampling sequence's parameters in the ranges of `checks.FLOATS` (a temperature
    above 0: greedy sequences send none), with one uniform per draw."""
    for i, smp in sampling.items():
        checks.within("a sampling sequence index", i, 0, n - 1)
        if smp.temperature == 0:
            raise InvalidArgument(
                f"sequence {i} samples at temperature 0; greedy sequences send no sampling"
            )
        if len(smp.uniforms) != uniforms[i]:
            raise InvalidArgument(
                f"sequence {i} sent {len(smp.uniforms)} uniforms for {uniforms[i]} draws"
            )
        for name in ("temperature", "top_p", "min_p"):
            checks.number(name, getattr(smp, name), f"sequence {i}'s {name}")
        for u in smp.uniforms:
            checks.number("uniform", u, f"a uniform of sequence {i}")
        if smp.top_k < -1:
            raise InvalidArgument(f"sequence {i}'s top_k is {smp.top_k}; it must be -1 or above")
