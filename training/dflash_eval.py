"""The trained drafter measured as it is used: the published greedy loop (z-lab's
`dflash_generate`), one held-out prompt at a time. The target verifies `[last, d1 .. d_gamma]`,
the drafts that match its argmax stand, its next argmax is the bonus, and the drafter's context
gains the committed rows' taps. A verify's accepted length counts the tokens it commits, the
bonus included. The loop's tokens are the target's greedy ones whatever the drafter proposes;
`spec_loop` checks that it is so."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gpu_service.dflash.naive import NaiveDFlash
from training.forward import TrainForward


@dataclass
class Acceptance:
    verifies: int = 0
    committed: int = 0  # tokens the verifies committed, bonus included
    reached: list[int] = field(default_factory=list)  # per draft position: verifies judging it
    stood: list[int] = field(default_factory=list)  # per draft position: drafts that stood

    def add(self, drafted: int, accepted: int) -> None:
        while len(self.reached) < drafted:
            self.reached.append(0)
            self.stood.append(0)
        self.verifies += 1
        self.committed += accepted + 1
        for j in range(min(accepted + 1, drafted)):
            self.reached[j] += 1
            self.stood[j] += j < accepted

    @property
    def accepted_length(self) -> float:
        return self.committed / max(self.verifies, 1)

    @property
    def by_position(self) -> list[float]:
        """Of the verifies that judged draft j (every earlier one stood), the share where it
        stood too."""
        return [s / r if r else 0.0 for s, r in zip(self.stood, self.reached, strict=True)]


def _run(
    target: TrainForward, tokens: list[int], layer_ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (argmax of every row [T], taps of every row [T, K * H])"""
    outs = target.residuals(torch.tensor([tokens]))
    hidden = target.norm(outs[-1], "model.norm")[0]
    taps = torch.cat([outs[i][0] for i in layer_ids], -1)
    return F.linear(hidden, target.lm_head).argmax(-1), taps


@torch.no_grad()
def spec_loop(
    target: TrainForward,
    drafter: NaiveDFlash,
    prompt: list[int],
    new_tokens: int,
    gamma: int,
    stats: Acceptance,
) -> list[int]:
    """Greedy continuation of `prompt`, `new_tokens` long, drafted `gamma` at a time."""
    layer_ids = drafter.cfg.target_layer_ids
    drafter.crop(0)
    argmax, taps = _run(target, prompt, layer_ids)
    drafter.extend(taps)
    tokens = [*prompt, int(argmax[-1])]
    while len(tokens) - len(prompt) < new_tokens:
        start = len(tokens) - 1  # the bonus token's position: not through the target yet
        drafts = drafter.propose(tokens[-1], gamma)
        argmax, taps = _run(target, tokens + drafts, layer_ids)
        posterior = argmax[start:].tolist()
        accepted = 0
        while accepted < gamma and drafts[accepted] == posterior[accepted]:
            accepted += 1
        stats.add(gamma, accepted)
        drafter.extend(taps[start : start + accepted + 1])
        tokens += [*drafts[:accepted], posterior[accepted]]
    return tokens[len(prompt) : len(prompt) + new_tokens]


@torch.no_grad()
def greedy(target: TrainForward, prompt: list[int], new_tokens: int) -> list[int]:
    """The target alone, one token a step (the check that the loop is lossless)."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        hidden = target.hidden(torch.tensor([tokens]))[0, -1]
        tokens.append(int(F.linear(hidden, target.lm_head).argmax()))
    return tokens[len(prompt) :]
