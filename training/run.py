"""`met train`: the default checkpoint, main model and MTP head together, on the standard
library's source.

Deterministic given `TrainConfig.seed`: the batch of step `s` is drawn from a generator seeded
by (seed, s), so a run resumed from its last checkpoint (weights, optimizer, step, written
every `save_every` steps and on Ctrl-C) continues exactly as an uninterrupted one would. Weights
train in fp32 and are exported in bf16, then evaluated as exported."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from control_plane.text.chat import write_default_template
from gpu_service.model.config import LAYER_PATTERN, ModelConfig
from gpu_service.model.weights import init_weights, save_weights
from training.corpus import Corpus, encode_files, special_ids, train_tokenizer
from training.forward import TrainForward
from training.loop import Progress, apply, batch_at, load_state, lr_at, make_optimizer, save_state
from training.options import TrainConfig

STATE_FILE = "state.pt"
# Output projections of each residual branch start scaled down, as GPT-2 does, so the
# residual stream's variance does not grow with depth at initialisation.
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")


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
