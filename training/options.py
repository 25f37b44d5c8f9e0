"""`met train`'s settings; torch-free, so the command line parses without importing torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from protos.defaults import DEFAULT_MODEL_DIR


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2200
    batch: int = 8
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = 0.5
    mtp2_weight: float = 0.3
    vocab_size: int = 4096
    seed: int = 0
    save_every: int = 100
    # Target layers, in Qwen3-Next's pattern: three Gated DeltaNet layers, then one gated
    # attention layer, repeated; one MTP layer after them.
    layers: int = 12
    # After the main run, the MTP head alone learns the trained target's own next-token
    # distributions (`training/distill.py`): acceptance is agreement with the target, not
    # with the corpus. Settings named `distill_*` leave the main run as it is, so a main run
    # resumes under other ones.
    distill_steps: int = 600
    distill_lr: float = 3e-3
    distill_hard: float = 1.0  # weight of the cross-entropy on the target's argmax


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR, help="checkpoint dir")
    parser.add_argument(
        "--work", type=Path, default=Path("build/train"), help="tokenizer, token cache, resume"
    )
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layers",
        type=_layers,
        default=TrainConfig.layers,
        help="target layers, a multiple of 4: three Gated DeltaNet layers then one attention "
        "layer, repeated (default: %(default)s)",
    )
    parser.add_argument(
        "--distill-steps",
        type=int,
        default=TrainConfig.distill_steps,
        help="steps of the MTP head learning the trained target's distributions after the "
        "main run (0: none; default: %(default)s)",
    )
    parser.add_argument(
        "--corpus", type=Path, default=None, help="a source tree (default: the stdlib's)"
    )


def _layers(text: str) -> int:
    n = int(text)
    if n < 4 or n % 4:
        raise argparse.ArgumentTypeError(f"{n} is not a positive multiple of 4")
    return n
