"""`met train`: the default checkpoint, main model and MTP head together, on the standard
library's source.

Deterministic given `TrainConfig.seed`: the batch of step `s` is drawn from a generator seeded
by (seed, s), so a run resumed from its last checkpoint (weights, optimizer, step, written
every `save_every` steps and on Ctrl-C) continues exactly as an uninterrupted one would. Weights
train in fp32 and are exported in bf16, then evaluated as exported."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from control_plane.chat import write_default_template
from gpu_service.config import LAYER_PATTERN, ModelConfig
from gpu_service.model.weights import init_weights, save_weights
from training.corpus import Corpus, encode_files, special_ids, train_tokenizer
from training.forward import TrainForward
from training.options import TrainConfig

STATE_FILE = "state.pt"
# Output projections of each residual branch start scaled down, as GPT-2 does, so the
# residual stream's variance does not grow with depth at initialisation.
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")
_NO_DECAY = ("norm.weight", "A_log", "dt_bias", "layernorm.weight")


def lr_at(tc: TrainConfig, step: int) -> float:
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


def model_config(
    vocab_size: int, bos: int, eos: int, layers: int = TrainConfig.layers
) -> ModelConfig:
    """The default shape at `layers` target layers, Qwen3-Next's pattern repeated."""
    return replace(
        ModelConfig(),
        vocab_size=vocab_size,
        bos_token_id=bos,
        eos_token_id=eos,
        num_hidden_layers=layers,
        layer_types=LAYER_PATTERN * (layers // len(LAYER_PATTERN)),
    )


def init_params(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    weights = init_weights(replace(cfg, torch_dtype="float32"), seed)
    scale = (2 * cfg.num_hidden_layers) ** -0.5
    for name, w in weights.items():
        if name.endswith(_RESIDUAL_OUTPUTS):
            w.mul_(scale)
        w.requires_grad_(True)
    return weights


def make_optimizer(params: dict[str, torch.Tensor], tc: TrainConfig) -> torch.optim.Optimizer:
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


def prepare(corpus: Corpus, work: Path, tc: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokenizer (trained once into the work directory) and the token streams."""
    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        train_tokenizer(corpus.train, tc.vocab_size, work)
    cache = work / "tokens.pt"
    if cache.exists():
        streams = torch.load(cache)
        return streams["train"], streams["held_out"]
    train, held = encode_files(tok_path, corpus.train), encode_files(tok_path, corpus.held_out)
    torch.save({"train": train, "held_out": held}, cache)
    return train, held


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


def _tokenizer_config(work: Path, cfg: ModelConfig | None, layers: int) -> ModelConfig:
    """`cfg` (or the default config) with the vocabulary and special ids of the tokenizer
    trained in `work`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(work / "tokenizer.json"))
    base = model_config(tok.get_vocab_size(), *special_ids(tok), layers)
    if cfg is None:
        return base
    return replace(
        cfg,
        vocab_size=base.vocab_size,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
    )


def _optimize(
    model: TrainForward,
    params: dict[str, torch.Tensor],
    opt: torch.optim.Optimizer,
    batch: torch.Tensor,
    tc: TrainConfig,
    lr: float,
) -> dict[str, float]:
    """One AdamW step on `batch` ([B, T + 1]) at learning rate `lr`; -> the losses."""
    return apply(model.losses(batch[:, :-1], mtp2=tc.mtp2_weight > 0), params, opt, tc, lr)


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


def train(
    corpus: Corpus,
    work: Path,
    tc: TrainConfig,
    cfg: ModelConfig | None = None,
    stop_at: int | None = None,
) -> tuple[dict[str, torch.Tensor], ModelConfig, list[dict]]:
    """Train (or resume) in `work`; -> fp32 weights, the model config, the loss log.
    `stop_at` saves and returns after that step, as a stop would (the schedule is still the
    whole run's)."""
    work.mkdir(parents=True, exist_ok=True)
    train_tokens, _ = prepare(corpus, work, tc)
    cfg = _tokenizer_config(work, cfg, tc.layers)
    params = init_params(cfg, tc.seed)
    opt = make_optimizer(params, tc)
    state_path = work / STATE_FILE
    step, log, seconds = load_state(state_path, params, opt, tc)
    model = TrainForward(cfg, params, tc.seq_len)
    progress = Progress(tc.steps)
    t0, start_step, elapsed = time.perf_counter(), step, 0.0
    try:
        while step < min(tc.steps, stop_at or tc.steps):
            batch = batch_at(train_tokens, tc, step)
            values = _optimize(model, params, opt, batch, tc, lr_at(tc, step))
            step += 1
            log.append({"step": step, **values})
            elapsed = time.perf_counter() - t0
            rate = (step - start_step) * tc.batch * tc.seq_len / elapsed
            left = elapsed / (step - start_step) * (tc.steps - step)
            progress.update(step, values, rate, left)
            if step % tc.save_every == 0 or step in (tc.steps, stop_at):
                save_state(state_path, params, opt, step, tc, log, seconds + elapsed)
    except KeyboardInterrupt:
        save_state(state_path, params, opt, step, tc, log, seconds + elapsed)
        progress.close()
        print(f"stopped at step {step}; run again to resume", file=sys.stderr)
        raise
    progress.close()
    return {n: w.detach() for n, w in params.items()}, cfg, log


def export(weights: dict[str, torch.Tensor], cfg: ModelConfig, work: Path, out: Path) -> None:
    """The checkpoint directory the service loads: config, bf16 weights, tokenizer, chat
    template."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg, torch_dtype="float32")  # the serving dtype on a CPU; weights stay bf16
    (out / "config.json").write_text(cfg.to_json())
    save_weights({n: w.to(torch.bfloat16) for n, w in weights.items()}, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((work / name).read_bytes())
    write_default_template(out)


def run(args: argparse.Namespace) -> int:
    from training.distill import distill
    from training.evaluate import evaluate, write_card

    torch.manual_seed(args.seed)
    tc = TrainConfig(
        steps=args.steps, seed=args.seed, layers=args.layers, distill_steps=args.distill_steps
    )
    if args.batch:
        tc = replace(tc, batch=args.batch)
    if args.seq_len:
        tc = replace(tc, seq_len=args.seq_len)
    corpus = Corpus.scan(args.corpus)
    weights, cfg, log = train(corpus, args.work, tc)
    seconds = torch.load(args.work / STATE_FILE)["seconds"]  # over every resume
    distilled: list[dict] = []
    if tc.distill_steps and cfg.has_mtp:
        model = TrainForward(cfg, weights, tc.seq_len)
        distilled, more = distill(prepare(corpus, args.work, tc)[0], args.work, tc, model)
        weights = {n: w.detach() for n, w in weights.items()}
        seconds += more
    minutes = seconds / 60
    export(weights, cfg, args.work, args.out)
    report = evaluate(args.out, corpus, args.work)
    report.update(
        train_config=asdict(tc),
        train_minutes=round(minutes, 1),
        final_losses={k: round(v, 4) for k, v in log[-1].items() if k != "step"},
        final_distill_losses={
            k: round(v, 4) for k, v in (distilled or [{}])[-1].items() if k != "step"
        },
        train_files=len(corpus.train),
        held_out_files=corpus.relative(corpus.held_out),
        python=sys.version.split()[0],
        parameters=sum(w.numel() for w in weights.values()),
        vocab_size=cfg.vocab_size,
    )
    (args.work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_card(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "held_out_files"}, indent=2))
    return 0
