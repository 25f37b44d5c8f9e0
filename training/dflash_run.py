"""`met train dflash`: data from the target, the drafter trained, exported in the published
layout beside the target (`MODEL/dflash`), then measured in the greedy loop on the target's
held-out prompts against its MTP head, and its card written."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from gpu_service.dflash.config import CONFIG_FILE, DFlashConfig, read_config
from gpu_service.dflash.naive import NaiveDFlash
from gpu_service.dflash.weights import load_tensors, save_tensors
from gpu_service.model.config import ModelConfig
from gpu_service.model.weights import load_weights
from protos.defaults import DRAFTER_DIR
from training.corpus import Corpus
from training.dflash_data import build
from training.dflash_eval import Acceptance, greedy, spec_loop
from training.dflash_options import DFlashTrainConfig, from_args
from training.dflash_train import drafter_config, train
from training.forward import TrainForward

EVAL_TOKENS = 96
GAMMAS = (15, 8, 3)  # a whole block; the resolver's width at 1 to 4 requests; MTP's depth
LOSSLESS_PROMPTS = 4  # prompts whose loop is checked against plain greedy decoding


def export(weights: dict[str, torch.Tensor], cfg: DFlashConfig, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    save_tensors({k: v.to(torch.bfloat16) for k, v in weights.items()}, out)


def measure(model_dir: Path, drafter_dir: Path, prompts: list[str], tokens: int) -> dict:
    """The exported drafter, loaded as the service loads it, in the greedy loop at each of
    `GAMMAS` -> accepted length and acceptance by position per gamma."""
    from control_plane.text.tokenizer import load_tokenizer

    cfg = ModelConfig.load(model_dir)
    params, cfg = load_weights(cfg, model_dir, torch.float32)
    target = TrainForward(cfg, params, cfg.max_position_embeddings)
    dcfg = read_config(drafter_dir, cfg)
    drafter = NaiveDFlash(
        load_tensors(dcfg, drafter_dir, torch.float32),
        dcfg,
        params["model.embed_tokens.weight"],
        target.lm_head,
    )
    tok = load_tokenizer(model_dir)
    ids = [tok.encode(p) for p in prompts]
    report: dict = {"prompts": len(ids), "tokens": tokens}
    for gamma in GAMMAS:
        stats, t0 = Acceptance(), time.perf_counter()
        for i, p in enumerate(ids):
            out = spec_loop(target, drafter, p, tokens, gamma, stats)
            if gamma == GAMMAS[0] and i < LOSSLESS_PROMPTS and out != greedy(target, p, tokens):
                raise AssertionError(f"the DFlash loop changed prompt {i}'s greedy tokens")
        report[f"gamma_{gamma}"] = {
            "accepted_length": round(stats.accepted_length, 3),
            "by_position": [round(a, 3) for a in stats.by_position],
            "verifies": stats.verifies,
            "seconds": round(time.perf_counter() - t0, 1),
        }
    return report


def write_card(out: Path, report: dict) -> None:
    lines = [
        "# DFlash drafter for the bundled model",
        "",
        "Trained by `met train dflash` on the target's own greedy continuations of the training",
        "corpus; measured in the greedy DFlash loop on the target's held-out prompts "
        f"({report['eval']['prompts']} prompts, {report['eval']['tokens']} tokens each).",
        "",
        "| drafts per verify | accepted length (bonus included) |",
        "|---|---|",
    ]
    for g in GAMMAS:
        lines.append(f"| DFlash, {g} | {report['eval'][f'gamma_{g}']['accepted_length']} |")
    lines.append(f"| MTP head, 3 (the scheduler) | {report['mtp_accepted_length']} |")
    lines += ["", "Acceptance by block position (a whole block):", ""]
    by = report["eval"][f"gamma_{GAMMAS[0]}"]["by_position"]
    lines.append(" ".join(f"{j + 1}: {a}" for j, a in enumerate(by)))
    s = report["settings"]
    lines += [
        "",
        f"Training: {report['train_minutes']} min on the CPU, {s['steps']} steps of {s['batch']} "
        f"sequences x {s['anchors']} anchors; {s['sequences']} sequences of {s['prompt_len']} "
        f"prompt + {s['gen_len']} generated tokens; {s['layers']} layers reading target layers "
        f"{s['taps']}; final loss {report['final_loss']}.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def run(args: argparse.Namespace) -> int:
    from training.evaluate import acceptance, load_prompts

    tc: DFlashTrainConfig = from_args(args)
    model_dir: Path = args.model
    out: Path = args.out or model_dir / DRAFTER_DIR
    torch.manual_seed(tc.seed)
    cfg, params = _target(model_dir)
    data = build(model_dir, cfg, params, Corpus.scan(args.corpus), args.work, tc)
    dcfg = drafter_config(cfg, tc)
    weights, log, seconds = train(data, params, dcfg, args.work, tc)
    export(weights, dcfg, out)
    prompts = load_prompts(model_dir)
    report = {
        "settings": asdict(tc),
        "train_minutes": round(seconds / 60, 1),
        "final_loss": log[-1]["loss"] if log else None,
        "eval": measure(model_dir, out, prompts, EVAL_TOKENS),
        "mtp_accepted_length": acceptance(model_dir, prompts, EVAL_TOKENS, 8)[
            "mean_accepted_length"
        ],
    }
    (args.work / "dflash_report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_card(out, report)
    print(json.dumps(report, indent=2), file=sys.stderr)
    return 0


def _target(model_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    params, cfg = load_weights(ModelConfig.load(model_dir), model_dir, torch.float32)
    return cfg, params
