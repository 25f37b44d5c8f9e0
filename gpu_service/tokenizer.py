"""Byte-level tokenizer: ids 0..255 are bytes, special tokens above them. Torch-free, so the
control plane can use it too."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class ByteTokenizer:
    special_tokens: dict[str, int]
    bos_token_id: int
    eos_token_id: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Bytes only; special and unused ids are dropped, broken UTF-8 replaced."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return (
            json.dumps(
                {
                    "type": "byte",
                    "special_tokens": self.special_tokens,
                    "bos_token_id": self.bos_token_id,
                    "eos_token_id": self.eos_token_id,
                },
                indent=2,
            )
            + "\n"
        )

    @classmethod
    def default(cls) -> ByteTokenizer:
        return cls({"<|bos|>": 256, "<|eos|>": 257}, 256, 257)

    @classmethod
    def load(cls, directory: Path) -> ByteTokenizer:
        d = json.loads((directory / TOKENIZER_FILE).read_text())
        if d.get("type") != "byte":
            raise ValueError(
                f"{directory / TOKENIZER_FILE}: tokenizer type {d.get('type')!r} "
                "is not supported (only 'byte')"
            )
        return cls(dict(d["special_tokens"]), int(d["bos_token_id"]), int(d["eos_token_id"]))
