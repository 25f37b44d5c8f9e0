"""The training loop's parts that `met train`'s main run and its distillation share: the
learning-rate schedule, the batches, the optimizer, one step, the progress line, and the
resumable state."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import torch

from training.options import TrainConfig

_NO_DECAY = ("norm.weight", "A_log", "dt_bias", "layernorm.weight")


class Schedule(Protocol):
    """The settings the schedule and the optimizer read (`TrainConfig`, `DFlashTrainConfig`)."""

    @property
    def steps(self) -> int: ...
    @property
    def warmup(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def min_lr_ratio(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...


def lr_at(tc: Schedule, step: int) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    done = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * cos)


def batch_at(tokens: torch.Tensor, tc: TrainConfig, step: int) -> torch.Tensor:
    """Windows of seq_len + 1 tokens at offsets drawn from (seed, step): [B, T + 1]"""
    gen = torch.Generator().manual_seed(tc.seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - tc.seq_len - 1, (tc.batch,), generator=gen)
    return torch.stack([tokens[s : s + tc.seq_len + 1] for s in starts.tolist()]).long()


def make_optimizer(params: dict[str, torch.Tensor], tc: Schedule) -> torch.optim.Optimizer:
    decay = [w for n, w in params.items() if w.dim() >= 2 and not n.endswith(_NO_DECAY)]
    rest = [w for n, w in params.items() if not (w.dim() >= 2 and not n.endswith(_NO_DECAY))]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": tc.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=tc.lr,
        betas=(0.9, 0.95),
    )


class Progress:
    """One line, rewritten in place: step, losses, tokens per second, time left."""

    def __init__(self, total: int, stream=None) -> None:
        self.total, self.stream = total, stream or sys.stderr
        self.tty = self.stream.isatty()

    def update(self, step: int, losses: dict[str, float], tok_s: float, left_s: float) -> None:
        width = 24
        filled = int(width * step / self.total)
        bar = "#" * filled + "." * (width - filled)
        parts = " ".join(f"{k} {v:.3f}" for k, v in losses.items())
        line = (
            f"step {step:5d}/{self.total} [{bar}] {parts} | {tok_s:6.0f} tok/s "
            f"| {int(left_s // 60):2d}:{int(left_s % 60):02d} left"
        )
        if self.tty:
            self.stream.write("\r" + line)
        elif step % 10 == 0 or step == self.total:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def save_state(
    path: Path,
    params: dict[str, torch.Tensor],
    opt: torch.optim.Optimizer,
    step: int,
    tc: TrainConfig,
    log: list[dict],
    seconds: float,
) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "params": {n: w.detach() for n, w in params.items()},
            "optimizer": opt.state_dict(),
            "step": step,
            "train_config": asdict(tc),
            "log": log,
            "seconds": seconds,
        },
        tmp,
    )
    tmp.replace(path)


def load_state(
    path: Path,
    params: dict[str, torch.Tensor],
    opt: torch.optim.Optimizer,
    tc: TrainConfig,
    stage: str = "",
) -> tuple[int, list[dict], float]:
    """Restore weights and optimizer from `path` when it exists; -> step, loss log, seconds.
    `stage` names a stage after the main run (`distillation`), whose settings all count."""
    if not path.exists():
        return 0, [], 0.0
    saved = torch.load(path)
    check_settings(path, saved["train_config"], tc, main_only=not stage)
    with torch.no_grad():
        for n, w in params.items():
            w.copy_(saved["params"][n])
    opt.load_state_dict(saved["optimizer"])
    print(
        f"resuming {stage + ' ' if stage else ''}at step {saved['step']} from {path}",
        file=sys.stderr,
    )
    return saved["step"], saved["log"], saved.get("seconds", 0.0)


def check_settings(path: Path, saved: dict, tc: TrainConfig, main_only: bool) -> None:
    """A resume must run under the settings its state was written with; the main run's
    state ignores the distillation's settings, which do not change it."""

    def kept(settings: dict) -> dict:
        return {k: v for k, v in settings.items() if not (main_only and k.startswith("distill_"))}

    if kept(saved) != kept(asdict(tc)):
        raise ValueError(
            f"{path} was written with other training settings; remove it or pass the same ones"
        )


def apply(
    losses: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    opt: torch.optim.Optimizer,
    tc: TrainConfig,
    lr: float,
) -> dict[str, float]:
    """One AdamW step at learning rate `lr` on the weighted sum of `losses` (`main`, `mtp`,
    `mtp2`: those present), gradients clipped to norm 1 over `params`; -> the losses."""
    for group in opt.param_groups:
        group["lr"] = lr
    weights = {"main": 1.0, "mtp": tc.mtp_weight, "mtp2": tc.mtp2_weight}
    total = sum(weights[k] * v for k, v in losses.items())
    assert isinstance(total, torch.Tensor)
    opt.zero_grad(set_to_none=True)
    total.backward()
    torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
    opt.step()
    return {k: v.item() for k, v in losses.items()}
