"""Sampling on the service: inverse-CDF draws from uniforms the control plane sends (so a
seeded request replays), over the distributions of the logits pipeline's step 5
(`logits.distribution`).

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
