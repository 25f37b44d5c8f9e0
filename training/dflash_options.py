"""`met train dflash`'s settings; torch-free, so the command line parses without importing
torch. Field names the main run shares (`steps`, `lr`, `warmup`, ...) mean what they mean
there (`training/loop.py` reads them)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from protos.defaults import DEFAULT_MODEL_DIR, DRAFTER_DIR


@dataclass(frozen=True)
class DFlashTrainConfig:
    # Data: windows of the training corpus as prompts, each continued greedily by the target
    # (through the engine): the drafter learns the target's choices, not the corpus's.
    sequences: int = 1536
    prompt_len: int = 128
    gen_len: int = 192
    # The drafter: Qwen3 layers at the target's width, reading these target layers' outputs.
    layers: int = 2
    taps: tuple[int, ...] = (1, 3, 5, 7, 9, 11)
    block_size: int = 16
    # Training: random anchors among the generated tokens; each block sees the context before
    # its anchor and its own rows; row k's cross-entropy weighs exp(-(k - 1) / loss_decay).
    anchors: int = 32
    loss_decay: float = 7.0
    steps: int = 3000
    batch: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.0
    seed: int = 0
    save_every: int = 100
    # A drafter directory (as `met train dflash` exports) whose weights start the run, in
    # place of the seeded initialisation: more training on more text from where one stopped.
    init_from: str = ""

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL_DIR, help="the target's checkpoint directory"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help=f"drafter directory (default: MODEL/{DRAFTER_DIR})"
    )
    parser.add_argument("--work", type=Path, default=Path("work/dflash"), help="data and state")
    parser.add_argument("--corpus", type=Path, default=None, help="source root (default: stdlib)")
    for f in fields(DFlashTrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "taps":
            parser.add_argument(
                flag,
                type=int,
                nargs="+",
                default=list(DFlashTrainConfig.taps),
                help="target layers the drafter reads (id i: layer i's output)",
            )
            continue
        kind = type(f.default)
        parser.add_argument(flag, type=kind, default=f.default, help=f"(default {f.default})")


def from_args(args: argparse.Namespace) -> DFlashTrainConfig:
    values = {f.name: getattr(args, f.name) for f in fields(DFlashTrainConfig)}
    values["taps"] = tuple(values["taps"])
    return DFlashTrainConfig(**values)
