"""The training corpus every machine has offline: the Python standard library's own source,
without its test suites. A fixed set of files, chosen by a hash of their relative paths, is
held out for evaluation; the split depends neither on the training `--seed` nor on which other
files exist."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BOS, EOS = "<|bos|>", "<|eos|>"
# Test suites, IDLE's UI strings and the generated codec tables of `encodings` are not the
# library's code; the tables would also teach the drafter to copy, flattering its acceptance.
_SKIPPED_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "encodings",
    "__pycache__",
}
HELD_OUT_EVERY = 20  # about one file in twenty


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative: str) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[Path, ...]
    held_out: tuple[Path, ...]

    @classmethod
    def scan(cls, root: Path | None = None) -> Corpus:
        root = root or stdlib_dir()
        files = sorted(
            f
            for f in root.rglob("*.py")
            if not _SKIPPED_DIRS & set(f.relative_to(root).parts[:-1]) and f.is_file()
        )
        if not files:
            raise FileNotFoundError(f"no Python files under {root}")
        held = tuple(f for f in files if is_held_out(f.relative_to(root).as_posix()))
        train = tuple(f for f in files if f not in set(held))
        return cls(root, train, held)

    def relative(self, files: tuple[Path, ...]) -> list[str]:
        return [f.relative_to(self.root).as_posix() for f in files]


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: tuple[Path, ...], vocab_size: int, out: Path) -> None:
    """A byte-level BPE with `<|bos|>` as id 0 and `<|eos|>` as id 1, written as an HF
    tokenizer.json plus tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer, length=len(files))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS},
            indent=2,
        )
        + "\n"
    )


def special_ids(tok: Tokenizer) -> tuple[int, int]:
    """The ids of `<|bos|>` and `<|eos|>` in a tokenizer `train_tokenizer` wrote."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    if bos is None or eos is None:
        raise ValueError(f"the tokenizer has no {BOS} or no {EOS} token")
    return bos, eos


def encode_files(tokenizer_path: Path, files: tuple[Path, ...]) -> torch.Tensor:
    """One stream: each file as `<|bos|>` + its tokens + `<|eos|>`. -> int32 [N]"""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    bos, eos = special_ids(tok)
    ids: list[int] = []
    for enc in tok.encode_batch([read_text(f) for f in files], add_special_tokens=False):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)
