"""Tokenizers of the control plane, the only process that tokenizes: a checkpoint's
`tokenizer.json` (the `tokenizers` library), or the byte-level fallback (ids 0..255 are bytes,
special tokens above them)."""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer as _Tokenizer

from control_plane.text.chat import write_default_template
from control_plane.text.detok import Tokenizer
from protos.model import TOKENIZER_FILES, read_tokenizer_files

TOKENIZER_FILE = TOKENIZER_FILES[0]


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

    def stream(self) -> ByteStream:
        return ByteStream()

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
    def from_json(cls, spec: dict) -> ByteTokenizer:
        """`to_json`'s file, parsed."""
        return cls(
            dict(spec["special_tokens"]), int(spec["bos_token_id"]), int(spec["eos_token_id"])
        )


class HFTokenizer:
    """A `tokenizers` tokenizer.json (what HF checkpoints ship), with the same three calls the
    control plane uses; special tokens are dropped when decoding. `json` keeps the file's text,
    which llguidance builds its own copy from."""

    def __init__(self, text: str) -> None:
        from tokenizers import Tokenizer

        self.json = text
        self._tok = Tokenizer.from_str(text)
        added = self._tok.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in added.items() if t.special}

    def encode(self, text: str) -> list[int]:
        # `encode_batch` lets go of the GIL while it works (`encode` holds it: a megabyte of
        # text held every other thread, the event loop among them, for a second); the ids are
        # the same.
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def stream(self) -> HFStream:
        return HFStream(self._tok)


@dataclass
class ByteStream:
    """`ByteTokenizer.decode`, a token at a time: bytes accumulate and only complete UTF-8 is
    released (broken sequences replaced as soon as they cannot complete)."""

    utf8: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    def step(self, token_id: int) -> str:
        return self.utf8.decode(bytes([token_id])) if 0 <= token_id < 256 else ""

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)


class HFStream:
    """`HFTokenizer.decode`, a token at a time, by `tokenizers`' DecodeStream; the ids it
    holds back for an incomplete character are kept, with one token of context before them,
    for `flush`."""

    def __init__(self, tok: _Tokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)
        self._context: list[int] = []  # the last token whose step released text
        self._held: list[int] = []

    def step(self, token_id: int) -> str:
        text = self._stream.step(self._tok, token_id)
        if text is None:
            self._held.append(token_id)
            return ""
        self._context, self._held = [token_id], []
        return text

    def flush(self) -> str:
        if not self._held:
            return ""
        prefix = self._tok.decode(self._context, skip_special_tokens=True)
        text = self._tok.decode(self._context + self._held, skip_special_tokens=True)
        self._context, self._held = [], []
        return text[len(prefix) :] if text.startswith(prefix) else text


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def write_byte_level(directory: Path, specials: tuple[str, ...] = ("<|bos|>", "<|eos|>")) -> None:
    """The default model's tokenizer as an HF tokenizer.json: byte b is id b (a byte-level BPE
    with no merges), the special tokens right after; with its config and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    tok.save(str(directory / TOKENIZER_FILE))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": specials[0],
                "eos_token": specials[1],
            },
            indent=2,
        )
        + "\n"
    )
    write_default_template(directory)


@dataclass(frozen=True)
class Tokenization:
    """A checkpoint's text side: its tokenizer, and the files it came from (tokenizer config,
    chat template, generation config), by file name, for whatever else reads them."""

    tokenizer: Tokenizer
    files: Mapping[str, bytes]
    origin: str  # where the files came from, for messages

    @property
    def digest(self) -> str:
        """Equal for equal files: a reconnect that finds another digest found another model."""
        h = hashlib.sha256()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        return h.hexdigest()[:16]

    @classmethod
    def from_files(cls, files: Mapping[str, bytes], origin: str) -> Tokenization:
        """The tokenizer of a checkpoint's files (`TOKENIZER_FILES`, by name): an HF
        tokenizer.json, or this project's older byte file. A missing or unreadable
        tokenizer.json is a `ValueError` with a sentence naming `origin`."""
        data = files.get(TOKENIZER_FILE)
        if data is None:
            raise ValueError(f"{origin} has no {TOKENIZER_FILE}")
        try:
            text = data.decode("utf-8")
            spec = json.loads(text)
            byte_file = isinstance(spec, dict) and spec.get("type") == "byte"
            tokenizer = ByteTokenizer.from_json(spec) if byte_file else HFTokenizer(text)
        except Exception as e:  # the decoder, the parser and `tokenizers` raise their own types
            raise ValueError(
                f"{origin}: {TOKENIZER_FILE} does not load as a tokenizer: {e}"
            ) from None
        return cls(tokenizer, dict(files), origin)

    @classmethod
    def from_dir(cls, directory: Path) -> Tokenization:
        return cls.from_files(read_tokenizer_files(directory), str(directory))


def load_tokenizer(directory: Path) -> Tokenizer:
    """The checkpoint's tokenizer: an HF tokenizer.json, or this project's older byte file."""
    return Tokenization.from_dir(directory).tokenizer
