"""`met train`'s second stage: the MTP head alone learns the trained target's own next-token
distributions (self-distillation, as EAGLE and Medusa-2 train their drafters).

A draft stands when it is the target's choice, not the corpus's next token, so after the main
run the head's loss is the KL divergence from the target's distribution at the same position,
plus `distill_hard` times a cross-entropy on the target's argmax
(`TrainForward.distill_losses`); every other weight, the tied embedding included, stays as the
main run left it. Its batches are drawn after the main run's (step `steps + s`), its schedule
is the main run's shape over `distill_steps` at `distill_lr`, and it resumes from its own
state file as the main run does."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from training.forward import TrainForward
from training.loop import (
    Progress,
    apply,
    batch_at,
    load_state,
    lr_at,
    make_optimizer,
    save_state,
)
from training.options import TrainConfig

DISTILL_FILE = "distill.pt"


def head_names(params: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in params if n.startswith("mtp.")]


def schedule(tc: TrainConfig) -> TrainConfig:
    """The learning-rate schedule's settings for the distillation steps."""
    return replace(
        tc, steps=tc.distill_steps, lr=tc.distill_lr, warmup=max(1, tc.distill_steps // 20)
    )


def distill(
    train_tokens: torch.Tensor,
    work: Path,
    tc: TrainConfig,
    model: TrainForward,
    stop_at: int | None = None,
) -> tuple[list[dict], float]:
    """Distil the head of `model` in place; -> the loss log and the seconds spent, over every
    resume. `stop_at` saves and returns after that step, as a stop would."""
    work.mkdir(parents=True, exist_ok=True)
    params = model.p
    names = head_names(params)
    for n, w in params.items():
        w.requires_grad_(n in names)
    head = {n: params[n] for n in names}
    opt = make_optimizer(head, schedule(tc))
    path = work / DISTILL_FILE
    step, log, seconds = load_state(path, head, opt, tc, "distillation")
    progress = Progress(tc.distill_steps)
    t0, start, elapsed = time.perf_counter(), step, 0.0
    while step < min(tc.distill_steps, stop_at or tc.distill_steps):
        batch = batch_at(train_tokens, tc, tc.steps + step)
        values = _optimize(model, head, opt, batch, tc, lr_at(schedule(tc), step))
        step += 1
        log.append({"step": step, **values})
        elapsed = time.perf_counter() - t0
        rate = (step - start) * tc.batch * tc.seq_len / elapsed
        progress.update(step, values, rate, elapsed / (step - start) * (tc.distill_steps - step))
        if step % tc.save_every == 0 or step in (tc.distill_steps, stop_at):
            save_state(path, head, opt, step, tc, log, seconds + elapsed)
    progress.close()
    return log, seconds + elapsed


def _optimize(
    model: TrainForward,
    head: dict[str, torch.Tensor],
    opt: torch.optim.Optimizer,
    batch: torch.Tensor,
    tc: TrainConfig,
    lr: float,
) -> dict[str, float]:
    losses = model.distill_losses(batch[:, :-1], tc.mtp2_weight > 0, tc.distill_hard)
    return {f"distill_{k}": v for k, v in apply(losses, head, opt, tc, lr).items()}
